"""``hearth deploy ...`` and ``hearth invoke ...``: argparse wiring over :mod:`infra`.

:func:`add_commands` registers the sub-commands on the ``hearth`` CLI's sub-parsers; every
handler is ``(args) -> int``, prints one line per resource it touched (``created`` /
``updated`` / ``unchanged`` / ``deleted`` / ``absent``) on stdout, progress on stderr, and any
AWS failure as a single ``error: ...`` line on stderr with exit code 1.  All commands are
idempotent: running one twice reports ``unchanged`` the second time.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from infra import autoscaling, lambda_fn, rollout, sagemaker
from infra.artifacts import ModelData, existing_model_data, package_and_upload
from infra.errors import AWS_ERRORS, DeployError, describe_error
from infra.invoke import (
    chat_body,
    invoke_json,
    invoke_lambda,
    load_body,
    response_text,
    stream_deltas,
)
from infra.naming import validate_deployment_name
from infra.results import Result
from infra.session import client_config, make_session

__all__ = ["add_commands", "parse_env"]

Handler = Callable[[argparse.Namespace], int]

ENV_HELP = (
    "container environment variable KEY=VALUE (repeatable); HEARTH_<FLAG> / SM_HEARTH_<FLAG> "
    "set `hearth serve` flags, e.g. HEARTH_MAX_MODEL_LEN=4096"
)


# ---------------------------------------------------------------------------- helpers


def _command(fn: Handler) -> Handler:
    """Turn DeployError and botocore failures into one ``error:`` line and exit code 1."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (DeployError, *AWS_ERRORS) as exc:
            print(f"error: {describe_error(exc)}", file=sys.stderr, flush=True)
            return 1

    return run


def _emit(result: Result) -> None:
    print(result.line(), flush=True)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_env(pairs: Sequence[str] | None) -> dict[str, str]:
    """``["K=V", ...]`` -> ``{"K": "V"}``; the value may itself contain ``=``."""
    env: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise DeployError(f"--env expects KEY=VALUE, got {pair!r}")
        env[key.strip()] = value
    return env


def _session(args: argparse.Namespace) -> Any:
    return make_session(getattr(args, "region", None), getattr(args, "profile", None))


def _waiting(args: argparse.Namespace) -> sagemaker.Waiting:
    return sagemaker.Waiting(
        timeout_s=args.wait_timeout, poll_s=args.poll_interval, progress=_progress
    )


def _aws_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("AWS")
    group.add_argument("--region", help="AWS region (default: the boto3 default chain)")
    group.add_argument("--profile", help="AWS named profile (default: the boto3 default chain)")
    return parent


def _wait_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("waiting")
    group.add_argument("--no-wait", action="store_true", help="return once requests are accepted")
    group.add_argument(
        "--wait-timeout", type=float, default=3600.0, metavar="SECONDS", help="default 3600"
    )
    group.add_argument(
        "--poll-interval", type=float, default=15.0, metavar="SECONDS", help="default 15"
    )


# ---------------------------------------------------------------------------- arguments


def _adopt_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--adopt",
        action="store_true",
        help="take over an existing endpoint/function that `hearth deploy` did not create "
        "(it gets our ownership tag, so `delete` can remove it later)",
    )


def _sagemaker_args(parser: argparse.ArgumentParser, *, update: bool) -> None:
    """Arguments of ``deploy sagemaker`` (full spec) and ``deploy update`` (overrides only:
    every default is None so that "not given" keeps what the endpoint runs now)."""

    def d(value: Any) -> Any:
        return None if update else value

    _adopt_arg(parser)

    parser.add_argument("--name", required=True, help="endpoint name (also prefixes the rest)")
    what = parser.add_argument_group("model")
    what.add_argument("--image", required=not update, help="container image URI in ECR")
    what.add_argument(
        "--role", required=not update, metavar="ARN", help="SageMaker execution role ARN"
    )
    data = what.add_mutually_exclusive_group()
    data.add_argument(
        "--model-dir",
        type=Path,
        metavar="PATH",
        help="local model directory or GGUF file, uploaded as model.tar.gz (needs --bucket)",
    )
    data.add_argument(
        "--model-s3",
        metavar="S3URI",
        help="existing model data: s3://.../model.tar.gz, or an uncompressed s3:// prefix",
    )
    what.add_argument("--bucket", help="S3 bucket for --model-dir uploads")
    what.add_argument(
        "--prefix", help="S3 key prefix for --model-dir uploads (default hearth/<name>)"
    )
    what.add_argument("--env", action="append", metavar="KEY=VALUE", help=ENV_HELP)
    if update:
        what.add_argument(
            "--unset-env", action="append", metavar="KEY", help="remove a variable (repeatable)"
        )

    where = parser.add_argument_group("instances")
    where.add_argument("--instance-type", default=d("ml.g5.xlarge"), help="default ml.g5.xlarge")
    where.add_argument("--instance-count", type=int, default=d(1), help="default 1")
    where.add_argument(
        "--variant-name", default=d(sagemaker.DEFAULT_VARIANT), help="default AllTraffic"
    )
    where.add_argument(
        "--startup-timeout",
        type=int,
        default=d(900),
        metavar="SECONDS",
        help="ContainerStartupHealthCheckTimeoutInSeconds: model load + warm-up (60-3600, "
        "default 900)",
    )
    where.add_argument(
        "--download-timeout",
        type=int,
        default=d(1200),
        metavar="SECONDS",
        help="ModelDataDownloadTimeoutInSeconds (60-3600, default 1200)",
    )
    where.add_argument(
        "--volume-size",
        type=int,
        metavar="GB",
        help="VolumeSizeInGB, only for instance types without local NVMe",
    )
    where.add_argument(
        "--inference-ami-version",
        metavar="VERSION",
        help="host AMI, e.g. al2-ami-sagemaker-inference-gpu-3-1 (newer NVIDIA driver)",
    )
    where.add_argument(
        "--routing-strategy", choices=sagemaker.ROUTING_STRATEGIES, help="RoutingConfig"
    )

    metrics = parser.add_argument_group("metrics (SageMaker scrapes /metrics into CloudWatch)")
    metrics.add_argument(
        "--prometheus-metrics",
        action="store_true",
        default=None if update else False,
        help="enable detailed observability (MetricsConfig + ContainerMetricsConfig)",
    )
    if update:
        metrics.add_argument(
            "--no-prometheus-metrics", action="store_true", help="turn scraping off again"
        )
    metrics.add_argument("--metrics-path", default=d("/metrics"), help="default /metrics")
    metrics.add_argument(
        "--metrics-frequency",
        type=int,
        choices=sagemaker.METRIC_FREQUENCIES,
        default=d(60),
        metavar="SECONDS",
        help="publish period: 10, 30, 60, 120, 180, 240 or 300 (default 60)",
    )

    scaling = parser.add_argument_group("autoscaling (on when --max-capacity is given)")
    scaling.add_argument("--min-capacity", type=int, default=d(1), help="default 1")
    scaling.add_argument("--max-capacity", type=int, help="maximum instance count")
    scaling.add_argument(
        "--target-invocations",
        type=float,
        default=d(60.0),
        metavar="PER_MINUTE",
        help="target invocations per instance per minute (default 60)",
    )
    scaling.add_argument(
        "--scale-in-cooldown", type=int, default=d(300), metavar="SECONDS", help="default 300"
    )
    scaling.add_argument(
        "--scale-out-cooldown", type=int, default=d(60), metavar="SECONDS", help="default 60"
    )
    if update:
        scaling.add_argument(
            "--disable-autoscaling", action="store_true", help="remove the scaling policy"
        )
    parser.add_argument(
        "--keep-old",
        action="store_true",
        help="keep superseded endpoint configs and models instead of deleting them",
    )
    _wait_args(parser)


# ---------------------------------------------------------------------------- deploy


def _model_data(
    session: Any, args: argparse.Namespace, name: str
) -> tuple[ModelData | None, Result | None]:
    if args.model_dir is not None:
        if not args.bucket:
            raise DeployError("--model-dir needs --bucket to upload the model to")
        s3 = session.client("s3", config=client_config())
        prefix = args.prefix or f"hearth/{name}"
        return package_and_upload(s3, args.model_dir, args.bucket, prefix, _progress)
    if args.model_s3:
        return existing_model_data(session.client("s3", config=client_config()), args.model_s3)
    return None, None


def _rollout(
    session: Any,
    args: argparse.Namespace,
    spec: sagemaker.EndpointSpec,
    scaling: autoscaling.ScalingSpec | None,
    *,
    remove_scaling: bool = False,
    running: sagemaker.EndpointSpec | None = None,
) -> int:
    """Shared tail of ``deploy sagemaker`` and ``deploy update`` (:func:`infra.rollout.rollout`)."""
    rollout.rollout(
        session.client("sagemaker", config=client_config()),
        session.client("application-autoscaling", config=client_config()),
        spec,
        scaling,
        _waiting(args),
        wait=not args.no_wait,
        prune=not args.keep_old,
        report=_emit,
        progress=_progress,
        remove_scaling=remove_scaling,
        running=running,
    )
    return 0


def _claim(session: Any, name: str, args: argparse.Namespace) -> None:
    """Never take over an endpoint `hearth deploy` did not create, unless --adopt."""
    sm = session.client("sagemaker", config=client_config())
    result = sagemaker.claim_endpoint(sm, name, adopt=args.adopt)
    if result is not None:
        _emit(result)


@_command
def cmd_deploy_sagemaker(args: argparse.Namespace) -> int:
    """Create or converge an endpoint to exactly the given arguments."""
    name = validate_deployment_name(args.name)
    variant = sagemaker.VariantSpec(
        instance_type=args.instance_type,
        instance_count=args.instance_count,
        name=args.variant_name,
        startup_timeout_s=args.startup_timeout,
        download_timeout_s=args.download_timeout,
        volume_size_gb=args.volume_size,
        inference_ami_version=args.inference_ami_version,
        routing_strategy=args.routing_strategy,
    )
    metrics = (
        sagemaker.MetricsSpec(args.metrics_path, args.metrics_frequency)
        if args.prometheus_metrics
        else None
    )
    model = sagemaker.ModelSpec(
        image=args.image, role_arn=args.role, environment=parse_env(args.env)
    )
    scaling = (
        autoscaling.ScalingSpec(
            max_capacity=args.max_capacity,
            min_capacity=args.min_capacity,
            target_invocations=args.target_invocations,
            scale_in_cooldown_s=args.scale_in_cooldown,
            scale_out_cooldown_s=args.scale_out_cooldown,
        )
        if args.max_capacity is not None
        else None
    )
    # Validate everything before the (possibly long) upload.
    sagemaker.EndpointSpec(name, model, variant, metrics).validate()
    rollout.check_scaling_wait(scaling, wait=not args.no_wait)

    session = _session(args)
    _claim(session, name, args)
    data, data_result = _model_data(session, args, name)
    if data_result is not None:
        _emit(data_result)
    spec = sagemaker.EndpointSpec(name, replace(model, model_data=data), variant, metrics)
    return _rollout(session, args, spec, scaling)


def _overrides(args: argparse.Namespace, mapping: dict[str, str]) -> dict[str, Any]:
    return {
        field: getattr(args, arg)
        for arg, field in mapping.items()
        if getattr(args, arg) is not None
    }


@_command
def cmd_deploy_update(args: argparse.Namespace) -> int:
    """Change some settings of an existing endpoint and roll it onto the result."""
    name = validate_deployment_name(args.name)
    session = _session(args)
    _claim(session, name, args)
    sm = session.client("sagemaker", config=client_config())
    current = sagemaker.read_spec(sm, name)

    environment = rollout.updated_environment(
        current.model.environment, parse_env(args.env), args.unset_env or []
    )
    model = replace(
        current.model,
        environment=environment,
        **_overrides(args, {"image": "image", "role": "role_arn"}),
    )
    variant = replace(
        current.variant,
        **_overrides(
            args,
            {
                "instance_type": "instance_type",
                "instance_count": "instance_count",
                "variant_name": "name",
                "startup_timeout": "startup_timeout_s",
                "download_timeout": "download_timeout_s",
                "volume_size": "volume_size_gb",
                "inference_ami_version": "inference_ami_version",
                "routing_strategy": "routing_strategy",
            },
        ),
    )
    metrics = rollout.updated_metrics(
        current.metrics,
        _overrides(args, {"metrics_path": "path", "metrics_frequency": "frequency_s"}),
        enable=args.prometheus_metrics,
        disable=args.no_prometheus_metrics,
    )
    scaling = None
    if not args.disable_autoscaling:
        scaling_changes = _overrides(
            args,
            {
                "max_capacity": "max_capacity",
                "min_capacity": "min_capacity",
                "target_invocations": "target_invocations",
                "scale_in_cooldown": "scale_in_cooldown_s",
                "scale_out_cooldown": "scale_out_cooldown_s",
            },
        )
        aas = session.client("application-autoscaling", config=client_config())
        scaling = rollout.updated_scaling(aas, name, variant.name, scaling_changes)
    candidate = sagemaker.EndpointSpec(name, model, variant, metrics)
    candidate.validate()
    rollout.check_scaling_wait(scaling, wait=not args.no_wait)

    data, data_result = _model_data(session, args, name)
    if data_result is not None:
        _emit(data_result)
    if data is not None:
        candidate = replace(candidate, model=replace(model, model_data=data))
    return _rollout(
        session,
        args,
        candidate,
        scaling,
        remove_scaling=args.disable_autoscaling,
        running=current,
    )


@_command
def cmd_deploy_delete(args: argparse.Namespace) -> int:
    """Delete everything a deployment created (autoscaling, endpoint, configs, models),
    or with ``--lambda`` the Lambda function and its URL."""
    name = args.name
    session = _session(args)
    if args.lambda_function:
        lam = session.client("lambda", config=client_config())
        for result in lambda_fn.delete_function(lam, name):
            _emit(result)
        return 0
    validate_deployment_name(name)
    sm = session.client("sagemaker", config=client_config())
    aas = session.client("application-autoscaling", config=client_config())
    sagemaker.owned_endpoint(sm, name)  # refuse before touching anything of a foreign one
    for result in autoscaling.remove_scaling(aas, name):
        _emit(result)
    sagemaker.delete_deployment(sm, name, _waiting(args), wait=not args.no_wait, report=_emit)
    return 0


def _has_api_key(spec: lambda_fn.LambdaSpec) -> bool:
    if spec.environment.get("HEARTH_API_KEY"):
        return True
    return any(a == "--api-key" or a.startswith("--api-key=") for a in spec.serve_args)


@_command
def cmd_deploy_lambda(args: argparse.Namespace) -> int:
    """Create or update a container-image Lambda function and its Function URL."""
    spec = lambda_fn.LambdaSpec(
        name=args.name,
        image_uri=args.image,
        role_arn=args.role,
        memory_mb=args.memory,
        timeout_s=args.timeout,
        environment=parse_env(args.env),
        mode=args.mode,
        handler=args.handler,
        serve_args=tuple(args.serve_arg or ()),
        ephemeral_storage_mb=args.ephemeral_storage,
        architecture=args.architecture,
        url_auth=None if args.no_url else args.url_auth,
    )
    spec.validate()
    if spec.url_auth == "NONE" and not _has_api_key(spec):
        _progress(
            "warning: the Function URL is public (--url-auth NONE) and the function has no "
            "API key (HEARTH_API_KEY): anyone with the URL can run the model. Set a key, "
            "e.g. from Secrets Manager (see docs/deploy.md), or use --url-auth AWS_IAM."
        )
    lam = _session(args).client("lambda", config=client_config())
    _emit(lambda_fn.ensure_function(lam, spec, adopt=args.adopt))
    for result in lambda_fn.ensure_function_url(lam, spec):
        _emit(result)
    return 0


# ---------------------------------------------------------------------------- invoke


@_command
def cmd_invoke(args: argparse.Namespace) -> int:
    """Send one request to an endpoint (optionally streamed) or to a Lambda function."""
    if args.body is not None:
        body = load_body(args.body)
    else:
        body = chat_body(
            args.prompt, max_tokens=args.max_tokens, model=args.model, temperature=args.temperature
        )
    # A body that asks for a stream gets one: a buffered call would receive raw SSE text.
    stream = args.stream or body.get("stream") is True
    session = _session(args)
    if args.function:
        if stream:
            raise DeployError(
                'streaming (--stream or "stream": true) needs --endpoint; stream from Lambda '
                "through its Function URL (deploy with --mode stream)"
            )
        lam = session.client("lambda", config=client_config(read_timeout_s=905, max_attempts=1))
        path = args.path or ("/v1/chat/completions" if "messages" in body else "/v1/completions")
        answer = invoke_lambda(lam, args.function, body, path)
        print(json.dumps(answer, indent=2) if args.raw else response_text(answer), flush=True)
        return 0
    rt = session.client(
        "sagemaker-runtime", config=client_config(read_timeout_s=70, max_attempts=2)
    )
    if stream:
        for delta in stream_deltas(
            rt, args.endpoint, body, custom_attributes=args.custom_attributes, variant=args.variant
        ):
            if delta.index == 0 and delta.text:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        return 0
    answer = invoke_json(
        rt, args.endpoint, body, custom_attributes=args.custom_attributes, variant=args.variant
    )
    print(json.dumps(answer, indent=2) if args.raw else response_text(answer), flush=True)
    return 0


# ---------------------------------------------------------------------------- registration


def add_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``deploy`` (sagemaker / update / delete / lambda) and ``invoke``."""
    aws = _aws_parent()
    deploy = subparsers.add_parser(
        "deploy",
        help="deploy hearth to SageMaker or Lambda (boto3)",
        description="Create, update and delete hearth deployments on AWS. Every command is "
        "idempotent and prints one line per resource.",
    )
    targets = deploy.add_subparsers(dest="deploy_target", metavar="TARGET", required=True)

    p = targets.add_parser(
        "sagemaker",
        parents=[aws],
        help="create or converge a SageMaker real-time endpoint",
        description="Create the endpoint, or roll it onto new settings when they differ.",
    )
    _sagemaker_args(p, update=False)
    p.set_defaults(func=cmd_deploy_sagemaker)

    p = targets.add_parser(
        "update",
        parents=[aws],
        help="change settings of an existing SageMaker endpoint",
        description="Start from what the endpoint runs now, apply the given options, and "
        "roll the endpoint onto the result (a new config; no downtime).",
    )
    _sagemaker_args(p, update=True)
    p.set_defaults(func=cmd_deploy_update)

    p = targets.add_parser(
        "delete",
        parents=[aws],
        help="delete a deployment (SageMaker by default, or --lambda)",
        description="Delete the endpoint's autoscaling, the endpoint, and every endpoint config "
        "and model created for it. Model data in S3 is kept.",
    )
    p.add_argument("--name", required=True, help="endpoint (or function) name")
    p.add_argument(
        "--lambda",
        dest="lambda_function",
        action="store_true",
        help="delete the Lambda function NAME and its Function URL instead",
    )
    _wait_args(p)
    p.set_defaults(func=cmd_deploy_delete)

    p = targets.add_parser(
        "lambda",
        parents=[aws],
        help="create or update a Lambda function from the image, with a Function URL",
    )
    p.add_argument("--name", required=True, help="function name")
    p.add_argument("--image", required=True, help="container image URI in ECR")
    p.add_argument("--role", required=True, metavar="ARN", help="Lambda execution role ARN")
    p.add_argument("--memory", type=int, default=10240, metavar="MB", help="default 10240")
    p.add_argument("--timeout", type=int, default=900, metavar="SECONDS", help="default 900")
    p.add_argument("--env", action="append", metavar="KEY=VALUE", help=ENV_HELP)
    p.add_argument(
        "--mode",
        choices=lambda_fn.MODES,
        default="buffered",
        help="buffered: Mangum handler via awslambdaric; stream: `hearth serve` behind the "
        "Lambda Web Adapter (image must include it)",
    )
    p.add_argument(
        "--handler",
        default=lambda_fn.DEFAULT_HANDLER,
        help=f"buffered-mode handler (default {lambda_fn.DEFAULT_HANDLER})",
    )
    p.add_argument(
        "--serve-arg",
        action="append",
        metavar="ARG",
        help="extra `hearth serve` argument in stream mode (repeatable)",
    )
    p.add_argument("--ephemeral-storage", type=int, metavar="MB", help="/tmp size, 512-10240")
    p.add_argument("--architecture", choices=("x86_64", "arm64"), default="x86_64")
    p.add_argument(
        "--url-auth", choices=("AWS_IAM", "NONE"), default="AWS_IAM", help="default AWS_IAM"
    )
    p.add_argument("--no-url", action="store_true", help="do not create a Function URL")
    _adopt_arg(p)
    p.set_defaults(func=cmd_deploy_lambda)

    p = subparsers.add_parser(
        "invoke",
        parents=[aws],
        help="send a request to a deployed endpoint or Lambda function",
        description="POST an OpenAI chat/completions body to /invocations of a SageMaker "
        "endpoint (optionally streamed) or to a Lambda function.",
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--endpoint", help="SageMaker endpoint name")
    target.add_argument("--function", help="Lambda function name (buffered)")
    payload = p.add_mutually_exclusive_group(required=True)
    payload.add_argument("--body", help="request JSON, or @file")
    payload.add_argument("--prompt", help="text of one user chat message")
    p.add_argument("--stream", action="store_true", help="stream tokens as they are generated")
    p.add_argument("--max-tokens", type=int, default=256, help="with --prompt (default 256)")
    p.add_argument("--temperature", type=float, help="with --prompt")
    p.add_argument("--model", help="with --prompt: model name (optional on SageMaker)")
    p.add_argument("--raw", action="store_true", help="print the whole JSON response")
    p.add_argument("--custom-attributes", help="X-Amzn-SageMaker-Custom-Attributes")
    p.add_argument("--variant", help="TargetVariant")
    p.add_argument("--path", help="Lambda only: HTTP path (default from the body)")
    p.set_defaults(func=cmd_invoke)
