"""The SageMaker ``hearth deploy`` commands: create, update, delete, and the rollout
they share.

``deploy sagemaker`` and ``deploy update`` end the same way: put the endpoint on a spec
(idempotently) and converge its autoscaling. Application Auto Scaling makes an update
that changes the instance type fail, so a registered target is removed first and put
back (or replaced) after. The command line (:mod:`infra.cli`) only turns arguments into
specs and an :class:`EndpointUpdate`; the rules live here, over :mod:`infra.sagemaker`
and :mod:`infra.autoscaling`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from infra import autoscaling
from infra.artifacts import ModelData, ModelSource, model_data
from infra.errors import DeployError
from infra.naming import validate_deployment_name
from infra.results import Report, Result, Status, ignore
from infra.sagemaker import deploy_endpoint, read_spec
from infra.sagemaker_cleanup import claim_endpoint, delete_deployment, owned_endpoint
from infra.sagemaker_spec import EndpointSpec, MetricsSpec
from infra.sagemaker_status import Progress, Waiting, describe_endpoint
from infra.session import Clients

__all__ = [
    "EndpointUpdate",
    "RolloutOptions",
    "check_scaling_wait",
    "delete",
    "deploy",
    "rollout",
    "update",
    "updated_environment",
    "updated_metrics",
    "updated_scaling",
]


def _quiet(_msg: str) -> None:
    return None


@dataclass(frozen=True)
class RolloutOptions:
    """How a command runs: how to wait (and whether), whether superseded configs and
    models are deleted, and where result lines and progress go."""

    waiting: Waiting = field(default_factory=Waiting)
    wait: bool = True
    prune: bool = True
    report: Report = ignore
    progress: Progress = _quiet


@dataclass(frozen=True)
class EndpointUpdate:
    """What ``deploy update`` asks to change; whatever is left empty keeps what the
    endpoint runs now. The mappings hold spec field names (``instance_type``, ...)."""

    set_env: Mapping[str, str] = field(default_factory=dict)
    unset_env: Sequence[str] = ()
    model: Mapping[str, Any] = field(default_factory=dict)
    """:class:`~infra.sagemaker_spec.ModelSpec` fields (image, role)."""
    variant: Mapping[str, Any] = field(default_factory=dict)
    """:class:`~infra.sagemaker_spec.VariantSpec` fields."""
    metrics: Mapping[str, Any] = field(default_factory=dict)
    """:class:`~infra.sagemaker_spec.MetricsSpec` fields."""
    enable_metrics: bool = False
    disable_metrics: bool = False
    scaling: Mapping[str, Any] = field(default_factory=dict)
    """:class:`~infra.autoscaling.ScalingSpec` fields."""
    disable_scaling: bool = False
    source: ModelSource = field(default_factory=ModelSource)


def _claim(sm: Any, name: str, adopt: bool, report: Report) -> None:
    """Never take over an endpoint `hearth deploy` did not create, unless ``adopt``."""
    result = claim_endpoint(sm, name, adopt=adopt)
    if result is not None:
        report(result)


def _model_data(
    clients: Clients, source: ModelSource, name: str, options: RolloutOptions
) -> ModelData | None:
    data, result = model_data(clients, source, name, options.progress)
    if result is not None:
        options.report(result)
    return data


def deploy(
    clients: Clients,
    spec: EndpointSpec,
    scaling: autoscaling.ScalingSpec | None,
    options: RolloutOptions,
    *,
    source: ModelSource = ModelSource(),
    adopt: bool = False,
) -> None:
    """``deploy sagemaker``: create the endpoint or converge it to exactly ``spec`` (with
    the model data ``source`` names)."""
    # Validate everything before the (possibly long) upload.
    validate_deployment_name(spec.name)
    spec.validate()
    check_scaling_wait(scaling, wait=options.wait)
    sm, aas = clients("sagemaker"), clients("application-autoscaling")
    _claim(sm, spec.name, adopt, options.report)
    data = _model_data(clients, source, spec.name, options)
    spec = replace(spec, model=replace(spec.model, model_data=data))
    rollout(sm, aas, spec, scaling, options)


def update(
    clients: Clients, name: str, changes: EndpointUpdate, options: RolloutOptions, *, adopt: bool
) -> None:
    """``deploy update``: read what the endpoint runs, apply ``changes``, roll onto it."""
    validate_deployment_name(name)
    sm, aas = clients("sagemaker"), clients("application-autoscaling")
    _claim(sm, name, adopt, options.report)
    current = read_spec(sm, name)
    environment = updated_environment(current.model.environment, changes.set_env, changes.unset_env)
    model = replace(current.model, environment=environment, **changes.model)
    variant = replace(current.variant, **changes.variant)
    metrics = updated_metrics(
        current.metrics,
        changes.metrics,
        enable=changes.enable_metrics,
        disable=changes.disable_metrics,
    )
    scaling = None
    if not changes.disable_scaling:
        scaling = updated_scaling(aas, name, variant.name, changes.scaling)
    candidate = EndpointSpec(name, model, variant, metrics, current.async_inference)
    candidate.validate()
    check_scaling_wait(scaling, wait=options.wait)
    data = _model_data(clients, changes.source, name, options)
    if data is not None:
        candidate = replace(candidate, model=replace(model, model_data=data))
    rollout(
        sm,
        aas,
        candidate,
        scaling,
        options,
        remove_scaling=changes.disable_scaling,
        running=current,
    )


def delete(clients: Clients, name: str, options: RolloutOptions) -> None:
    """``deploy delete``: autoscaling, endpoint, then every config and model made for it."""
    validate_deployment_name(name)
    sm, aas = clients("sagemaker"), clients("application-autoscaling")
    owned_endpoint(sm, name)  # refuse before touching anything of a foreign one
    for result in autoscaling.remove_scaling(aas, name):
        options.report(result)
    delete_deployment(sm, name, options.waiting, wait=options.wait, report=options.report)


def check_scaling_wait(scaling: autoscaling.ScalingSpec | None, *, wait: bool) -> None:
    """Autoscaling can only be registered on an InService endpoint: refuse ``--no-wait``."""
    if scaling is not None:
        scaling.validate()
        if not wait:
            raise DeployError(
                "autoscaling can only be registered on an InService endpoint; drop --no-wait"
            )


def rollout(
    sm: Any,
    aas: Any,
    spec: EndpointSpec,
    scaling: autoscaling.ScalingSpec | None,
    options: RolloutOptions,
    *,
    remove_scaling: bool = False,
    running: EndpointSpec | None = None,
) -> None:
    """Put the endpoint on `spec` and its autoscaling on `scaling`.

    ``running`` is what an update read back from the endpoint: when the requested spec
    equals it, the endpoint is left alone even if AWS echoed a field in a way that would
    hash differently (no needless rolling update of a GPU fleet).
    """
    report, wait = options.report, options.wait
    variant = spec.variant.name
    restore: autoscaling.ScalingSpec | None = None
    others: list[dict[str, Any]] = []
    if describe_endpoint(sm, spec.name) is not None:
        current = autoscaling.current_scaling(aas, spec.name, variant)
        if current is not None:
            now = running or read_spec(sm, spec.name)
            if remove_scaling or now.variant.instance_type != spec.variant.instance_type:
                if not remove_scaling:
                    # Deregistering the target deletes every policy on it, the user's
                    # own too: they are read first and put back with hearth's.
                    others = autoscaling.foreign_policies(aas, spec.name, variant)
                    if others and not wait:
                        names = ", ".join(p["PolicyName"] for p in others)
                        raise DeployError(
                            f"the variant has scaling policies hearth did not create ({names}); "
                            "an instance-type change deregisters its scaling target, which "
                            "deletes them: run without --no-wait so they are put back once "
                            "the endpoint is InService"
                        )
                for result in autoscaling.remove_scaling(aas, spec.name, variant):
                    report(result)
                restore = None if remove_scaling else current
    if running is not None and spec == running:
        report(Result("endpoint", spec.name, Status.UNCHANGED, "no endpoint setting changed"))
    else:
        deploy_endpoint(sm, spec, options.waiting, wait=wait, prune=options.prune, report=report)
    wanted = scaling or restore
    if wanted is not None and not wait:
        # Only reachable via `restore` (explicit scaling without waiting is refused earlier).
        options.progress(
            "autoscaling was removed for the instance type change; once the endpoint is "
            f"InService, restore it with `hearth deploy update --name {spec.name} "
            f"--min-capacity {wanted.min_capacity} --max-capacity {wanted.max_capacity} "
            f"--target-invocations {wanted.target_invocations:g}`"
        )
    elif wanted is not None:
        for result in autoscaling.ensure_scaling(aas, spec.name, variant, wanted):
            report(result)
        for result in autoscaling.restore_policies(aas, spec.name, variant, others):
            report(result)


def updated_environment(
    current: Mapping[str, str], set_env: Mapping[str, str], unset: Sequence[str]
) -> dict[str, str]:
    """The container environment after an update: `set_env` merged in, `unset` removed."""
    environment = dict(current)
    environment.update(set_env)
    for key in unset:
        environment.pop(key, None)
    return environment


def updated_metrics(
    current: MetricsSpec | None,
    changes: Mapping[str, Any],
    *,
    enable: bool,
    disable: bool,
) -> MetricsSpec | None:
    """Prometheus metrics after an update: off with `disable`; on (with `changes`) when
    `enable` or already on and something changed; else as they were."""
    if disable:
        return None
    if enable or (current is not None and changes):
        return replace(current or MetricsSpec(), **changes)
    return current


def updated_scaling(
    aas: Any, endpoint: str, variant: str, changes: Mapping[str, Any]
) -> autoscaling.ScalingSpec | None:
    """The autoscaling an update asks for: the registered one with `changes` applied, or a
    new one (which needs ``max_capacity``); None when nothing about scaling changed."""
    if not changes:
        return None
    existing = autoscaling.current_scaling(aas, endpoint, variant)
    if existing is None and "max_capacity" not in changes:
        raise DeployError("the endpoint does not autoscale yet: give --max-capacity")
    if existing is not None:
        return replace(existing, **changes)
    return autoscaling.ScalingSpec(**changes)
