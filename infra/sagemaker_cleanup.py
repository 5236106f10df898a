"""Deleting what a SageMaker deployment made, and only that.

Every resource ``hearth deploy`` creates carries the tag ``hearth:deployment=N``
(:data:`infra.naming.DEPLOYMENT_TAG`); an endpoint without it was made by someone else and
is never converged or deleted by name unless the user adopts it. Configs and models are
deleted only when their name is derived from the deployment *and* they carry the tag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from infra.errors import DeployError, if_exists, is_not_found
from infra.inference_components import delete_components
from infra.naming import DEPLOYMENT_TAG, is_derived_name, is_owned
from infra.results import Report, Result, Results, Status, ignore
from infra.sagemaker_status import Waiting, describe_endpoint, wait_for_endpoint_deleted

__all__ = ["claim_endpoint", "delete_deployment", "delete_stale", "owned_endpoint"]


@dataclass(frozen=True)
class _Kind:
    """How to list and delete one kind of derived resource (names ``N-<letter>-<hash>``)."""

    letter: str
    label: str  # as results name it
    list_call: str
    list_key: str
    name_field: str  # in the listing and in the delete request
    arn_field: str
    delete_call: str


_CONFIGS = _Kind(
    "c",
    "endpoint-config",
    "list_endpoint_configs",
    "EndpointConfigs",
    "EndpointConfigName",
    "EndpointConfigArn",
    "delete_endpoint_config",
)
_MODELS = _Kind("m", "model", "list_models", "Models", "ModelName", "ModelArn", "delete_model")


def _owned_names(sm: Any, deployment: str, kind: _Kind) -> list[str]:
    """This deployment's configs or models: derived names that carry our tag, sorted."""
    names: list[str] = []
    for page in sm.get_paginator(kind.list_call).paginate(NameContains=deployment):
        for item in page.get(kind.list_key, []):
            name = item[kind.name_field]
            if is_derived_name(name, deployment, kind.letter) and is_owned(
                sm, item[kind.arn_field], deployment
            ):
                names.append(name)
    return sorted(names)


def _delete(sm: Any, kind: _Kind, name: str) -> Result:
    """Delete one config or model; one that is already gone is ``absent``, not an error."""
    try:
        getattr(sm, kind.delete_call)(**{kind.name_field: name})
    except ClientError as exc:
        if is_not_found(exc):
            return Result(kind.label, name, Status.ABSENT)
        raise
    return Result(kind.label, name, Status.DELETED)


def delete_stale(sm: Any, deployment: str, keep_config: str, keep_model: str) -> list[Result]:
    """Delete this deployment's configs and models other than the ones now in use.

    Only call this once the endpoint is ``InService`` on ``keep_config``: SageMaker must not
    lose a config while an update from it is in flight.
    """
    return [
        _delete(sm, kind, name)
        for kind, keep in ((_CONFIGS, keep_config), (_MODELS, keep_model))
        for name in _owned_names(sm, deployment, kind)
        if name != keep
    ]


def owned_endpoint(sm: Any, deployment: str) -> dict[str, Any] | None:
    """``DescribeEndpoint`` of an endpoint this tool created (``None`` if there is none).

    An existing endpoint without our tag raises: it was not made by ``hearth deploy``, and
    deleting someone else's endpoint by name would be a nasty surprise.
    """
    endpoint = describe_endpoint(sm, deployment)
    if endpoint is not None and not is_owned(sm, endpoint["EndpointArn"], deployment):
        raise DeployError(
            f"endpoint {deployment} has no {DEPLOYMENT_TAG}={deployment} tag, so it was not "
            "created by `hearth deploy`; delete it with the AWS console or CLI"
        )
    return endpoint


def claim_endpoint(sm: Any, deployment: str, *, adopt: bool) -> Result | None:
    """Refuse to converge an existing endpoint this tool did not create, unless ``adopt``:
    then tag it as ours (and say so). ``None`` when there is nothing to claim."""
    endpoint = describe_endpoint(sm, deployment)
    if endpoint is None or is_owned(sm, endpoint["EndpointArn"], deployment):
        return None
    if not adopt:
        raise DeployError(
            f"endpoint {deployment} exists but has no {DEPLOYMENT_TAG}={deployment} tag, so "
            "`hearth deploy` did not create it; pass --adopt to take it over"
        )
    sm.add_tags(
        ResourceArn=endpoint["EndpointArn"], Tags=[{"Key": DEPLOYMENT_TAG, "Value": deployment}]
    )
    return Result("endpoint", deployment, Status.UPDATED, "adopted")


def _serves_components(sm: Any, endpoint: dict[str, Any]) -> bool:
    """An endpoint of inference components: its config's variant names no model."""
    config = if_exists(
        sm.describe_endpoint_config, EndpointConfigName=endpoint["EndpointConfigName"]
    )
    variants = (config or {}).get("ProductionVariants") or [{}]
    return config is not None and "ModelName" not in variants[0]


def delete_deployment(
    sm: Any, deployment: str, waiting: Waiting, *, wait: bool = True, report: Report = ignore
) -> list[Result]:
    """Delete the endpoint ``deployment`` and every config and model this tool made for it.

    Refuses to delete an endpoint without our tag: it was not made by ``hearth deploy``.
    Configs and models go only once the endpoint is gone, so with ``wait=False`` they are
    kept (a rerun finishes the job).
    """
    results = Results(report)
    endpoint = owned_endpoint(sm, deployment)
    if endpoint is None:
        results.add(Result("endpoint", deployment, Status.ABSENT))
    else:
        if endpoint["EndpointStatus"] != "Deleting":
            if _serves_components(sm, endpoint):
                for result in delete_components(sm, deployment, waiting):
                    results.add(result)
            sm.delete_endpoint(EndpointName=deployment)
        if not wait:
            results.add(Result("endpoint", deployment, Status.DELETED, "deletion started"))
            waiting.progress("endpoint configs and models are kept until it is gone; rerun")
            return results.items
        wait_for_endpoint_deleted(sm, deployment, waiting)
        results.add(Result("endpoint", deployment, Status.DELETED))
    for kind in (_CONFIGS, _MODELS):
        for name in _owned_names(sm, deployment, kind):
            results.add(_delete(sm, kind, name))
    return results.items
