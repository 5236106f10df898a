"""`hearth deploy sagemaker --async --output s3://...` and `hearth batch` on moto (both
APIs, CreateEndpointConfig's AsyncInferenceConfig and CreateTransformJob, are modelled
by moto 5): the requests they make, idempotent reruns, tags, and refusing what hearth
did not create."""

from __future__ import annotations

from typing import Any

import pytest

from infra.naming import DEPLOYMENT_TAG
from tests.infra.test_infra_cli import deploy_args, statuses

OUT = "s3://hearth-out/async/"
ERRORS = "s3://hearth-out/errors/"


def test_async_deploy_creates_an_async_endpoint_and_tells_serve_its_mode(
    cli: Any, clients: Any, role_arn: str, image: str
) -> None:
    sm = clients("sagemaker")
    args = deploy_args(
        role_arn, image, "--async", "--output", OUT, "--failure-output", ERRORS,
        "--max-concurrent-invocations", "4",
    )  # fmt: skip
    first = cli(*args)
    assert first.code == 0, first.err
    endpoint = sm.describe_endpoint(EndpointName="demo")
    config = sm.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])
    assert config["AsyncInferenceConfig"] == {
        "OutputConfig": {"S3OutputPath": OUT, "S3FailurePath": ERRORS},
        "ClientConfig": {"MaxConcurrentInvocationsPerInstance": 4},
    }
    model = sm.describe_model(ModelName=config["ProductionVariants"][0]["ModelName"])
    assert model["PrimaryContainer"]["Environment"] == {"HEARTH_SAGEMAKER_MODE": "async"}
    tags = sm.list_tags(ResourceArn=config["EndpointConfigArn"])["Tags"]
    assert {"Key": DEPLOYMENT_TAG, "Value": "demo"} in tags

    again = cli(*args)
    assert again.code == 0 and {s for _, s in statuses(again)} == {"unchanged"}

    # `deploy update` keeps the endpoint async (the spec read back carries it).
    updated = cli(
        "deploy", "update", "--name", "demo", "--instance-count", "2", "--poll-interval", "0"
    )
    assert updated.code == 0, updated.err
    endpoint = sm.describe_endpoint(EndpointName="demo")
    config = sm.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])
    assert config["AsyncInferenceConfig"]["OutputConfig"]["S3OutputPath"] == OUT
    assert config["ProductionVariants"][0]["InitialInstanceCount"] == 2
    model = sm.describe_model(ModelName=config["ProductionVariants"][0]["ModelName"])
    assert model["PrimaryContainer"]["Environment"] == {"HEARTH_SAGEMAKER_MODE": "async"}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--async",), "--async needs --output"),
        (("--output", OUT), "need --async"),
        (("--async", "--output", "hearth-out/x"), "s3://bucket/prefix"),
        (("--async", "--output", OUT, "--max-concurrent-invocations", "0"), "1-1000"),
    ],
)
def test_async_arguments_are_checked_before_aws(
    cli: Any, clients: Any, role_arn: str, image: str, extra: tuple[str, ...], message: str
) -> None:
    result = cli(*deploy_args(role_arn, image, *extra))
    assert result.code == 1 and message in result.err
    assert clients("sagemaker").list_endpoints()["Endpoints"] == []


def batch_args(role: str, image: str, *extra: str) -> list[str]:
    return [
        "batch", "--name", "nightly", "--image", image, "--role", role,
        "--input", "s3://hearth-in/records/", "--output", "s3://hearth-out/answers/",
        "--instance-type", "ml.g4dn.xlarge", "--poll-interval", "0", *extra,
    ]  # fmt: skip


def test_batch_creates_a_multirecord_line_transform_job_once(
    cli: Any, clients: Any, role_arn: str, image: str
) -> None:
    sm = clients("sagemaker")
    first = cli(*batch_args(role_arn, image, "--max-concurrent-transforms", "2"))
    assert first.code == 0, first.err
    assert [kind for kind, _ in statuses(first)] == ["model", "transform-job"]
    assert {status for _, status in statuses(first)} == {"created"}
    name = first.lines[-1].split()[1].rstrip(":")
    assert name.startswith("nightly-t-")
    job = sm.describe_transform_job(TransformJobName=name)
    assert job["BatchStrategy"] == "MultiRecord"
    assert job["MaxConcurrentTransforms"] == 2
    assert job["TransformInput"]["SplitType"] == "Line"
    assert job["TransformInput"]["ContentType"] == "application/jsonlines"
    assert job["TransformOutput"]["AssembleWith"] == "Line"
    assert job["TransformOutput"]["S3OutputPath"] == "s3://hearth-out/answers/"
    assert job["ModelName"].startswith("nightly-m-")
    tags = sm.list_tags(ResourceArn=job["TransformJobArn"])["Tags"]
    assert {"Key": DEPLOYMENT_TAG, "Value": "nightly"} in tags

    again = cli(*batch_args(role_arn, image, "--max-concurrent-transforms", "2"))
    assert again.code == 0, again.err
    assert {status for _, status in statuses(again)} == {"unchanged"}
    assert len(sm.list_transform_jobs()["TransformJobSummaries"]) == 1

    other = cli(*batch_args(role_arn, image, "--max-payload-mb", "20"))
    assert other.code == 0  # different inputs: a second job, the same model
    assert [s for _, s in statuses(other)] == ["unchanged", "created"]


def test_batch_never_touches_a_job_it_did_not_create(
    cli: Any, clients: Any, role_arn: str, image: str
) -> None:
    from infra.batch import TransformSpec

    sm = clients("sagemaker")
    first = cli(*batch_args(role_arn, image, "--no-wait"))
    assert first.code == 0, first.err
    model_name = first.lines[0].split()[1].rstrip(":")
    job_name = first.lines[-1].split()[1].rstrip(":")
    job = sm.describe_transform_job(TransformJobName=job_name)
    sm.delete_tags(ResourceArn=job["TransformJobArn"], TagKeys=[DEPLOYMENT_TAG])
    spec = TransformSpec(
        "nightly", "s3://hearth-in/records/", "s3://hearth-out/answers/", "ml.g4dn.xlarge"
    )
    assert spec.job_name(model_name) == job_name
    refused = cli(*batch_args(role_arn, image, "--no-wait"))
    assert refused.code == 1 and "not created by hearth" in refused.err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--max-payload-mb", "101"), "0-100 MB"),
        (("--invocation-timeout", "0"), "1-3600"),
    ],
)
def test_batch_arguments_are_checked_before_aws(
    cli: Any, clients: Any, role_arn: str, image: str, extra: tuple[str, ...], message: str
) -> None:
    result = cli(*batch_args(role_arn, image, *extra))
    assert result.code == 1 and message in result.err
    assert clients("sagemaker").list_transform_jobs()["TransformJobSummaries"] == []
