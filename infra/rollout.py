"""Rolling an endpoint onto a spec, and the spec an update asks for.

``hearth deploy sagemaker`` and ``hearth deploy update`` end the same way: put the
endpoint on a spec (idempotently) and converge its autoscaling. Application Auto Scaling
makes an update that changes the instance type fail, so a registered target is removed
first and put back (or replaced) after. The command line only gathers arguments; the
rules live here, next to :mod:`infra.sagemaker` and :mod:`infra.autoscaling`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from infra import autoscaling, sagemaker
from infra.errors import DeployError
from infra.results import Result, Status

Report = Callable[[Result], None]
Progress = Callable[[str], None]


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
    spec: sagemaker.EndpointSpec,
    scaling: autoscaling.ScalingSpec | None,
    waiting: sagemaker.Waiting,
    *,
    wait: bool,
    prune: bool,
    report: Report,
    progress: Progress,
    remove_scaling: bool = False,
    running: sagemaker.EndpointSpec | None = None,
) -> None:
    """Put the endpoint on `spec` and its autoscaling on `scaling`.

    ``running`` is what an update read back from the endpoint: when the requested spec
    equals it, the endpoint is left alone even if AWS echoed a field in a way that would
    hash differently (no needless rolling update of a GPU fleet).
    """
    variant = spec.variant.name
    restore: autoscaling.ScalingSpec | None = None
    if sagemaker.describe_endpoint(sm, spec.name) is not None:
        current = autoscaling.current_scaling(aas, spec.name, variant)
        if current is not None:
            now = running or sagemaker.read_spec(sm, spec.name)
            if remove_scaling or now.variant.instance_type != spec.variant.instance_type:
                for result in autoscaling.remove_scaling(aas, spec.name, variant):
                    report(result)
                restore = None if remove_scaling else current
    if running is not None and spec == running:
        report(Result("endpoint", spec.name, Status.UNCHANGED, "no endpoint setting changed"))
    else:
        sagemaker.deploy_endpoint(sm, spec, waiting, wait=wait, prune=prune, report=report)
    wanted = scaling or restore
    if wanted is not None and not wait:
        # Only reachable via `restore` (explicit scaling without waiting is refused earlier).
        progress(
            "autoscaling was removed for the instance type change; once the endpoint is "
            f"InService, restore it with `hearth deploy update --name {spec.name} "
            f"--min-capacity {wanted.min_capacity} --max-capacity {wanted.max_capacity} "
            f"--target-invocations {wanted.target_invocations:g}`"
        )
    elif wanted is not None:
        for result in autoscaling.ensure_scaling(aas, spec.name, variant, wanted):
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
    current: sagemaker.MetricsSpec | None,
    changes: Mapping[str, Any],
    *,
    enable: bool,
    disable: bool,
) -> sagemaker.MetricsSpec | None:
    """Prometheus metrics after an update: off with `disable`; on (with `changes`) when
    `enable` or already on and something changed; else as they were."""
    if disable:
        return None
    if enable or (current is not None and changes):
        return replace(current or sagemaker.MetricsSpec(), **changes)
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
