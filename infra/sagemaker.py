"""SageMaker real-time endpoints: model, endpoint config, endpoint.

A deployment named ``N`` is three resources:

* model ``N-m-<hash>``: image, execution role, environment, model data;
* endpoint config ``N-c-<hash>``: one production variant (instance type and count, start-up
  and download timeouts, volume, host AMI) and optional detailed metrics;
* endpoint ``N``.

Models and configs cannot be changed in place, so their names hash their content
(:mod:`infra.naming`; the specs are in :mod:`infra.sagemaker_spec`, re-exported here).
Deploying the same inputs again is a no-op; deploying different inputs creates a new
model/config and rolls the endpoint onto it with ``UpdateEndpoint`` (no downtime), then
deletes the superseded ones.  Everything is tagged ``hearth:deployment=N`` and
:func:`delete_deployment` removes only tagged resources.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from infra.artifacts import ModelData
from infra.errors import DeployError, is_not_found
from infra.naming import DEPLOYMENT_TAG, is_derived_name
from infra.results import Result, Status
from infra.sagemaker_spec import (
    DEFAULT_VARIANT,
    METRIC_FREQUENCIES,
    ROUTING_STRATEGIES,
    EndpointSpec,
    MetricsSpec,
    ModelSpec,
    VariantSpec,
)

__all__ = [
    "DEFAULT_VARIANT",
    "METRIC_FREQUENCIES",
    "ROUTING_STRATEGIES",
    "EndpointSpec",
    "MetricsSpec",
    "ModelSpec",
    "Report",
    "VariantSpec",
    "Waiting",
    "claim_endpoint",
    "delete_deployment",
    "delete_stale",
    "deploy_endpoint",
    "describe_endpoint",
    "ensure_endpoint",
    "ensure_endpoint_config",
    "ensure_model",
    "owned_endpoint",
    "read_spec",
    "wait_for_endpoint",
    "wait_for_endpoint_deleted",
]

# States an endpoint passes through on its own; anything else is terminal.
_TRANSITIONAL = {"Creating", "Updating", "SystemUpdating", "RollingBack", "Deleting"}

Progress = Callable[[str], None]
Report = Callable[[Result], None]


def _quiet(_msg: str) -> None:
    return None


def _ignore(_result: Result) -> None:
    return None


class _Collector:
    """Keeps results in order and hands each to ``report`` the moment it exists."""

    def __init__(self, report: Report) -> None:
        self.items: list[Result] = []
        self._report = report

    def add(self, result: Result) -> Result:
        self.items.append(result)
        self._report(result)
        return result


# ---------------------------------------------------------------------------- describe


def _describe(call: Callable[..., dict[str, Any]], **kwargs: Any) -> dict[str, Any] | None:
    try:
        return call(**kwargs)
    except ClientError as exc:
        if is_not_found(exc):
            return None
        raise


def describe_endpoint(sm: Any, name: str) -> dict[str, Any] | None:
    """``DescribeEndpoint``, or ``None`` when there is no such endpoint."""
    return _describe(sm.describe_endpoint, EndpointName=name)


def _tags(sm: Any, arn: str) -> dict[str, str]:
    tags: dict[str, str] = {}
    for page in sm.get_paginator("list_tags").paginate(ResourceArn=arn):
        tags.update({t["Key"]: t["Value"] for t in page.get("Tags", [])})
    return tags


def _owned(sm: Any, arn: str, deployment: str) -> bool:
    return _tags(sm, arn).get(DEPLOYMENT_TAG) == deployment


def read_spec(sm: Any, name: str) -> EndpointSpec:
    """Rebuild the :class:`EndpointSpec` an existing endpoint runs, for ``deploy update``.

    Only single-variant endpoints (the kind this tool creates) can be read back.
    """
    endpoint = describe_endpoint(sm, name)
    if endpoint is None:
        raise DeployError(f"endpoint {name} not found; create it with `hearth deploy sagemaker`")
    config = sm.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])
    variants = config["ProductionVariants"]
    if len(variants) != 1:
        raise DeployError(f"endpoint {name} has {len(variants)} variants; only one is supported")
    pv = variants[0]
    model = sm.describe_model(ModelName=pv["ModelName"])
    container = model.get("PrimaryContainer") or (model.get("Containers") or [{}])[0]
    metrics: MetricsSpec | None = None
    endpoints = container.get("ContainerMetricsConfig", {}).get("MetricsEndpoints") or []
    detailed = config.get("MetricsConfig", {}).get("EnableDetailedObservability")
    if endpoints or detailed:
        first = endpoints[0] if endpoints else {}
        metrics = MetricsSpec(
            path=first.get("MetricsEndpointPath", "/metrics"),
            frequency_s=first.get(
                "MetricPublishFrequencyInSeconds",
                config.get("MetricsConfig", {}).get("MetricPublishFrequencyInSeconds", 60),
            ),
        )
    return EndpointSpec(
        name=name,
        model=ModelSpec(
            image=container["Image"],
            role_arn=model["ExecutionRoleArn"],
            environment=dict(container.get("Environment", {})),
            model_data=ModelData.from_container(container),
        ),
        variant=VariantSpec(
            instance_type=pv["InstanceType"],
            instance_count=pv.get("InitialInstanceCount", 1),
            name=pv["VariantName"],
            startup_timeout_s=pv.get("ContainerStartupHealthCheckTimeoutInSeconds"),
            download_timeout_s=pv.get("ModelDataDownloadTimeoutInSeconds"),
            volume_size_gb=pv.get("VolumeSizeInGB"),
            inference_ami_version=pv.get("InferenceAmiVersion"),
            routing_strategy=pv.get("RoutingConfig", {}).get("RoutingStrategy"),
        ),
        metrics=metrics,
    )


# ---------------------------------------------------------------------------- ensure


def ensure_model(sm: Any, spec: EndpointSpec) -> Result:
    """Create the model unless a model with its content-derived name already exists."""
    name = spec.model_name
    if _describe(sm.describe_model, ModelName=name) is not None:
        return Result("model", name, Status.UNCHANGED)
    sm.create_model(**spec.model_request())
    return Result("model", name, Status.CREATED, spec.model.image)


def ensure_endpoint_config(sm: Any, spec: EndpointSpec) -> Result:
    """Create the endpoint config unless one with its content-derived name exists."""
    name = spec.config_name
    if _describe(sm.describe_endpoint_config, EndpointConfigName=name) is not None:
        return Result("endpoint-config", name, Status.UNCHANGED)
    sm.create_endpoint_config(**spec.config_request())
    v = spec.variant
    return Result(
        "endpoint-config", name, Status.CREATED, f"{v.instance_count} x {v.instance_type}"
    )


@dataclass(frozen=True)
class Waiting:
    """How to wait for SageMaker: overall limit, poll interval, where progress goes.

    ``sleep`` and ``clock`` are injectable so tests can drive the loop without real time.
    """

    timeout_s: float = 3600.0
    poll_s: float = 15.0
    progress: Progress = _quiet
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _poll(sm: Any, name: str, waiting: Waiting) -> Iterator[dict[str, Any] | None]:
    """Yield fresh ``DescribeEndpoint`` results (``None`` once gone) until the caller stops,
    reporting each status change, and fail after ``waiting.timeout_s``."""
    start = waiting.clock()
    last: str | None = None
    while True:
        endpoint = describe_endpoint(sm, name)
        status = endpoint["EndpointStatus"] if endpoint else "gone"
        elapsed = waiting.clock() - start
        if status != last:
            waiting.progress(f"endpoint {name}: {status} ({_elapsed(elapsed)})")
            last = status
        yield endpoint
        if elapsed > waiting.timeout_s:
            raise DeployError(
                f"endpoint {name} still {status} after {_elapsed(elapsed)}; "
                "it may still finish: check it with `aws sagemaker describe-endpoint`"
            )
        waiting.sleep(waiting.poll_s)


def wait_for_endpoint(sm: Any, name: str, waiting: Waiting) -> dict[str, Any]:
    """Wait until the endpoint leaves its transitional states; fail unless ``InService``."""
    for endpoint in _poll(sm, name, waiting):
        if endpoint is None:
            raise DeployError(f"endpoint {name} disappeared while waiting for it")
        status = endpoint["EndpointStatus"]
        if status in _TRANSITIONAL:
            continue
        if status != "InService":
            reason = endpoint.get("FailureReason", "no reason given")
            raise DeployError(f"endpoint {name} is {status}: {reason}")
        return endpoint
    raise AssertionError("unreachable")  # pragma: no cover


def wait_for_endpoint_deleted(sm: Any, name: str, waiting: Waiting) -> None:
    """Wait until ``DescribeEndpoint`` no longer finds the endpoint."""
    for endpoint in _poll(sm, name, waiting):
        if endpoint is None:
            return
        if endpoint["EndpointStatus"] != "Deleting":
            raise DeployError(f"endpoint {name} is {endpoint['EndpointStatus']}, not Deleting")


def ensure_endpoint(sm: Any, spec: EndpointSpec, waiting: Waiting) -> Result:
    """Create the endpoint, or roll it onto ``spec``'s config when it runs another one.

    An endpoint still creating/updating (say, an interrupted earlier run) is waited for
    first, since SageMaker refuses to update it meanwhile.  A failed endpoint cannot be
    updated: the message says to delete it.
    """
    endpoint = describe_endpoint(sm, spec.name)
    if endpoint is None:
        sm.create_endpoint(
            EndpointName=spec.name, EndpointConfigName=spec.config_name, Tags=spec.tags
        )
        return Result("endpoint", spec.name, Status.CREATED, spec.config_name)
    if endpoint["EndpointStatus"] in _TRANSITIONAL:
        waiting.progress(f"endpoint {spec.name}: waiting for {endpoint['EndpointStatus']}")
        endpoint = wait_for_endpoint(sm, spec.name, waiting)
    if endpoint["EndpointStatus"] == "Failed":
        raise DeployError(
            f"endpoint {spec.name} is Failed ({endpoint.get('FailureReason', 'no reason')}); "
            f"remove it with `hearth deploy delete --name {spec.name}` and deploy again"
        )
    if endpoint["EndpointConfigName"] == spec.config_name:
        return Result("endpoint", spec.name, Status.UNCHANGED, spec.config_name)
    sm.update_endpoint(EndpointName=spec.name, EndpointConfigName=spec.config_name)
    return Result(
        "endpoint",
        spec.name,
        Status.UPDATED,
        f"{endpoint['EndpointConfigName']} -> {spec.config_name}",
    )


# ---------------------------------------------------------------------------- delete


def _owned_configs(sm: Any, deployment: str) -> list[str]:
    names: list[str] = []
    for page in sm.get_paginator("list_endpoint_configs").paginate(NameContains=deployment):
        for item in page.get("EndpointConfigs", []):
            name = item["EndpointConfigName"]
            if is_derived_name(name, deployment, "c") and _owned(
                sm, item["EndpointConfigArn"], deployment
            ):
                names.append(name)
    return sorted(names)


def _owned_models(sm: Any, deployment: str) -> list[str]:
    names: list[str] = []
    for page in sm.get_paginator("list_models").paginate(NameContains=deployment):
        for item in page.get("Models", []):
            name = item["ModelName"]
            if is_derived_name(name, deployment, "m") and _owned(sm, item["ModelArn"], deployment):
                names.append(name)
    return sorted(names)


def _delete_config(sm: Any, name: str) -> Result:
    try:
        sm.delete_endpoint_config(EndpointConfigName=name)
    except ClientError as exc:
        if is_not_found(exc):
            return Result("endpoint-config", name, Status.ABSENT)
        raise
    return Result("endpoint-config", name, Status.DELETED)


def _delete_model(sm: Any, name: str) -> Result:
    try:
        sm.delete_model(ModelName=name)
    except ClientError as exc:
        if is_not_found(exc):
            return Result("model", name, Status.ABSENT)
        raise
    return Result("model", name, Status.DELETED)


def delete_stale(sm: Any, deployment: str, keep_config: str, keep_model: str) -> list[Result]:
    """Delete this deployment's configs and models other than the ones now in use.

    Only call this once the endpoint is ``InService`` on ``keep_config``: SageMaker must not
    lose a config while an update from it is in flight.
    """
    results = [
        _delete_config(sm, name) for name in _owned_configs(sm, deployment) if name != keep_config
    ]
    results += [
        _delete_model(sm, name) for name in _owned_models(sm, deployment) if name != keep_model
    ]
    return results


def owned_endpoint(sm: Any, deployment: str) -> dict[str, Any] | None:
    """``DescribeEndpoint`` of an endpoint this tool created (``None`` if there is none).

    An existing endpoint without our tag raises: it was not made by ``hearth deploy``, and
    deleting someone else's endpoint by name would be a nasty surprise.
    """
    endpoint = describe_endpoint(sm, deployment)
    if endpoint is not None and not _owned(sm, endpoint["EndpointArn"], deployment):
        raise DeployError(
            f"endpoint {deployment} has no {DEPLOYMENT_TAG}={deployment} tag, so it was not "
            "created by `hearth deploy`; delete it with the AWS console or CLI"
        )
    return endpoint


def claim_endpoint(sm: Any, deployment: str, *, adopt: bool) -> Result | None:
    """Refuse to converge an existing endpoint this tool did not create, unless ``adopt``:
    then tag it as ours (and say so). ``None`` when there is nothing to claim."""
    endpoint = describe_endpoint(sm, deployment)
    if endpoint is None or _owned(sm, endpoint["EndpointArn"], deployment):
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


def delete_deployment(
    sm: Any, deployment: str, waiting: Waiting, *, wait: bool = True, report: Report = _ignore
) -> list[Result]:
    """Delete the endpoint ``deployment`` and every config and model this tool made for it.

    Refuses to delete an endpoint without our tag: it was not made by ``hearth deploy``.
    Configs and models go only once the endpoint is gone, so with ``wait=False`` they are
    kept (a rerun finishes the job).
    """
    results = _Collector(report)
    endpoint = owned_endpoint(sm, deployment)
    if endpoint is None:
        results.add(Result("endpoint", deployment, Status.ABSENT))
    else:
        if endpoint["EndpointStatus"] != "Deleting":
            sm.delete_endpoint(EndpointName=deployment)
        if not wait:
            results.add(Result("endpoint", deployment, Status.DELETED, "deletion started"))
            waiting.progress("endpoint configs and models are kept until it is gone; rerun")
            return results.items
        wait_for_endpoint_deleted(sm, deployment, waiting)
        results.add(Result("endpoint", deployment, Status.DELETED))
    for name in _owned_configs(sm, deployment):
        results.add(_delete_config(sm, name))
    for name in _owned_models(sm, deployment):
        results.add(_delete_model(sm, name))
    return results.items


def deploy_endpoint(
    sm: Any,
    spec: EndpointSpec,
    waiting: Waiting,
    *,
    wait: bool = True,
    prune: bool = True,
    report: Report = _ignore,
) -> list[Result]:
    """Converge the endpoint to ``spec``: model, config, endpoint, then wait and prune.

    Each result is passed to ``report`` as soon as it happens (creation can take many
    minutes, the user should see "endpoint ...: created" before the wait).  After an update
    the endpoint must end up on the new config; SageMaker rolls a failed update back to the
    old one (status ``InService`` again), which is reported as an error.  Superseded
    configs/models are deleted only after a successful wait (``prune``).
    """
    spec.validate()
    results = _Collector(report)
    results.add(ensure_model(sm, spec))
    results.add(ensure_endpoint_config(sm, spec))
    endpoint = results.add(ensure_endpoint(sm, spec, waiting))
    if not wait:
        return results.items
    if endpoint.status is not Status.UNCHANGED:
        described = wait_for_endpoint(sm, spec.name, waiting)
        if described["EndpointConfigName"] != spec.config_name:
            raise DeployError(
                f"update of endpoint {spec.name} was rolled back to "
                f"{described['EndpointConfigName']}: "
                f"{described.get('FailureReason', 'no reason given')}"
            )
    if prune:
        for result in delete_stale(sm, spec.name, spec.config_name, spec.model_name):
            results.add(result)
    return results.items
