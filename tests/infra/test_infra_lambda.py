"""Lambda function from the container image, and its Function URL (moto, no Docker)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from infra import lambda_fn
from infra.errors import DeployError
from infra.lambda_fn import LWA_ENVIRONMENT, PUBLIC_URL_STATEMENTS, LambdaSpec
from infra.naming import DEPLOYMENT_TAG
from infra.results import Status


@pytest.fixture
def lam(session: Any) -> Any:
    return session.client("lambda")


@pytest.fixture
def spec(role_arn: str, image: str) -> LambdaSpec:
    return LambdaSpec(
        name="hearth-fn",
        image_uri=image,
        role_arn=role_arn,
        memory_mb=10240,
        timeout_s=900,
        environment={"HEARTH_MAX_MODEL_LEN": "2048"},
    )


def statement_ids(lam: Any, name: str) -> set[str]:
    try:
        policy = json.loads(lam.get_policy(FunctionName=name)["Policy"])
    except lam.exceptions.ResourceNotFoundException:
        return set()
    return {s["Sid"] for s in policy["Statement"]}


def test_create_buffered_function(lam: Any, spec: LambdaSpec) -> None:
    result = lambda_fn.ensure_function(lam, spec)
    assert (result.status, result.detail) == (Status.CREATED, "buffered mode")

    got = lam.get_function(FunctionName="hearth-fn")
    conf = got["Configuration"]
    assert conf["PackageType"] == "Image"
    assert got["Code"]["ImageUri"] == spec.image_uri
    assert conf["Role"] == spec.role_arn
    assert (conf["MemorySize"], conf["Timeout"]) == (10240, 900)
    assert conf["Environment"]["Variables"] == {"HOME": "/tmp", "HEARTH_MAX_MODEL_LEN": "2048"}
    assert conf["ImageConfigResponse"]["ImageConfig"] == {
        "EntryPoint": ["python", "-m", "awslambdaric"],
        "Command": ["container.lambda_handler.handler"],
    }
    assert conf["Architectures"] == ["x86_64"]
    assert got["Tags"] == {DEPLOYMENT_TAG: "hearth-fn"}


def test_rerun_unchanged_then_image_and_config_updates(lam: Any, spec: LambdaSpec) -> None:
    lambda_fn.ensure_function(lam, spec)
    calls: list[str] = []
    for op in ("CreateFunction", "UpdateFunctionCode", "UpdateFunctionConfiguration"):
        lam.meta.events.register(f"before-call.lambda.{op}", lambda op=op, **_: calls.append(op))

    assert lambda_fn.ensure_function(lam, spec).status is Status.UNCHANGED
    assert calls == []

    newer = replace(spec, image_uri=spec.image_uri.replace("0.1.0", "0.2.0"))
    result = lambda_fn.ensure_function(lam, newer)
    assert (result.status, result.detail) == (Status.UPDATED, "image")
    assert lam.get_function(FunctionName="hearth-fn")["Code"]["ImageUri"].endswith(":0.2.0")

    smaller = replace(newer, memory_mb=4096, environment={"HEARTH_MAX_MODEL_LEN": "1024"})
    result = lambda_fn.ensure_function(lam, smaller)
    assert (result.status, result.detail) == (Status.UPDATED, "MemorySize, Environment")
    conf = lam.get_function_configuration(FunctionName="hearth-fn")
    assert conf["MemorySize"] == 4096
    assert conf["Environment"]["Variables"]["HEARTH_MAX_MODEL_LEN"] == "1024"
    assert calls == ["UpdateFunctionCode", "UpdateFunctionConfiguration"]


def test_stream_mode_runs_hearth_serve_behind_the_web_adapter(lam: Any, spec: LambdaSpec) -> None:
    stream = replace(spec, mode="stream", serve_args=("--max-num-seqs", "4"))
    lambda_fn.ensure_function(lam, stream)
    conf = lam.get_function_configuration(FunctionName="hearth-fn")
    assert conf["ImageConfigResponse"]["ImageConfig"]["Command"] == [
        "hearth",
        "serve",
        "--port",
        "8080",
        "--max-num-seqs",
        "4",
    ]
    assert not conf["ImageConfigResponse"]["ImageConfig"].get("EntryPoint")
    env = conf["Environment"]["Variables"]
    assert {k: env[k] for k in LWA_ENVIRONMENT} == {
        "AWS_LWA_INVOKE_MODE": "response_stream",
        "AWS_LWA_PORT": "8080",
        "AWS_LWA_READINESS_CHECK_PATH": "/ping",
        "AWS_LWA_READINESS_CHECK_HEALTHY_STATUS": "200",
    }
    assert stream.invoke_mode == "RESPONSE_STREAM" and spec.invoke_mode == "BUFFERED"


def test_function_url_iam_then_public_then_iam_again(lam: Any, spec: LambdaSpec) -> None:
    lambda_fn.ensure_function(lam, spec)
    (created,) = lambda_fn.ensure_function_url(lam, spec)
    assert created.status is Status.CREATED and created.name.startswith("https://")
    url = lam.get_function_url_config(FunctionName="hearth-fn")
    assert (url["AuthType"], url["InvokeMode"]) == ("AWS_IAM", "BUFFERED")
    assert statement_ids(lam, "hearth-fn") == set()
    assert [r.status for r in lambda_fn.ensure_function_url(lam, spec)] == [Status.UNCHANGED]

    public = replace(spec, url_auth="NONE")
    results = lambda_fn.ensure_function_url(lam, public)
    assert [(r.kind, r.status) for r in results] == [
        ("function-url", Status.UPDATED),
        ("permission", Status.CREATED),
        ("permission", Status.CREATED),
    ]
    assert lam.get_function_url_config(FunctionName="hearth-fn")["AuthType"] == "NONE"
    policy = json.loads(lam.get_policy(FunctionName="hearth-fn")["Policy"])
    by_sid = {s["Sid"]: s for s in policy["Statement"]}
    assert set(by_sid) == set(PUBLIC_URL_STATEMENTS)
    assert by_sid["hearth-public-url"]["Action"] == "lambda:InvokeFunctionUrl"
    assert by_sid["hearth-public-url-invoke"]["Action"] == "lambda:InvokeFunction"
    assert [r.status for r in lambda_fn.ensure_function_url(lam, public)] == [Status.UNCHANGED]

    results = lambda_fn.ensure_function_url(lam, spec)
    assert [r.status for r in results] == [Status.UPDATED, Status.DELETED, Status.DELETED]
    assert statement_ids(lam, "hearth-fn") == set()


def test_stream_mode_url_is_created_with_response_stream(lam: Any, spec: LambdaSpec) -> None:
    stream = replace(spec, mode="stream")
    lambda_fn.ensure_function(lam, stream)
    lambda_fn.ensure_function_url(lam, stream)
    assert lam.get_function_url_config(FunctionName="hearth-fn")["InvokeMode"] == "RESPONSE_STREAM"
    assert lambda_fn.ensure_function_url(lam, replace(stream, url_auth=None)) == []


def test_delete_function_and_url(lam: Any, spec: LambdaSpec) -> None:
    lambda_fn.ensure_function(lam, spec)
    lambda_fn.ensure_function_url(lam, spec)
    results = lambda_fn.delete_function(lam, "hearth-fn")
    assert [(r.kind, r.status) for r in results] == [
        ("function-url", Status.DELETED),
        ("lambda-function", Status.DELETED),
    ]
    assert lam.list_functions()["Functions"] == []
    assert [r.status for r in lambda_fn.delete_function(lam, "hearth-fn")] == [Status.ABSENT]


def test_delete_refuses_a_function_it_did_not_create(lam: Any, spec: LambdaSpec) -> None:
    lam.create_function(
        FunctionName="byhand",
        Role=spec.role_arn,
        PackageType="Image",
        Code={"ImageUri": spec.image_uri},
    )
    with pytest.raises(DeployError, match="not created by `hearth deploy lambda`"):
        lambda_fn.delete_function(lam, "byhand")
    assert lam.get_function(FunctionName="byhand")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"memory_mb": 20000}, "128-10240"),
        ({"timeout_s": 901}, "1-900"),
        ({"mode": "websocket"}, "mode must be"),
        ({"ephemeral_storage_mb": 100}, "512-10240"),
        ({"url_auth": "COGNITO"}, "AWS_IAM or NONE"),
        ({"role_arn": "role"}, "IAM role ARN"),
        ({"serve_args": ("--api-key=S",)}, "stream only"),
    ],
)
def test_invalid_specs(lam: Any, spec: LambdaSpec, change: dict[str, Any], message: str) -> None:
    with pytest.raises(DeployError, match=message):
        lambda_fn.ensure_function(lam, replace(spec, **change))
    assert lam.list_functions()["Functions"] == []


def test_deploy_refuses_a_function_it_did_not_create_unless_adopted(
    lam: Any, spec: LambdaSpec
) -> None:
    """Issue 8 item 9: a name clash must not take over someone else's function."""
    lam.create_function(
        FunctionName=spec.name,
        Role=spec.role_arn,
        PackageType="Image",
        Code={"ImageUri": "someone/else:1"},
    )
    with pytest.raises(DeployError, match="pass --adopt"):
        lambda_fn.ensure_function(lam, spec, wait_delay_s=0)
    assert lam.get_function(FunctionName=spec.name)["Code"]["ImageUri"] == "someone/else:1"
    lambda_fn.ensure_function(lam, spec, wait_delay_s=0, adopt=True)
    current = lam.get_function(FunctionName=spec.name)
    assert current["Code"]["ImageUri"] == spec.image_uri
    assert current["Tags"][DEPLOYMENT_TAG] == spec.name


def test_a_buffered_deploy_with_a_key_in_serve_args_is_refused_not_made_public(
    lam: Any, spec: LambdaSpec
) -> None:
    """Issue 17 item 4: buffered mode drops serve_args, yet has_api_key counted them:
    `--url-auth NONE --serve-arg=--api-key=S` made a public URL with no key, no warning."""
    public = replace(spec, url_auth="NONE", serve_args=("--api-key=S",))
    assert not public.has_api_key
    warnings: list[str] = []
    with pytest.raises(DeployError, match="stream only"):
        lambda_fn.deploy(lam_clients(lam), public, adopt=False, report=print, warn=warnings.append)
    assert lam.list_functions()["Functions"] == []
    # The same key through the environment is what buffered mode reads.
    keyed = replace(spec, url_auth="NONE", environment={"HEARTH_API_KEY": "S"})
    assert keyed.has_api_key
    assert not replace(spec, environment={"HEARTH_API_KEY": ""}).has_api_key
    assert replace(spec, mode="stream", serve_args=("--api-key", "S")).has_api_key


def lam_clients(lam: Any) -> Any:
    return lambda service: lam
