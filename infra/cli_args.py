"""The argument groups of the ``hearth deploy`` commands (declarations only).

Kept apart from :mod:`infra.cli` (which registers the commands and turns parsed arguments
into specs) because ``deploy sagemaker`` and ``deploy update`` share one long option set:
:func:`sagemaker_args` declares it once, with ``update=True`` making every default ``None``
so that "not given" keeps what the endpoint runs now.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from infra.sagemaker_spec import DEFAULT_VARIANT, METRIC_FREQUENCIES, ROUTING_STRATEGIES

__all__ = ["ENV_HELP", "adopt_arg", "aws_parent", "model_args", "sagemaker_args", "wait_args"]

ENV_HELP = (
    "container environment variable KEY=VALUE (repeatable); HEARTH_<FLAG> / SM_HEARTH_<FLAG> "
    "set `hearth serve` flags, e.g. HEARTH_MAX_MODEL_LEN=4096"
)


def aws_parent() -> argparse.ArgumentParser:
    """``--region`` / ``--profile``, as a parent parser of every command that calls AWS."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("AWS")
    group.add_argument("--region", help="AWS region (default: the boto3 default chain)")
    group.add_argument("--profile", help="AWS named profile (default: the boto3 default chain)")
    return parent


def wait_args(parser: argparse.ArgumentParser) -> None:
    """``--no-wait`` / ``--wait-timeout`` / ``--poll-interval``: how commands wait for AWS."""
    group = parser.add_argument_group("waiting")
    group.add_argument("--no-wait", action="store_true", help="return once requests are accepted")
    group.add_argument(
        "--wait-timeout", type=float, default=3600.0, metavar="SECONDS", help="default 3600"
    )
    group.add_argument(
        "--poll-interval", type=float, default=15.0, metavar="SECONDS", help="default 15"
    )


def adopt_arg(parser: argparse.ArgumentParser) -> None:
    """``--adopt``: the one way to converge or tag a resource `hearth deploy` did not make."""
    parser.add_argument(
        "--adopt",
        action="store_true",
        help="take over an existing endpoint/function that `hearth deploy` did not create "
        "(it gets our ownership tag, so `delete` can remove it later)",
    )


def model_args(parser: argparse.ArgumentParser, *, update: bool = False) -> None:
    """The model: image, role, model data and container environment (``deploy sagemaker``,
    ``deploy update`` and ``batch``)."""
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


_STATED_DEFAULT = re.compile(r"\bdefault [^,;)]+")


def _defaults_are_unchanged(actions: list[argparse.Action]) -> None:
    """`deploy update`'s help: a flag left out keeps what the endpoint runs now, so the
    defaults `deploy sagemaker` states ("default 900") read "default: unchanged" there."""
    for action in actions:
        if action.help and action.default is None:
            action.help = _STATED_DEFAULT.sub("default: unchanged", action.help)


def sagemaker_args(parser: argparse.ArgumentParser, *, update: bool) -> None:
    """Arguments of ``deploy sagemaker`` (full spec) and ``deploy update`` (overrides only:
    every default is None so that "not given" keeps what the endpoint runs now)."""

    def d(value: Any) -> Any:
        return None if update else value

    adopt_arg(parser)

    parser.add_argument("--name", required=True, help="endpoint name (also prefixes the rest)")
    model_args(parser, update=update)
    first = len(parser._actions)  # the endpoint's own flags from here

    where = parser.add_argument_group("instances")
    where.add_argument("--instance-type", default=d("ml.g5.xlarge"), help="default ml.g5.xlarge")
    where.add_argument("--instance-count", type=int, default=d(1), help="default 1")
    where.add_argument("--variant-name", default=d(DEFAULT_VARIANT), help="default AllTraffic")
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
    where.add_argument("--routing-strategy", choices=ROUTING_STRATEGIES, help="RoutingConfig")

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
        choices=METRIC_FREQUENCIES,
        default=d(60),
        metavar="SECONDS",
        help="publish period: 10, 30, 60, 120, 180, 240 or 300 (default 60)",
    )

    if not update:
        parser.add_argument_group(
            "LoRA adapters (adapter inference components on a base inference component)"
        ).add_argument(
            "--adapter",
            action="append",
            metavar="NAME=S3URI",
            help="serve a LoRA adapter as the inference component <name>-NAME (repeatable); "
            "the endpoint is then created for inference components",
        )
        queued = parser.add_argument_group(
            "asynchronous inference (requests queued by SageMaker, answers written to S3)"
        )
        queued.add_argument(
            "--async",
            dest="async_inference",
            action="store_true",
            help="an async endpoint (AsyncInferenceConfig; needs --output); the container's "
            "request timeout becomes an hour",
        )
        queued.add_argument("--output", metavar="S3URI", help="where answers are written")
        queued.add_argument("--failure-output", metavar="S3URI", help="where errors are written")
        queued.add_argument(
            "--max-concurrent-invocations",
            type=int,
            metavar="N",
            help="per instance, 1-1000 (default: SageMaker's)",
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
        _defaults_are_unchanged(parser._actions[first:])
    parser.add_argument(
        "--keep-old",
        action="store_true",
        help="keep superseded endpoint configs and models instead of deleting them",
    )
    wait_args(parser)
