"""Instance autoscaling of a SageMaker endpoint variant (Application Auto Scaling).

A variant scales on the dimension ``sagemaker:variant:DesiredInstanceCount`` of resource
``endpoint/<endpoint>/variant/<variant>``, driven by a target-tracking policy on the
predefined metric ``SageMakerVariantInvocationsPerInstance`` (invocations per instance per
minute).  For an LLM, one invocation is a whole generation, so the target is small compared
with classic models: pick it from a benchmark (``hearth bench``) as the per-minute request
rate one instance sustains at an acceptable latency, times ~0.7 for headroom.

Application Auto Scaling refuses to register a variant that is not ``InService``, and an
endpoint update that changes the instance type of a registered variant fails, so callers
register after waiting and deregister before such an update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from infra.errors import DeployError, is_not_found
from infra.results import Result, Status

__all__ = [
    "DIMENSION",
    "METRIC",
    "NAMESPACE",
    "ScalingSpec",
    "current_scaling",
    "ensure_scaling",
    "policy_name",
    "remove_scaling",
    "resource_id",
]

NAMESPACE = "sagemaker"
DIMENSION = "sagemaker:variant:DesiredInstanceCount"
METRIC = "SageMakerVariantInvocationsPerInstance"


@dataclass(frozen=True)
class ScalingSpec:
    """Capacity bounds and the target-tracking settings.

    Scale-out reacts fast (60 s cooldown) because queued LLM requests pile up quickly;
    scale-in waits longer (300 s) because a new instance takes minutes to load the model.
    """

    max_capacity: int
    min_capacity: int = 1
    target_invocations: float = 60.0
    scale_in_cooldown_s: int = 300
    scale_out_cooldown_s: int = 60

    def validate(self) -> None:
        """SageMaker variants need at least one instance; bounds must be ordered."""
        if self.min_capacity < 1:
            raise DeployError("minimum capacity of an endpoint variant must be at least 1")
        if self.max_capacity < self.min_capacity:
            raise DeployError(
                f"max capacity ({self.max_capacity}) is below min capacity ({self.min_capacity})"
            )
        if self.target_invocations <= 0:
            raise DeployError("target invocations per instance must be positive")
        if self.scale_in_cooldown_s < 0 or self.scale_out_cooldown_s < 0:
            raise DeployError("cooldowns cannot be negative")

    def policy_configuration(self) -> dict[str, Any]:
        """``TargetTrackingScalingPolicyConfiguration`` of ``PutScalingPolicy``."""
        return {
            "TargetValue": float(self.target_invocations),
            "PredefinedMetricSpecification": {"PredefinedMetricType": METRIC},
            "ScaleInCooldown": self.scale_in_cooldown_s,
            "ScaleOutCooldown": self.scale_out_cooldown_s,
        }


def resource_id(endpoint: str, variant: str) -> str:
    """The Application Auto Scaling resource id of an endpoint variant."""
    return f"endpoint/{endpoint}/variant/{variant}"


def policy_name(endpoint: str, variant: str) -> str:
    """Name of the one target-tracking policy this tool manages per variant."""
    return f"{endpoint}-{variant}-invocations"


def _dimension(rid: str) -> dict[str, str]:
    """The keyword arguments that name one variant's scalable dimension in every call."""
    return {"ServiceNamespace": NAMESPACE, "ResourceId": rid, "ScalableDimension": DIMENSION}


def _target(aas: Any, rid: str) -> dict[str, Any] | None:
    found = aas.describe_scalable_targets(
        ServiceNamespace=NAMESPACE, ResourceIds=[rid], ScalableDimension=DIMENSION
    ).get("ScalableTargets", [])
    return found[0] if found else None


def _policies(aas: Any, rid: str, *names: str) -> list[dict[str, Any]]:
    """The variant's scaling policies: those named, or all of them."""
    by_name = {"PolicyNames": list(names)} if names else {}
    response = aas.describe_scaling_policies(**_dimension(rid), **by_name)
    return list(response.get("ScalingPolicies", []))


def _policy(aas: Any, rid: str, name: str) -> dict[str, Any] | None:
    found = _policies(aas, rid, name)
    return found[0] if found else None


def current_scaling(aas: Any, endpoint: str, variant: str) -> ScalingSpec | None:
    """The scaling now registered for the variant, or ``None`` if it does not scale."""
    rid = resource_id(endpoint, variant)
    target = _target(aas, rid)
    if target is None:
        return None
    spec = ScalingSpec(max_capacity=target["MaxCapacity"], min_capacity=target["MinCapacity"])
    policy = _policy(aas, rid, policy_name(endpoint, variant))
    if policy is None:
        return spec
    conf = policy.get("TargetTrackingScalingPolicyConfiguration", {})
    return ScalingSpec(
        max_capacity=spec.max_capacity,
        min_capacity=spec.min_capacity,
        target_invocations=conf.get("TargetValue", spec.target_invocations),
        scale_in_cooldown_s=conf.get("ScaleInCooldown", spec.scale_in_cooldown_s),
        scale_out_cooldown_s=conf.get("ScaleOutCooldown", spec.scale_out_cooldown_s),
    )


def ensure_scaling(aas: Any, endpoint: str, variant: str, spec: ScalingSpec) -> list[Result]:
    """Register the variant as a scalable target and put the policy; no-op when equal."""
    spec.validate()
    rid = resource_id(endpoint, variant)
    results: list[Result] = []

    target = _target(aas, rid)
    bounds = (spec.min_capacity, spec.max_capacity)
    if target is not None and (target["MinCapacity"], target["MaxCapacity"]) == bounds:
        results.append(Result("scalable-target", rid, Status.UNCHANGED))
    else:
        aas.register_scalable_target(
            **_dimension(rid), MinCapacity=spec.min_capacity, MaxCapacity=spec.max_capacity
        )
        status = Status.CREATED if target is None else Status.UPDATED
        results.append(
            Result("scalable-target", rid, status, f"{spec.min_capacity}-{spec.max_capacity}")
        )

    name = policy_name(endpoint, variant)
    wanted = spec.policy_configuration()
    policy = _policy(aas, rid, name)
    current = (policy or {}).get("TargetTrackingScalingPolicyConfiguration")
    if policy is not None and current is not None and _same_policy(current, wanted):
        results.append(Result("scaling-policy", name, Status.UNCHANGED))
    else:
        aas.put_scaling_policy(
            PolicyName=name,
            **_dimension(rid),
            PolicyType="TargetTrackingScaling",
            TargetTrackingScalingPolicyConfiguration=wanted,
        )
        status = Status.CREATED if policy is None else Status.UPDATED
        results.append(
            Result("scaling-policy", name, status, f"{spec.target_invocations:g} invocations/min")
        )
    return results


def _same_policy(current: dict[str, Any], wanted: dict[str, Any]) -> bool:
    return (
        float(current.get("TargetValue", -1)) == wanted["TargetValue"]
        and current.get("PredefinedMetricSpecification", {}).get("PredefinedMetricType") == METRIC
        and current.get("ScaleInCooldown") == wanted["ScaleInCooldown"]
        and current.get("ScaleOutCooldown") == wanted["ScaleOutCooldown"]
    )


_POLICY_FIELDS = (
    "PolicyType",
    "TargetTrackingScalingPolicyConfiguration",
    "StepScalingPolicyConfiguration",
    "PredictiveScalingPolicyConfiguration",
)


def foreign_policies(aas: Any, endpoint: str, variant: str) -> list[dict[str, Any]]:
    """The variant's scaling policies that hearth did not put (a user's own), as
    `put_scaling_policy` arguments, so they can be put back after a deregistration."""
    rid = resource_id(endpoint, variant)
    ours = policy_name(endpoint, variant)
    kept = []
    for policy in _policies(aas, rid):
        if policy["PolicyName"] == ours:
            continue
        kept.append(
            {"PolicyName": policy["PolicyName"]}
            | {k: policy[k] for k in _POLICY_FIELDS if k in policy}
        )
    return kept


def restore_policies(
    aas: Any, endpoint: str, variant: str, policies: list[dict[str, Any]]
) -> list[Result]:
    """Put back the policies `foreign_policies` read (the target must be registered)."""
    rid = resource_id(endpoint, variant)
    results = []
    for policy in policies:
        aas.put_scaling_policy(**_dimension(rid), **policy)
        results.append(Result("scaling-policy", policy["PolicyName"], Status.CREATED, "restored"))
    return results


def _targets_of(aas: Any, endpoint: str) -> list[str]:
    prefix = f"endpoint/{endpoint}/variant/"
    ids: list[str] = []
    for page in aas.get_paginator("describe_scalable_targets").paginate(
        ServiceNamespace=NAMESPACE, ScalableDimension=DIMENSION
    ):
        ids += [
            t["ResourceId"]
            for t in page.get("ScalableTargets", [])
            if t["ResourceId"].startswith(prefix)
        ]
    return sorted(ids)


def remove_scaling(aas: Any, endpoint: str, variant: str | None = None) -> list[Result]:
    """Delete the scaling policies and deregister the target(s) of the endpoint.

    With ``variant=None`` every variant of the endpoint is handled, so ``delete`` leaves
    nothing behind even for variants this tool did not name.
    """
    ids = [resource_id(endpoint, variant)] if variant else _targets_of(aas, endpoint)
    results: list[Result] = []
    for rid in ids:
        for policy in _policies(aas, rid):
            aas.delete_scaling_policy(PolicyName=policy["PolicyName"], **_dimension(rid))
            results.append(Result("scaling-policy", policy["PolicyName"], Status.DELETED))
        try:
            aas.deregister_scalable_target(**_dimension(rid))
        except ClientError as exc:
            # Application Auto Scaling says ValidationException "No scalable target found".
            if is_not_found(exc) or "no scalable target" in str(exc).lower():
                if variant:
                    results.append(Result("scalable-target", rid, Status.ABSENT))
                continue
            raise
        results.append(Result("scalable-target", rid, Status.DELETED))
    return results
