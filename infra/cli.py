"""``hearth deploy ...`` and ``hearth invoke ...``: argparse wiring over :mod:`infra`.

:func:`add_commands` registers the sub-commands on the ``hearth`` CLI's sub-parsers; every
handler is ``(args) -> int``, prints one line per resource it touched (``created`` /
``updated`` / ``unchanged`` / ``deleted`` / ``absent``) on stdout, progress on stderr, and any
AWS failure as a single ``error: ...`` line on stderr with exit code 1.  All commands are
idempotent: running one twice reports ``unchanged`` the second time.

A handler only turns arguments into specs and calls one function that does the work:
:mod:`infra.rollout` (SageMaker), :mod:`infra.lambda_fn`, :mod:`infra.invoke`. The shared
argument groups are declared in :mod:`infra.cli_args`.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from infra import lambda_fn, rollout
from infra.artifacts import ModelSource
from infra.autoscaling import ScalingSpec
from infra.batch import TransformSpec, run_batch
from infra.cli_args import ENV_HELP, adopt_arg, aws_parent, model_args, sagemaker_args, wait_args
from infra.errors import AWS_ERRORS, DeployError, describe_error
from infra.inference_components import parse_adapters
from infra.invoke import chat_body, load_body, send
from infra.naming import validate_deployment_name
from infra.results import Result
from infra.sagemaker_spec import AsyncSpec, EndpointSpec, MetricsSpec, ModelSpec, VariantSpec
from infra.sagemaker_status import Waiting
from infra.session import Clients, make_session

__all__ = ["add_commands", "parse_env"]

Handler = Callable[[argparse.Namespace], int]


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


def _clients(args: argparse.Namespace) -> Clients:
    """Clients from ``--region`` / ``--profile``; the session is made on first use."""
    region, profile = getattr(args, "region", None), getattr(args, "profile", None)
    return Clients(lambda: make_session(region, profile))


def _options(args: argparse.Namespace) -> rollout.RolloutOptions:
    return rollout.RolloutOptions(
        waiting=Waiting(timeout_s=args.wait_timeout, poll_s=args.poll_interval, progress=_progress),
        wait=not args.no_wait,
        prune=not getattr(args, "keep_old", False),
        report=_emit,
        progress=_progress,
    )


def _source(args: argparse.Namespace) -> ModelSource:
    return ModelSource(args.model_dir, args.model_s3, args.bucket, args.prefix)


def _given(args: argparse.Namespace, **fields: str) -> dict[str, Any]:
    """``spec field -> value`` for the arguments (``field="arg"``) given on the command line."""
    return {
        field: getattr(args, arg) for field, arg in fields.items() if getattr(args, arg) is not None
    }


# ---------------------------------------------------------------------------- handlers


@_command
def cmd_deploy_sagemaker(args: argparse.Namespace) -> int:
    """Create or converge an endpoint to exactly the given arguments."""
    name = validate_deployment_name(args.name)
    variant = VariantSpec(
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
        MetricsSpec(args.metrics_path, args.metrics_frequency) if args.prometheus_metrics else None
    )
    model = ModelSpec(image=args.image, role_arn=args.role, environment=parse_env(args.env))
    scaling = (
        ScalingSpec(
            max_capacity=args.max_capacity,
            min_capacity=args.min_capacity,
            target_invocations=args.target_invocations,
            scale_in_cooldown_s=args.scale_in_cooldown,
            scale_out_cooldown_s=args.scale_out_cooldown,
        )
        if args.max_capacity is not None
        else None
    )
    rollout.deploy(
        _clients(args),
        EndpointSpec(
            name, model, variant, metrics, _async_spec(args), parse_adapters(args.adapter)
        ),
        scaling,
        _options(args),
        source=_source(args),
        adopt=args.adopt,
    )
    return 0


def _async_spec(args: argparse.Namespace) -> AsyncSpec | None:
    """``--async --output s3://...`` (the S3 options mean nothing without ``--async``)."""
    options = (args.output, args.failure_output, args.max_concurrent_invocations)
    if not args.async_inference:
        if any(option is not None for option in options):
            raise DeployError(
                "--output, --failure-output and --max-concurrent-invocations need --async"
            )
        return None
    if args.output is None:
        raise DeployError("--async needs --output s3://bucket/prefix for the answers")
    return AsyncSpec(args.output, args.failure_output, args.max_concurrent_invocations)


@_command
def cmd_deploy_update(args: argparse.Namespace) -> int:
    """Change some settings of an existing endpoint and roll it onto the result."""
    changes = rollout.EndpointUpdate(
        set_env=parse_env(args.env),
        unset_env=tuple(args.unset_env or ()),
        model=_given(args, image="image", role_arn="role"),
        variant=_given(
            args,
            instance_type="instance_type",
            instance_count="instance_count",
            name="variant_name",
            startup_timeout_s="startup_timeout",
            download_timeout_s="download_timeout",
            volume_size_gb="volume_size",
            inference_ami_version="inference_ami_version",
            routing_strategy="routing_strategy",
        ),
        metrics=_given(args, path="metrics_path", frequency_s="metrics_frequency"),
        enable_metrics=bool(args.prometheus_metrics),
        disable_metrics=args.no_prometheus_metrics,
        scaling=_given(
            args,
            max_capacity="max_capacity",
            min_capacity="min_capacity",
            target_invocations="target_invocations",
            scale_in_cooldown_s="scale_in_cooldown",
            scale_out_cooldown_s="scale_out_cooldown",
        ),
        disable_scaling=args.disable_autoscaling,
        source=_source(args),
    )
    rollout.update(_clients(args), args.name, changes, _options(args), adopt=args.adopt)
    return 0


@_command
def cmd_deploy_delete(args: argparse.Namespace) -> int:
    """Delete everything a deployment created (autoscaling, endpoint, configs, models),
    or with ``--lambda`` the Lambda function and its URL."""
    if args.lambda_function:
        for result in lambda_fn.delete_function(_clients(args)("lambda"), args.name):
            _emit(result)
        return 0
    rollout.delete(_clients(args), args.name, _options(args))
    return 0


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
    lambda_fn.deploy(_clients(args), spec, adopt=args.adopt, report=_emit, warn=_progress)
    return 0


@_command
def cmd_batch(args: argparse.Namespace) -> int:
    """Run a batch transform job (MultiRecord, Line) over the JSON Lines under --input."""
    spec = TransformSpec(
        name=args.name,
        input_s3=args.input,
        output_s3=args.output,
        instance_type=args.instance_type,
        instance_count=args.instance_count,
        max_payload_mb=args.max_payload_mb,
        max_concurrent_transforms=args.max_concurrent_transforms,
        invocation_timeout_s=args.invocation_timeout,
    )
    model = ModelSpec(image=args.image, role_arn=args.role, environment=parse_env(args.env))
    waiting = Waiting(timeout_s=args.wait_timeout, poll_s=args.poll_interval, progress=_progress)
    run_batch(
        _clients(args),
        model,
        spec,
        waiting,
        source=_source(args),
        wait=not args.no_wait,
        report=_emit,
    )
    return 0


@_command
def cmd_invoke(args: argparse.Namespace) -> int:
    """Send one request to an endpoint (optionally streamed) or to a Lambda function."""
    if args.body is not None:
        body = load_body(args.body)
    else:
        body = chat_body(
            args.prompt, max_tokens=args.max_tokens, model=args.model, temperature=args.temperature
        )
    for piece in send(
        _clients(args),
        body,
        endpoint=args.endpoint,
        function=args.function,
        stream=args.stream,
        raw=args.raw,
        path=args.path,
        custom_attributes=args.custom_attributes,
        variant=args.variant,
    ):
        sys.stdout.write(piece)
        sys.stdout.flush()
    return 0


# ---------------------------------------------------------------------------- registration


def add_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``deploy`` (sagemaker / update / delete / lambda) and ``invoke``."""
    aws = aws_parent()
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
    sagemaker_args(p, update=False)
    p.set_defaults(func=cmd_deploy_sagemaker)

    p = targets.add_parser(
        "update",
        parents=[aws],
        help="change settings of an existing SageMaker endpoint",
        description="Start from what the endpoint runs now, apply the given options, and "
        "roll the endpoint onto the result (a new config; no downtime).",
    )
    sagemaker_args(p, update=True)
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
    wait_args(p)
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
        help="extra `hearth serve` argument, stream mode only (repeatable); in buffered "
        "mode set HEARTH_* variables with --env",
    )
    p.add_argument("--ephemeral-storage", type=int, metavar="MB", help="/tmp size, 512-10240")
    p.add_argument("--architecture", choices=("x86_64", "arm64"), default="x86_64")
    p.add_argument(
        "--url-auth", choices=("AWS_IAM", "NONE"), default="AWS_IAM", help="default AWS_IAM"
    )
    p.add_argument("--no-url", action="store_true", help="do not create a Function URL")
    adopt_arg(p)
    p.set_defaults(func=cmd_deploy_lambda)

    p = subparsers.add_parser(
        "batch",
        parents=[aws],
        help="run a SageMaker batch transform job over JSON Lines in S3",
        description="Create the model and a transform job (BatchStrategy MultiRecord, "
        "SplitType Line, AssembleWith Line): every line under --input is one request, "
        "answered by one line under --output. Idempotent: the same arguments find the "
        "same job.",
    )
    p.add_argument("--name", required=True, help="job name prefix (also names the model)")
    model_args(p)
    p.add_argument("--input", required=True, metavar="S3URI", help="JSON Lines objects to run")
    p.add_argument("--output", required=True, metavar="S3URI", help="where the answers go")
    p.add_argument("--instance-type", default="ml.g5.xlarge", help="default ml.g5.xlarge")
    p.add_argument("--instance-count", type=int, default=1, help="default 1")
    p.add_argument(
        "--max-payload-mb",
        type=int,
        default=6,
        metavar="MB",
        help="largest request payload in MB, records packed up to it (MaxPayloadInMB, "
        "0-100; default 6)",
    )
    p.add_argument(
        "--max-concurrent-transforms",
        type=int,
        metavar="N",
        help="requests in flight per instance (default: the container's /execution-parameters)",
    )
    p.add_argument(
        "--invocation-timeout",
        type=int,
        default=3600,
        metavar="SECONDS",
        help="per request, 1-3600 (default 3600)",
    )
    wait_args(p)
    p.set_defaults(func=cmd_batch)

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
