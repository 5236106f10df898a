"""Application Auto Scaling of an endpoint variant (moto)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from infra import autoscaling
from infra.autoscaling import DIMENSION, METRIC, ScalingSpec
from infra.errors import DeployError
from infra.results import Status

RID = "endpoint/demo/variant/AllTraffic"


@pytest.fixture
def aas(clients: Any) -> Any:
    return clients("application-autoscaling")


def targets(aas: Any) -> list[dict[str, Any]]:
    return aas.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"]


def policies(aas: Any, rid: str = RID) -> list[dict[str, Any]]:
    return aas.describe_scaling_policies(ServiceNamespace="sagemaker", ResourceId=rid)[
        "ScalingPolicies"
    ]


def test_registers_target_and_target_tracking_policy(aas: Any) -> None:
    spec = ScalingSpec(max_capacity=4, min_capacity=2, target_invocations=30)
    results = autoscaling.ensure_scaling(aas, "demo", "AllTraffic", spec)

    assert [(r.kind, r.status) for r in results] == [
        ("scalable-target", Status.CREATED),
        ("scaling-policy", Status.CREATED),
    ]
    (target,) = targets(aas)
    assert target["ResourceId"] == RID
    assert target["ScalableDimension"] == DIMENSION == "sagemaker:variant:DesiredInstanceCount"
    assert (target["MinCapacity"], target["MaxCapacity"]) == (2, 4)
    (policy,) = policies(aas)
    assert policy["PolicyName"] == "demo-AllTraffic-invocations"
    assert policy["PolicyType"] == "TargetTrackingScaling"
    conf = policy["TargetTrackingScalingPolicyConfiguration"]
    assert conf["TargetValue"] == 30.0
    assert conf["PredefinedMetricSpecification"] == {"PredefinedMetricType": METRIC}
    assert METRIC == "SageMakerVariantInvocationsPerInstance"
    assert (conf["ScaleInCooldown"], conf["ScaleOutCooldown"]) == (300, 60)


def test_rerun_is_unchanged_and_changes_are_updates(aas: Any) -> None:
    spec = ScalingSpec(max_capacity=4)
    autoscaling.ensure_scaling(aas, "demo", "AllTraffic", spec)
    again = autoscaling.ensure_scaling(aas, "demo", "AllTraffic", spec)
    assert {r.status for r in again} == {Status.UNCHANGED}

    wider = replace(spec, max_capacity=8)
    results = autoscaling.ensure_scaling(aas, "demo", "AllTraffic", wider)
    assert [r.status for r in results] == [Status.UPDATED, Status.UNCHANGED]
    assert targets(aas)[0]["MaxCapacity"] == 8

    hotter = replace(wider, target_invocations=120, scale_in_cooldown_s=900)
    results = autoscaling.ensure_scaling(aas, "demo", "AllTraffic", hotter)
    assert [r.status for r in results] == [Status.UNCHANGED, Status.UPDATED]
    assert len(policies(aas)) == 1
    conf = policies(aas)[0]["TargetTrackingScalingPolicyConfiguration"]
    assert (conf["TargetValue"], conf["ScaleInCooldown"]) == (120.0, 900)


def test_current_scaling_reads_back_what_was_set(aas: Any) -> None:
    assert autoscaling.current_scaling(aas, "demo", "AllTraffic") is None
    spec = ScalingSpec(
        max_capacity=5,
        min_capacity=2,
        target_invocations=12.5,
        scale_in_cooldown_s=600,
        scale_out_cooldown_s=30,
    )
    autoscaling.ensure_scaling(aas, "demo", "AllTraffic", spec)
    assert autoscaling.current_scaling(aas, "demo", "AllTraffic") == spec


def test_remove_deletes_policy_then_target_of_every_variant(aas: Any) -> None:
    for variant in ("AllTraffic", "Canary"):
        autoscaling.ensure_scaling(aas, "demo", variant, ScalingSpec(max_capacity=2))
    autoscaling.ensure_scaling(aas, "demo-two", "AllTraffic", ScalingSpec(max_capacity=2))

    results = autoscaling.remove_scaling(aas, "demo")

    assert [(r.kind, r.name, r.status) for r in results] == [
        ("scaling-policy", "demo-AllTraffic-invocations", Status.DELETED),
        ("scalable-target", RID, Status.DELETED),
        ("scaling-policy", "demo-Canary-invocations", Status.DELETED),
        ("scalable-target", "endpoint/demo/variant/Canary", Status.DELETED),
    ]
    assert [t["ResourceId"] for t in targets(aas)] == ["endpoint/demo-two/variant/AllTraffic"]
    assert autoscaling.remove_scaling(aas, "demo") == []
    absent = autoscaling.remove_scaling(aas, "demo", "AllTraffic")
    assert [(r.kind, r.status) for r in absent] == [("scalable-target", Status.ABSENT)]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (ScalingSpec(max_capacity=2, min_capacity=0), "at least 1"),
        (ScalingSpec(max_capacity=1, min_capacity=2), "below min capacity"),
        (ScalingSpec(max_capacity=2, target_invocations=0), "positive"),
        (ScalingSpec(max_capacity=2, scale_in_cooldown_s=-1), "negative"),
    ],
)
def test_invalid_scaling_is_rejected_before_any_call(
    aas: Any, spec: ScalingSpec, message: str
) -> None:
    with pytest.raises(DeployError, match=message):
        autoscaling.ensure_scaling(aas, "demo", "AllTraffic", spec)
    assert targets(aas) == []
