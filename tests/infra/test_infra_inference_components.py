"""`hearth deploy sagemaker --adapter NAME=s3://...`: adapter inference components on a
base component. moto 5 does not implement inference components, so the component calls
run against botocore's Stubber (every request checked against the API model and against
the shape we expect); the endpoint config for inference components is checked as the
request it makes, and the argument checks through the CLI on moto."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from infra.errors import DeployError
from infra.inference_components import (
    AdapterSpec,
    ComponentsSpec,
    delete_components,
    ensure_components,
    parse_adapters,
)
from infra.naming import DEPLOYMENT_TAG
from infra.sagemaker_spec import EndpointSpec, ModelSpec, VariantSpec
from infra.sagemaker_status import Waiting
from tests.infra.test_infra_cli import deploy_args

ROLE = "arn:aws:iam::123456789012:role/sm"
ARN = "arn:aws:sagemaker:us-east-1:123456789012:inference-component/"
TAGS = [{"Key": DEPLOYMENT_TAG, "Value": "demo"}]
NOW = datetime(2026, 12, 2, tzinfo=UTC)
WAIT = Waiting(timeout_s=10, poll_s=0, sleep=lambda _s: None)
SPEC = ComponentsSpec(
    deployment="demo",
    variant_name="AllTraffic",
    model_name="demo-m-0123456789",
    adapters=(AdapterSpec("sql", "s3://b/sql.tar.gz"), AdapterSpec("chat", "s3://b/chat/")),
    startup_timeout_s=900,
)


@pytest.fixture
def stubbed() -> Any:
    sm = boto3.client("sagemaker", region_name="us-east-1", aws_access_key_id="x",
                      aws_secret_access_key="x")  # fmt: skip
    with Stubber(sm) as stub:
        yield sm, stub
        stub.assert_no_pending_responses()


def _missing(stub: Stubber, name: str) -> None:
    stub.add_client_error(
        "describe_inference_component",
        service_error_code="ValidationException",
        service_message=f"Could not find inference component {name}",
        expected_params={"InferenceComponentName": name},
    )


def _described(stub: Stubber, name: str, spec: dict[str, Any], status: str = "InService") -> None:
    stub.add_response(
        "describe_inference_component",
        {
            "InferenceComponentName": name,
            "InferenceComponentArn": ARN + name,
            "EndpointName": "demo",
            "EndpointArn": "arn:aws:sagemaker:us-east-1:123456789012:endpoint/demo",
            "Specification": spec,
            "InferenceComponentStatus": status,
            "CreationTime": NOW,
            "LastModifiedTime": NOW,
        },
        {"InferenceComponentName": name},
    )


def _tags(stub: Stubber, name: str, tags: list[dict[str, str]] = TAGS) -> None:
    stub.add_response("list_tags", {"Tags": tags}, {"ResourceArn": ARN + name})


def _listed(stub: Stubber, *names: str) -> None:
    summaries = [
        {
            "InferenceComponentName": name,
            "InferenceComponentArn": ARN + name,
            "EndpointName": "demo",
            "EndpointArn": "arn:aws:sagemaker:us-east-1:123456789012:endpoint/demo",
            "VariantName": "AllTraffic",
            "CreationTime": NOW,
            "LastModifiedTime": NOW,
        }
        for name in names
    ]
    stub.add_response(
        "list_inference_components",
        {"InferenceComponents": summaries},
        {"EndpointNameEquals": "demo"},
    )


def _adapter_spec(url: str) -> dict[str, Any]:
    return {"BaseInferenceComponentName": "demo-base", "Container": {"ArtifactUrl": url}}


def test_first_deploy_creates_the_base_then_each_adapter(stubbed: Any) -> None:
    sm, stub = stubbed
    _missing(stub, "demo-base")
    stub.add_response(
        "create_inference_component",
        {"InferenceComponentArn": ARN + "demo-base"},
        {
            "InferenceComponentName": "demo-base",
            "EndpointName": "demo",
            "VariantName": "AllTraffic",
            "Specification": {
                "ModelName": "demo-m-0123456789",
                "ComputeResourceRequirements": {
                    "MinMemoryRequiredInMb": 1024,
                    "NumberOfAcceleratorDevicesRequired": 1,
                },
                "StartupParameters": {"ContainerStartupHealthCheckTimeoutInSeconds": 900},
            },
            "RuntimeConfig": {"CopyCount": 1},
            "Tags": TAGS,
        },
    )
    _described(stub, "demo-base", SPEC.base_specification(), "Creating")
    _described(stub, "demo-base", SPEC.base_specification())
    for name, url in (("sql", "s3://b/sql.tar.gz"), ("chat", "s3://b/chat/")):
        _missing(stub, f"demo-{name}")
        stub.add_response(
            "create_inference_component",
            {"InferenceComponentArn": ARN + f"demo-{name}"},
            {
                "InferenceComponentName": f"demo-{name}",
                "EndpointName": "demo",
                "Specification": _adapter_spec(url),
                "Tags": TAGS,
            },
        )
        _described(stub, f"demo-{name}", _adapter_spec(url))
    _listed(stub, "demo-base", "demo-sql", "demo-chat")
    for name in ("demo-base", "demo-sql", "demo-chat"):
        _tags(stub, name)
    results = ensure_components(sm, SPEC, WAIT)
    assert [(r.name, r.status.value) for r in results] == [
        ("demo-base", "created"),
        ("demo-sql", "created"),
        ("demo-chat", "created"),
    ]


def test_rerun_changes_only_the_difference_and_drops_unlisted_adapters(stubbed: Any) -> None:
    sm, stub = stubbed
    _described(stub, "demo-base", SPEC.base_specification())
    _tags(stub, "demo-base")
    _described(stub, "demo-sql", _adapter_spec("s3://b/sql.tar.gz"))
    _tags(stub, "demo-sql")
    _described(stub, "demo-chat", _adapter_spec("s3://b/old-chat/"))  # a new artifact
    _tags(stub, "demo-chat")
    stub.add_response(
        "update_inference_component",
        {"InferenceComponentArn": ARN + "demo-chat"},
        {"InferenceComponentName": "demo-chat", "Specification": _adapter_spec("s3://b/chat/")},
    )
    _described(stub, "demo-chat", _adapter_spec("s3://b/chat/"))
    _listed(stub, "demo-base", "demo-sql", "demo-chat", "demo-old", "someone-elses")
    for name in ("demo-base", "demo-sql", "demo-chat", "demo-old"):
        _tags(stub, name)
    _tags(stub, "someone-elses", [])
    stub.add_response("delete_inference_component", {}, {"InferenceComponentName": "demo-old"})
    _missing(stub, "demo-old")
    results = ensure_components(sm, SPEC, WAIT)
    assert [(r.name, r.status.value) for r in results] == [
        ("demo-base", "unchanged"),
        ("demo-sql", "unchanged"),
        ("demo-chat", "updated"),
        ("demo-old", "deleted"),
    ]


def test_a_component_without_our_tag_is_refused(stubbed: Any) -> None:
    sm, stub = stubbed
    _described(stub, "demo-base", SPEC.base_specification())
    _tags(stub, "demo-base", [{"Key": "owner", "Value": "someone"}])
    with pytest.raises(DeployError, match="not created by hearth"):
        ensure_components(sm, SPEC, WAIT)


def test_delete_removes_adapters_before_the_base(stubbed: Any) -> None:
    sm, stub = stubbed
    _listed(stub, "demo-base", "demo-sql")
    _tags(stub, "demo-base")
    _tags(stub, "demo-sql")
    for name in ("demo-sql", "demo-base"):
        stub.add_response("delete_inference_component", {}, {"InferenceComponentName": name})
        _described(stub, name, {}, "Deleting")
        _missing(stub, name)
    results = delete_components(sm, "demo", WAIT)
    assert [r.name for r in results] == ["demo-sql", "demo-base"]


def test_the_endpoint_config_is_one_for_inference_components() -> None:
    spec = EndpointSpec(
        "demo",
        ModelSpec(image="img", role_arn=ROLE),
        VariantSpec(instance_type="ml.g5.xlarge"),
        adapters=parse_adapters(["sql=s3://b/sql.tar.gz"]),
    )
    request = spec.config_request()
    assert request["ExecutionRoleArn"] == ROLE
    (variant,) = request["ProductionVariants"]
    assert "ModelName" not in variant
    assert "ContainerStartupHealthCheckTimeoutInSeconds" not in variant
    base = spec.components().base_request()
    assert base["Specification"]["ModelName"] == spec.model_name
    assert base["Specification"]["StartupParameters"] == {
        "ContainerStartupHealthCheckTimeoutInSeconds": 900,
        "ModelDataDownloadTimeoutInSeconds": 1200,
    }
    cpu = EndpointSpec("demo", spec.model, VariantSpec("ml.m5.xlarge"), adapters=spec.adapters)
    assert (
        "NumberOfAcceleratorDevicesRequired"
        not in (cpu.components().base_specification()["ComputeResourceRequirements"])
    )
    assert spec.components().adapter_request(spec.adapters[0]) == {
        "InferenceComponentName": "demo-sql",
        "EndpointName": "demo",
        "Specification": _adapter_spec("s3://b/sql.tar.gz"),
        "Tags": TAGS,
    }


def test_the_base_model_serves_adapter_components() -> None:
    """SageMaker loads each adapter component into the base's containers through their
    /adapters route: the base model's environment turns LoRA and that route on (the
    container had started without them, and every adapter load was a 404); a setting of
    the user's own wins, and a deployment without adapters gets neither."""
    adapters = parse_adapters(["sql=s3://b/sql.tar.gz"])
    model = ModelSpec(image="img", role_arn=ROLE, environment={"SM_HEARTH_MAX_LORA_RANK": "64"})
    spec = EndpointSpec("demo", model, VariantSpec("ml.g5.xlarge"), adapters=adapters)
    environment = spec.model_request()["PrimaryContainer"]["Environment"]
    assert environment == {
        "SM_HEARTH_ENABLE_LORA": "true",
        "SM_HEARTH_ENABLE_RUNTIME_LORA_UPDATING": "true",
        "SM_HEARTH_MAX_LORA_RANK": "64",
    }
    from container.sagemaker_serve import sagemaker_argv

    argv = sagemaker_argv(environment)
    assert "--enable-lora" in argv and "--enable-runtime-lora-updating" in argv
    plain = EndpointSpec("demo", model, VariantSpec("ml.g5.xlarge"))
    assert plain.model_request()["PrimaryContainer"]["Environment"] == model.environment
    own = ModelSpec(image="img", role_arn=ROLE, environment={"SM_HEARTH_ENABLE_LORA": "false"})
    mine = EndpointSpec("demo", own, VariantSpec("ml.g5.xlarge"), adapters=adapters)
    assert (
        mine.model_request()["PrimaryContainer"]["Environment"]["SM_HEARTH_ENABLE_LORA"] == "false"
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--adapter", "sql"), "NAME=s3://"),
        (("--adapter", "sql=/local/path"), "s3:// URL"),
        (("--adapter", "base=s3://b/x"), "not 'base'"),
        (("--adapter", "a=s3://b/x", "--adapter", "a=s3://b/y"), "twice"),
        (("--adapter", "a=s3://b/x", "--no-wait"), "drop --no-wait"),
        (("--adapter", "a=s3://b/x", "--async", "--output", "s3://o/"), "cannot be combined"),
    ],
)
def test_adapter_arguments_are_checked_before_aws(
    cli: Any, clients: Any, role_arn: str, image: str, extra: tuple[str, ...], message: str
) -> None:
    result = cli(*deploy_args(role_arn, image, *extra))
    assert result.code == 1 and message in result.err, result.err
    assert clients("sagemaker").list_endpoints()["Endpoints"] == []
