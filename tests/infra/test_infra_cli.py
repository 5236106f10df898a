"""``hearth deploy`` / ``hearth invoke`` through argparse, on moto, end to end."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from infra import cli as cli_module
from infra.cli import add_commands, parse_env
from infra.errors import DeployError
from infra.session import make_session

CHAT = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."}}]}


def stream_body() -> bytes:
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"content": "The capital is "}}]},
        {"choices": [{"index": 0, "delta": {"content": "Paris — ça va."}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    events = "".join(f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks)
    return (events + "data: [DONE]\n\n").encode()


def statuses(result: Any) -> list[tuple[str, str]]:
    """``[(kind, status)]`` of the lines a command printed."""
    return [(line.split()[0], line.split(": ")[1].split()[0]) for line in result.lines]


def deploy_args(role: str, image: str, *extra: str) -> list[str]:
    return [
        "deploy",
        "sagemaker",
        "--name",
        "demo",
        "--image",
        image,
        "--role",
        role,
        "--instance-type",
        "ml.g4dn.xlarge",
        "--poll-interval",
        "0",
        *extra,
    ]


def test_end_to_end_deploy_update_autoscale_invoke_stream_delete(
    cli: Any,
    clients: Any,
    role_arn: str,
    image: str,
    tmp_path: Path,
    shims: Any,
    eventstream: Any,
    moto_api: Any,
) -> None:
    s3, sm, aas = clients("s3"), clients("sagemaker"), clients("application-autoscaling")
    s3.create_bucket(Bucket="hearth-artifacts")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 1024)
    args = deploy_args(
        role_arn,
        image,
        "--model-dir",
        str(model),
        "--bucket",
        "hearth-artifacts",
        "--env",
        "HEARTH_MAX_MODEL_LEN=4096",
        "--env",
        "SM_HEARTH_ENABLE_PREFIX_CACHING=true",
        "--min-capacity",
        "1",
        "--max-capacity",
        "3",
        "--target-invocations",
        "20",
    )

    # deploy
    first = cli(*args)
    assert first.code == 0, first.err
    assert [
        line.rsplit(":", 1)[0].split()[0] + ":" + line.split(": ")[1].split()[0]
        for line in first.lines
    ] == [
        "model-data:created",
        "model:created",
        "endpoint-config:created",
        "endpoint:created",
        "scalable-target:created",
        "scaling-policy:created",
    ]
    assert "packaging 2 file(s)" in first.err and "endpoint demo: InService" in first.err
    endpoint = sm.describe_endpoint(EndpointName="demo")
    config = sm.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])
    model_desc = sm.describe_model(ModelName=config["ProductionVariants"][0]["ModelName"])
    container = model_desc["PrimaryContainer"]
    assert container["ModelDataUrl"].startswith("s3://hearth-artifacts/hearth/demo/model-")
    assert container["Environment"] == {
        "HEARTH_MAX_MODEL_LEN": "4096",
        "SM_HEARTH_ENABLE_PREFIX_CACHING": "true",
    }

    # rerun: idempotent
    again = cli(*args)
    assert again.code == 0
    assert {status for _, status in statuses(again)} == {"unchanged"}
    assert len(again.lines) == 6

    # update: bigger instance type with autoscaling registered
    update = cli(
        "deploy",
        "update",
        "--name",
        "demo",
        "--instance-type",
        "ml.p3.2xlarge",
        "--instance-count",
        "2",
        "--env",
        "HEARTH_MAX_NUM_SEQS=64",
        "--unset-env",
        "SM_HEARTH_ENABLE_PREFIX_CACHING",
        "--max-capacity",
        "6",
        "--poll-interval",
        "0",
    )
    assert update.code == 0, update.err
    assert statuses(update) == [
        ("scaling-policy", "deleted"),  # instance type change: deregister first
        ("scalable-target", "deleted"),
        ("model", "created"),  # environment changed
        ("endpoint-config", "created"),
        ("endpoint", "updated"),
        ("endpoint-config", "deleted"),
        ("model", "deleted"),
        ("scalable-target", "created"),
        ("scaling-policy", "created"),
    ]
    assert "endpoint demo: Updating" in update.err
    endpoint = sm.describe_endpoint(EndpointName="demo")
    (variant,) = sm.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])[
        "ProductionVariants"
    ]
    assert (variant["InstanceType"], variant["InitialInstanceCount"]) == ("ml.p3.2xlarge", 2)
    new_model = sm.describe_model(ModelName=variant["ModelName"])["PrimaryContainer"]
    assert new_model["Environment"] == {"HEARTH_MAX_MODEL_LEN": "4096", "HEARTH_MAX_NUM_SEQS": "64"}
    assert new_model["ModelDataUrl"] == container["ModelDataUrl"]  # data kept
    (target,) = aas.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"]
    assert (target["MinCapacity"], target["MaxCapacity"]) == (1, 6)
    (policy,) = aas.describe_scaling_policies(ServiceNamespace="sagemaker")["ScalingPolicies"]
    assert policy["TargetTrackingScalingPolicyConfiguration"]["TargetValue"] == 20.0  # kept

    # invoke, buffered
    moto_api.endpoint_results(json.dumps(CHAT))
    answer = cli("invoke", "--endpoint", "demo", "--prompt", "What is the capital of France?")
    assert (answer.code, answer.out) == (0, "Paris.\n")

    # invoke, streamed: parts cut mid-event and inside "—" (3 bytes) and "ç" (2 bytes)
    body = stream_body()
    dash, cedilla = body.index("—".encode()) + 1, body.index("ç".encode()) + 1
    cuts = [0, 17, dash, cedilla, len(body)]
    shims.stream.queue([eventstream.payload_part(body[a:b]) for a, b in itertools.pairwise(cuts)])
    streamed = cli("invoke", "--endpoint", "demo", "--prompt", "capital?", "--stream")
    assert (streamed.code, streamed.out) == (0, "The capital is Paris — ça va.\n")
    assert shims.stream.requests[-1]["body"]["stream"] is True

    # delete everything
    deleted = cli("deploy", "delete", "--name", "demo", "--poll-interval", "0")
    assert deleted.code == 0, deleted.err
    assert [line.split()[0] for line in deleted.lines] == [
        "scaling-policy",
        "scalable-target",
        "endpoint",
        "endpoint-config",
        "model",
    ]
    assert all(line.endswith(": deleted") for line in deleted.lines)
    assert sm.list_endpoints()["Endpoints"] == []
    assert sm.list_endpoint_configs()["EndpointConfigs"] == []
    assert sm.list_models()["Models"] == []
    assert aas.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"] == []
    assert cli("deploy", "delete", "--name", "demo", "--poll-interval", "0").lines == [
        "endpoint demo: absent"
    ]


def test_update_toggles_metrics_and_autoscaling(
    cli: Any, clients: Any, role_arn: str, image: str
) -> None:
    assert cli(*deploy_args(role_arn, image, "--max-capacity", "2")).code == 0
    sm, aas = clients("sagemaker"), clients("application-autoscaling")

    result = cli(
        "deploy",
        "update",
        "--name",
        "demo",
        "--prometheus-metrics",
        "--metrics-frequency",
        "30",
        "--poll-interval",
        "0",
    )
    assert result.code == 0, result.err
    model_name = sm.describe_endpoint_config(
        EndpointConfigName=sm.describe_endpoint(EndpointName="demo")["EndpointConfigName"]
    )["ProductionVariants"][0]["ModelName"]
    metrics = sm.describe_model(ModelName=model_name)["PrimaryContainer"]["ContainerMetricsConfig"]
    assert metrics == {
        "MetricsEndpoints": [
            {"MetricsEndpointPath": "/metrics", "MetricPublishFrequencyInSeconds": 30}
        ]
    }
    assert (
        "scalable-target endpoint/demo/variant/AllTraffic: deleted" not in result.lines
    )  # same type

    off = cli("deploy", "update", "--name", "demo", "--disable-autoscaling", "--poll-interval", "0")
    assert off.code == 0, off.err
    assert "scalable-target endpoint/demo/variant/AllTraffic: deleted" in off.lines
    assert aas.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"] == []
    assert all(
        ": unchanged" in line for line in off.lines if line.startswith(("model ", "endpoint"))
    )


def test_lambda_deploy_rerun_and_delete(cli: Any, clients: Any, role_arn: str, image: str) -> None:
    args = [
        "deploy",
        "lambda",
        "--name",
        "fn",
        "--image",
        image,
        "--role",
        role_arn,
        "--memory",
        "4096",
    ]
    first = cli(*args)
    assert first.code == 0, first.err
    assert first.lines[0] == "lambda-function fn: created (buffered mode)"
    assert first.lines[1].startswith("function-url https://") and first.lines[1].endswith(
        ": created (AWS_IAM)"
    )
    assert clients("lambda").get_function_configuration(FunctionName="fn")["MemorySize"] == 4096
    assert [line.split(": ")[1].split()[0] for line in cli(*args).lines] == [
        "unchanged",
        "unchanged",
    ]
    gone = cli("deploy", "delete", "--name", "fn", "--lambda")
    assert gone.code == 0
    assert gone.lines[-1] == "lambda-function fn: deleted"


def test_invoke_lambda_function(
    cli: Any, clients: Any, role_arn: str, image: str, moto_api: Any
) -> None:
    assert (
        cli(
            "deploy", "lambda", "--name", "fn", "--image", image, "--role", role_arn, "--no-url"
        ).code
        == 0
    )
    moto_api.lambda_result(json.dumps({"statusCode": 200, "body": json.dumps(CHAT)}))
    result = cli(
        "invoke",
        "--function",
        "fn",
        "--body",
        '{"messages": [{"role": "user", "content": "q"}]}',
        "--raw",
    )
    assert result.code == 0, result.err
    assert json.loads(result.out) == CHAT


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["deploy", "update", "--name", "nope", "--poll-interval", "0"],
            "error: endpoint nope not found",
        ),
        (["deploy", "delete", "--name", "bad_name"], "error: invalid deployment name 'bad_name'"),
        (["invoke", "--function", "f", "--prompt", "x", "--stream"], "error: streaming (--stream"),
        (["invoke", "--function", "f", "--body", '{"stream": true}'], "error: streaming (--stream"),
        (["invoke", "--endpoint", "e", "--body", "{oops"], "error: --body is not valid JSON"),
    ],
)
def test_failures_are_one_line_on_stderr(cli: Any, argv: list[str], message: str) -> None:
    result = cli(*argv)
    assert result.code == 1
    assert result.out == ""
    assert result.err.startswith(message)
    assert result.err.count("\n") == 1


def test_aws_rejection_is_one_line(cli: Any, role_arn: str, image: str) -> None:
    # moto validates the instance type against its (old) enum, as AWS validates it.
    args = deploy_args(role_arn, image)
    args[args.index("ml.g4dn.xlarge")] = "ml.bogus.xlarge"
    result = cli(*args)
    assert result.code == 1
    assert result.err.startswith("error: CreateEndpointConfig failed: ValidationException")
    assert result.err.count("\n") == 1
    assert result.lines == [result.lines[0]] and result.lines[0].startswith("model demo-m-")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-capacity", "2", "--no-wait"], "drop --no-wait"),
        (["--model-dir", "/tmp"], "needs --bucket"),
        (["--env", "NOEQUALS"], "KEY=VALUE"),
        (["--startup-timeout", "10"], "60-3600"),
        (["--max-capacity", "1", "--min-capacity", "2"], "below min capacity"),
    ],
)
def test_bad_arguments_fail_before_touching_aws(
    cli: Any, clients: Any, role_arn: str, image: str, extra: list[str], message: str
) -> None:
    result = cli(*deploy_args(role_arn, image, *extra))
    assert result.code == 1
    assert message in result.err
    assert clients("sagemaker").list_models()["Models"] == []


def test_no_region_and_no_credentials(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    parser = argparse.ArgumentParser(prog="hearth")
    add_commands(parser.add_subparsers(dest="command", required=True))
    monkeypatch.setattr(cli_module, "make_session", make_session)
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    args = parser.parse_args(["invoke", "--endpoint", "e", "--prompt", "x"])
    assert args.func(args) == 1
    assert (
        capsys.readouterr().err
        == "error: no AWS region: pass --region or set AWS_REGION / AWS_DEFAULT_REGION\n"
    )

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # never reach the network
    args = parser.parse_args(
        ["invoke", "--endpoint", "e", "--prompt", "x", "--region", "eu-west-1"]
    )
    assert args.func(args) == 1
    assert capsys.readouterr().err.startswith("error: no usable AWS credentials")


def test_parse_env() -> None:
    assert parse_env(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    assert parse_env(None) == {}
    with pytest.raises(DeployError):
        parse_env(["=v"])


def test_parser_shape_and_help(capsys: Any) -> None:
    parser = argparse.ArgumentParser(prog="hearth")
    add_commands(parser.add_subparsers(dest="command", required=True))
    for argv in (
        ["deploy", "sagemaker"],
        ["deploy", "update"],
        ["deploy", "delete"],
        ["deploy", "lambda"],
        ["invoke"],
    ):
        with pytest.raises(SystemExit) as info:
            parser.parse_args([*argv, "--help"])
        assert info.value.code == 0
        assert "--region" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["deploy"])  # a target is required
    args = parser.parse_args(["deploy", "sagemaker", "--name", "n", "--image", "i", "--role", "r"])
    assert args.func is cli_module.cmd_deploy_sagemaker
    assert (args.instance_type, args.instance_count, args.startup_timeout) == (
        "ml.g5.xlarge",
        1,
        900,
    )
    update = parser.parse_args(["deploy", "update", "--name", "n"])
    assert (
        update.instance_type is None
        and update.image is None
        and update.func is cli_module.cmd_deploy_update
    )


def test_instance_type_change_without_waiting_explains_how_to_restore_scaling(
    cli: Any, clients: Any, role_arn: str, image: str
) -> None:
    assert cli(*deploy_args(role_arn, image, "--max-capacity", "4")).code == 0
    result = cli(
        "deploy", "update", "--name", "demo", "--instance-type", "ml.p3.2xlarge", "--no-wait"
    )
    assert result.code == 0, result.err
    assert statuses(result)[:2] == [("scaling-policy", "deleted"), ("scalable-target", "deleted")]
    assert statuses(result)[-1] == ("endpoint", "updated")
    assert "--min-capacity 1 --max-capacity 4 --target-invocations 60" in result.err
    aas = clients("application-autoscaling")
    assert aas.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"] == []


def test_update_without_changes_leaves_the_endpoint_alone(
    cli: Any, role_arn: str, image: str, sm_backend: Any, shims: Any
) -> None:
    assert cli(*deploy_args(role_arn, image)).code == 0
    # AWS may echo settings this tool never sent (here a routing default); reading the
    # endpoint back then hashes to another config name, which must not trigger a rollout.
    (config,) = sm_backend.endpoint_configs.values()
    config.production_variants[0]["RoutingConfig"] = {"RoutingStrategy": "RANDOM"}

    result = cli("deploy", "update", "--name", "demo", "--poll-interval", "0")

    assert result.code == 0, result.err
    assert result.lines == ["endpoint demo: unchanged (no endpoint setting changed)"]
    assert shims.update.calls == []


def test_body_asking_for_a_stream_is_streamed(cli: Any, shims: Any, eventstream: Any) -> None:
    shims.stream.queue([eventstream.payload_part(stream_body())])
    body = json.dumps({"prompt": "The capital of France", "stream": True, "max_tokens": 8})
    result = cli("invoke", "--endpoint", "demo", "--body", body)
    assert (result.code, result.out) == (0, "The capital is Paris — ça va.\n")
    assert shims.stream.requests[0]["body"]["prompt"] == "The capital of France"


def test_public_function_url_without_api_key_warns(
    cli: Any, clients: Any, role_arn: str, image: str
) -> None:
    """Issue 8 item 9: a public Function URL with no key must not deploy without a word."""
    base = ["deploy", "lambda", "--name", "pub", "--image", image, "--role", role_arn]
    public = cli(*base, "--url-auth", "NONE")
    assert public.code == 0, public.err
    assert "warning: the Function URL is public" in public.err
    keyed = cli(*base, "--url-auth", "NONE", "--env", "HEARTH_API_KEY=k")
    assert keyed.code == 0, keyed.err
    assert "warning" not in keyed.err


def _put_own_policy(aas: Any) -> None:
    aas.put_scaling_policy(
        PolicyName="users-own-step-policy",
        ServiceNamespace="sagemaker",
        ResourceId="endpoint/demo/variant/AllTraffic",
        ScalableDimension="sagemaker:variant:DesiredInstanceCount",
        PolicyType="StepScaling",
        StepScalingPolicyConfiguration={
            "AdjustmentType": "ChangeInCapacity",
            "StepAdjustments": [{"MetricIntervalLowerBound": 0.0, "ScalingAdjustment": 1}],
            "Cooldown": 120,
        },
    )


def _policy_names(aas: Any) -> set[str]:
    policies = aas.describe_scaling_policies(ServiceNamespace="sagemaker")["ScalingPolicies"]
    return {p["PolicyName"] for p in policies}


def test_an_instance_type_change_keeps_the_users_own_scaling_policies(
    cli: Any, clients: Any, role_arn: str, image: str
) -> None:
    """Issue 17 item 8: the change deregisters the scaling target, which deleted every
    policy on the variant; only hearth's target-tracking policy was put back."""
    assert cli(*deploy_args(role_arn, image, "--max-capacity", "4")).code == 0
    aas = clients("application-autoscaling")
    _put_own_policy(aas)
    ours = _policy_names(aas) - {"users-own-step-policy"}
    assert len(ours) == 1

    refused = cli(
        "deploy", "update", "--name", "demo", "--instance-type", "ml.p3.2xlarge", "--no-wait"
    )
    assert refused.code != 0 and "users-own-step-policy" in refused.err
    assert _policy_names(aas) == ours | {"users-own-step-policy"}  # nothing touched

    result = cli(
        "deploy",
        "update",
        "--name",
        "demo",
        "--instance-type",
        "ml.p3.2xlarge",
        "--poll-interval",
        "0",
    )
    assert result.code == 0, result.err
    assert ("scaling-policy", "created") in statuses(result)
    assert "scaling-policy users-own-step-policy: created (restored)" in result.lines
    assert _policy_names(aas) == ours | {"users-own-step-policy"}
    [own] = [
        p
        for p in aas.describe_scaling_policies(ServiceNamespace="sagemaker")["ScalingPolicies"]
        if p["PolicyName"] == "users-own-step-policy"
    ]
    assert own["PolicyType"] == "StepScaling"
    assert own["StepScalingPolicyConfiguration"]["Cooldown"] == 120
