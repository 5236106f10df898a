"""SageMaker model / endpoint config / endpoint lifecycle on moto."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import boto3
import pytest

from infra import sagemaker, sagemaker_cleanup, sagemaker_status
from infra.artifacts import ModelData
from infra.errors import DeployError
from infra.naming import DEPLOYMENT_TAG, MAX_DEPLOYMENT_NAME, validate_deployment_name
from infra.results import Status
from infra.sagemaker_spec import EndpointSpec, MetricsSpec, ModelSpec, VariantSpec
from infra.sagemaker_status import Waiting


@pytest.fixture
def sm(session: boto3.Session) -> Any:
    return session.client("sagemaker")


@pytest.fixture
def progress() -> list[str]:
    return []


@pytest.fixture
def waiting(progress: list[str]) -> Waiting:
    return Waiting(timeout_s=60, poll_s=0, progress=progress.append)


@pytest.fixture
def spec(role_arn: str, image: str) -> EndpointSpec:
    return EndpointSpec(
        name="demo",
        model=ModelSpec(
            image=image,
            role_arn=role_arn,
            environment={"HEARTH_MAX_MODEL_LEN": "4096", "SM_HEARTH_ENABLE_PREFIX_CACHING": "true"},
            model_data=ModelData.from_uri("s3://hearth-models/weights/smol"),
        ),
        variant=VariantSpec(
            instance_type="ml.g4dn.xlarge",
            instance_count=1,
            startup_timeout_s=1200,
            download_timeout_s=900,
            volume_size_gb=64,
            inference_ami_version="al2-ami-sagemaker-inference-gpu-3-1",
            routing_strategy="LEAST_OUTSTANDING_REQUESTS",
        ),
    )


class CallLog:
    """Records the parameters of chosen API calls made by a client."""

    def __init__(self, client: Any, *operations: str) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        for op in operations:
            client.meta.events.register(f"provide-client-params.sagemaker.{op}", self._record(op))

    def _record(self, op: str) -> Any:
        def record(params: dict[str, Any], **_kwargs: Any) -> None:
            self.calls.append((op, dict(params)))

        return record

    def of(self, op: str) -> list[dict[str, Any]]:
        return [params for name, params in self.calls if name == op]


def tags_of(sm: Any, arn: str) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in sm.list_tags(ResourceArn=arn)["Tags"]}


def test_deploy_creates_model_config_and_endpoint(
    sm: Any, spec: EndpointSpec, waiting: Waiting, progress: list[str]
) -> None:
    reported: list[str] = []
    results = sagemaker.deploy_endpoint(
        sm, spec, waiting, report=lambda r: reported.append(r.line())
    )

    assert [(r.kind, r.status) for r in results] == [
        ("model", Status.CREATED),
        ("endpoint-config", Status.CREATED),
        ("endpoint", Status.CREATED),
    ]
    assert reported == [r.line() for r in results]
    assert spec.model_name.startswith("demo-m-") and spec.config_name.startswith("demo-c-")

    model = sm.describe_model(ModelName=spec.model_name)
    assert model["ExecutionRoleArn"] == spec.model.role_arn
    container = model["PrimaryContainer"]
    assert container["Image"] == spec.model.image
    assert container["Environment"] == dict(spec.model.environment)
    assert container["ModelDataSource"]["S3DataSource"] == {
        "S3Uri": "s3://hearth-models/weights/smol/",
        "S3DataType": "S3Prefix",
        "CompressionType": "None",
    }
    assert "ContainerMetricsConfig" not in container

    config = sm.describe_endpoint_config(EndpointConfigName=spec.config_name)
    (variant,) = config["ProductionVariants"]
    assert variant["ModelName"] == spec.model_name
    assert variant["InstanceType"] == "ml.g4dn.xlarge"
    assert variant["InitialInstanceCount"] == 1
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 1200
    assert variant["ModelDataDownloadTimeoutInSeconds"] == 900
    assert variant["VolumeSizeInGB"] == 64
    assert variant["InferenceAmiVersion"] == "al2-ami-sagemaker-inference-gpu-3-1"
    assert variant["RoutingConfig"] == {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}

    endpoint = sm.describe_endpoint(EndpointName="demo")
    assert endpoint["EndpointStatus"] == "InService"
    assert endpoint["EndpointConfigName"] == spec.config_name
    for arn in (model["ModelArn"], config["EndpointConfigArn"], endpoint["EndpointArn"]):
        assert tags_of(sm, arn) == {DEPLOYMENT_TAG: "demo"}
    assert progress == ["endpoint demo: InService (0s)"]


def test_rerun_changes_nothing(sm: Any, spec: EndpointSpec, waiting: Waiting) -> None:
    sagemaker.deploy_endpoint(sm, spec, waiting)
    log = CallLog(sm, "CreateModel", "CreateEndpointConfig", "CreateEndpoint", "UpdateEndpoint")
    results = sagemaker.deploy_endpoint(sm, spec, waiting)
    assert {r.status for r in results} == {Status.UNCHANGED}
    assert log.calls == []


def test_names_ignore_environment_order_but_follow_content(spec: EndpointSpec) -> None:
    shuffled = replace(
        spec, model=replace(spec.model, environment=dict(reversed(spec.model.environment.items())))
    )
    assert (shuffled.model_name, shuffled.config_name) == (spec.model_name, spec.config_name)
    more = replace(spec, variant=replace(spec.variant, instance_count=2))
    assert more.model_name == spec.model_name
    assert more.config_name != spec.config_name
    other_image = replace(spec, model=replace(spec.model, image=spec.model.image + "-b"))
    assert other_image.model_name != spec.model_name
    assert other_image.config_name != spec.config_name  # the config names the model


def test_variant_change_rolls_endpoint_and_prunes_old_config(
    sm: Any, spec: EndpointSpec, waiting: Waiting, progress: list[str], shims: Any
) -> None:
    sagemaker.deploy_endpoint(sm, spec, waiting)
    bigger = replace(
        spec, variant=replace(spec.variant, instance_type="ml.p3.2xlarge", instance_count=2)
    )
    progress.clear()

    results = sagemaker.deploy_endpoint(sm, bigger, waiting)

    assert [(r.kind, r.name, r.status) for r in results] == [
        ("model", spec.model_name, Status.UNCHANGED),
        ("endpoint-config", bigger.config_name, Status.CREATED),
        ("endpoint", "demo", Status.UPDATED),
        ("endpoint-config", spec.config_name, Status.DELETED),
    ]
    assert shims.update.calls == [
        {"EndpointName": "demo", "EndpointConfigName": bigger.config_name}
    ]
    assert progress == ["endpoint demo: Updating (0s)", "endpoint demo: InService (0s)"]
    endpoint = sm.describe_endpoint(EndpointName="demo")
    assert endpoint["EndpointConfigName"] == bigger.config_name
    assert endpoint["ProductionVariants"][0]["DesiredInstanceCount"] == 2
    names = [c["EndpointConfigName"] for c in sm.list_endpoint_configs()["EndpointConfigs"]]
    assert names == [bigger.config_name]


def test_image_change_replaces_model_too(sm: Any, spec: EndpointSpec, waiting: Waiting) -> None:
    sagemaker.deploy_endpoint(sm, spec, waiting)
    newer = replace(
        spec, model=replace(spec.model, image=spec.model.image.replace("0.1.0", "0.2.0"))
    )
    results = sagemaker.deploy_endpoint(sm, newer, waiting)
    deleted = {(r.kind, r.name) for r in results if r.status is Status.DELETED}
    assert deleted == {("model", spec.model_name), ("endpoint-config", spec.config_name)}
    models = [m["ModelName"] for m in sm.list_models()["Models"]]
    assert models == [newer.model_name]
    image = sm.describe_model(ModelName=newer.model_name)["PrimaryContainer"]["Image"]
    assert image.endswith(":0.2.0")


def test_keep_old_and_no_wait_do_not_prune(sm: Any, spec: EndpointSpec, waiting: Waiting) -> None:
    sagemaker.deploy_endpoint(sm, spec, waiting)
    bigger = replace(spec, variant=replace(spec.variant, instance_count=3))
    results = sagemaker.deploy_endpoint(sm, bigger, waiting, prune=False)
    assert Status.DELETED not in {r.status for r in results}
    assert len(sm.list_endpoint_configs()["EndpointConfigs"]) == 2
    evenbigger = replace(spec, variant=replace(spec.variant, instance_count=4))
    results = sagemaker.deploy_endpoint(sm, evenbigger, waiting, wait=False)
    assert [r.status for r in results][-1] is Status.UPDATED
    assert sm.describe_endpoint(EndpointName="demo")["EndpointStatus"] == "Updating"


def test_rolled_back_update_is_an_error_and_keeps_the_old_config(
    sm: Any, spec: EndpointSpec, waiting: Waiting, shims: Any
) -> None:
    sagemaker.deploy_endpoint(sm, spec, waiting)
    shims.update.fail_with = "The primary container did not pass the ping health check."
    bigger = replace(spec, variant=replace(spec.variant, instance_count=2))
    with pytest.raises(DeployError, match=r"rolled back to demo-c-.*ping health check"):
        sagemaker.deploy_endpoint(sm, bigger, waiting)
    assert sm.describe_endpoint(EndpointName="demo")["EndpointConfigName"] == spec.config_name
    assert sm.describe_endpoint_config(EndpointConfigName=spec.config_name)


def test_failed_endpoint_is_reported_with_its_reason(
    sm: Any, spec: EndpointSpec, waiting: Waiting, sm_backend: Any
) -> None:
    sagemaker.deploy_endpoint(sm, spec, waiting)
    endpoint = sm_backend.endpoints["demo"]
    endpoint.endpoint_status = "Failed"
    endpoint.failure_reason = "CUDA driver version is insufficient"
    with pytest.raises(DeployError, match="is Failed: CUDA driver version is insufficient"):
        sagemaker_status.wait_for_endpoint(sm, "demo", waiting)
    bigger = replace(spec, variant=replace(spec.variant, instance_count=2))
    with pytest.raises(DeployError, match="hearth deploy delete --name demo"):
        sagemaker.deploy_endpoint(sm, bigger, waiting)


def test_wait_times_out_with_a_clear_message(
    sm: Any, spec: EndpointSpec, sm_backend: Any, progress: list[str]
) -> None:
    sagemaker.deploy_endpoint(sm, spec, Waiting(poll_s=0))
    sm_backend.endpoints["demo"].endpoint_status = "Creating"
    now = [0.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    waiting = Waiting(
        timeout_s=100, poll_s=30, progress=progress.append, sleep=sleep, clock=lambda: now[0]
    )
    with pytest.raises(DeployError, match=r"still Creating after 2m00s"):
        sagemaker_status.wait_for_endpoint(sm, "demo", waiting)
    assert sleeps == [30, 30, 30, 30]
    assert progress == ["endpoint demo: Creating (0s)"]  # one line per status change


def test_read_spec_round_trips(sm: Any, spec: EndpointSpec, waiting: Waiting) -> None:
    with_metrics = replace(spec, metrics=MetricsSpec(frequency_s=30))
    sagemaker.deploy_endpoint(sm, with_metrics, waiting)
    assert sagemaker.read_spec(sm, "demo") == with_metrics
    with pytest.raises(DeployError, match="not found"):
        sagemaker.read_spec(sm, "nope")


def test_metrics_config_only_when_asked(sm: Any, spec: EndpointSpec, waiting: Waiting) -> None:
    log = CallLog(sm, "CreateModel", "CreateEndpointConfig")
    sagemaker.deploy_endpoint(sm, spec, waiting)
    assert "ContainerMetricsConfig" not in log.of("CreateModel")[0]["PrimaryContainer"]
    assert "MetricsConfig" not in log.of("CreateEndpointConfig")[0]

    sagemaker.deploy_endpoint(sm, replace(spec, metrics=MetricsSpec(frequency_s=10)), waiting)
    assert log.of("CreateModel")[1]["PrimaryContainer"]["ContainerMetricsConfig"] == {
        "MetricsEndpoints": [
            {"MetricsEndpointPath": "/metrics", "MetricPublishFrequencyInSeconds": 10}
        ]
    }
    assert log.of("CreateEndpointConfig")[1]["MetricsConfig"] == {
        "EnableDetailedObservability": True,
        "MetricPublishFrequencyInSeconds": 10,
    }


def test_delete_removes_only_what_the_deployment_owns(
    sm: Any, spec: EndpointSpec, waiting: Waiting, progress: list[str]
) -> None:
    sagemaker.deploy_endpoint(sm, spec, waiting)
    sagemaker.deploy_endpoint(
        sm, replace(spec, variant=replace(spec.variant, instance_count=2)), waiting, prune=False
    )
    # Look-alikes that must survive: untagged but derived-looking, and another deployment.
    sm.create_model(
        ModelName="demo-m-0123456789",
        ExecutionRoleArn=spec.model.role_arn,
        PrimaryContainer={"Image": "x"},
    )
    other = replace(spec, name="demo-two")
    sagemaker.deploy_endpoint(sm, other, waiting)

    results = sagemaker_cleanup.delete_deployment(sm, "demo", waiting)

    assert [(r.kind, r.status) for r in results] == [
        ("endpoint", Status.DELETED),
        ("endpoint-config", Status.DELETED),
        ("endpoint-config", Status.DELETED),
        ("model", Status.DELETED),
    ]
    assert "endpoint demo: gone (0s)" in progress
    left = sorted(m["ModelName"] for m in sm.list_models()["Models"])
    assert left == sorted(["demo-m-0123456789", other.model_name])
    assert [c["EndpointConfigName"] for c in sm.list_endpoint_configs()["EndpointConfigs"]] == [
        other.config_name
    ]
    assert sm.describe_endpoint(EndpointName="demo-two")["EndpointStatus"] == "InService"

    again = sagemaker_cleanup.delete_deployment(sm, "demo", waiting)
    assert [(r.kind, r.status) for r in again] == [("endpoint", Status.ABSENT)]


def test_delete_refuses_an_endpoint_it_did_not_create(
    sm: Any, spec: EndpointSpec, waiting: Waiting
) -> None:
    sm.create_model(
        ModelName="byhand", ExecutionRoleArn=spec.model.role_arn, PrimaryContainer={"Image": "x"}
    )
    sm.create_endpoint_config(
        EndpointConfigName="byhand",
        ProductionVariants=[
            {
                "VariantName": "v",
                "ModelName": "byhand",
                "InstanceType": "ml.g4dn.xlarge",
                "InitialInstanceCount": 1,
            }
        ],
    )
    sm.create_endpoint(EndpointName="byhand", EndpointConfigName="byhand")
    with pytest.raises(DeployError, match="was not created by `hearth deploy`"):
        sagemaker_cleanup.delete_deployment(sm, "byhand", waiting)
    assert sm.describe_endpoint(EndpointName="byhand")["EndpointStatus"] == "InService"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"variant": VariantSpec("ml.g4dn.xlarge", startup_timeout_s=30)}, "60-3600"),
        ({"variant": VariantSpec("ml.g4dn.xlarge", download_timeout_s=4000)}, "60-3600"),
        ({"variant": VariantSpec("ml.g4dn.xlarge", volume_size_gb=1000)}, "1-512"),
        ({"variant": VariantSpec("ml.g4dn.xlarge", instance_count=0)}, "at least 1"),
        ({"variant": VariantSpec("ml.g4dn.xlarge", routing_strategy="FASTEST")}, "routing"),
        ({"metrics": MetricsSpec(frequency_s=45)}, "10, 30, 60"),
        ({"metrics": MetricsSpec(path="metrics")}, "start with /"),
    ],
)
def test_invalid_specs_fail_before_any_call(
    sm: Any, spec: EndpointSpec, waiting: Waiting, change: dict[str, Any], message: str
) -> None:
    log = CallLog(sm, "CreateModel", "DescribeModel")
    with pytest.raises(DeployError, match=message):
        sagemaker.deploy_endpoint(sm, replace(spec, **change), waiting)
    assert log.calls == []


def test_environment_limits(spec: EndpointSpec) -> None:
    too_many = {f"K{i}": "v" for i in range(101)}
    with pytest.raises(DeployError, match="at most 100"):
        replace(spec.model, environment=too_many).validate()
    with pytest.raises(DeployError, match="over 1024 bytes"):
        replace(spec.model, environment={"K": "é" * 600}).validate()
    with pytest.raises(DeployError, match="IAM role ARN"):
        replace(spec.model, role_arn="hearth-role").validate()


@pytest.mark.parametrize(
    "name", ["", "-x", "x-", "has_underscore", "a" * (MAX_DEPLOYMENT_NAME + 1)]
)
def test_bad_deployment_names(name: str) -> None:
    with pytest.raises(DeployError, match="invalid deployment name"):
        validate_deployment_name(name)


def test_longest_name_still_fits_sagemaker(spec: EndpointSpec) -> None:
    name = validate_deployment_name("a" * MAX_DEPLOYMENT_NAME)
    long = replace(spec, name=name)
    assert len(long.model_name) == len(long.config_name) == 63


def test_claim_refuses_an_endpoint_it_did_not_create_unless_adopted(
    sm: Any, spec: EndpointSpec
) -> None:
    """Issue 8 item 9: `deploy sagemaker|update` must not take over a foreign endpoint."""
    sm.create_model(
        ModelName="byhand", ExecutionRoleArn=spec.model.role_arn, PrimaryContainer={"Image": "x"}
    )
    sm.create_endpoint_config(
        EndpointConfigName="byhand",
        ProductionVariants=[
            {
                "VariantName": "v",
                "ModelName": "byhand",
                "InstanceType": "ml.g4dn.xlarge",
                "InitialInstanceCount": 1,
            }
        ],
    )
    sm.create_endpoint(EndpointName="byhand", EndpointConfigName="byhand")
    assert sagemaker_cleanup.claim_endpoint(sm, "nothing-here", adopt=False) is None
    with pytest.raises(DeployError, match="pass --adopt"):
        sagemaker_cleanup.claim_endpoint(sm, "byhand", adopt=False)
    adopted = sagemaker_cleanup.claim_endpoint(sm, "byhand", adopt=True)
    assert adopted is not None and adopted.status is Status.UPDATED
    assert sagemaker_cleanup.claim_endpoint(sm, "byhand", adopt=False) is None  # ours now
