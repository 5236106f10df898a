"""`hearth`: serve a model, benchmark a server, deploy to AWS.

`hearth serve [MODEL]` resolves the model (converting a GGUF once, cached), hands the
engine and API settings to the processes through the environment, and runs gunicorn
with uvicorn workers around one engine core process.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import shutil
import sys
import tempfile

from container.flags import add_serve_flags, finish_many, log_level_from_env
from container.help_format import HelpFormatter
from container.settings import configure_logging

logger = logging.getLogger("hearth")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hearth",
        description="LLM inference server: OpenAI API, SageMaker and Lambda over one warm engine.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    serve = sub.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI /v1, SageMaker /invocations)",
        description="Serve a model. Every flag can also be set as HEARTH_<FLAG> in the environment.",
        formatter_class=HelpFormatter,
    )
    add_serve_flags(serve)
    serve.set_defaults(func=run_serve)

    from container.bench.cli import add_bench_command

    add_bench_command(sub)
    try:
        from infra.cli import add_commands
    except ImportError:  # infra is optional at run time (boto3 missing)
        pass
    else:
        add_commands(sub)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    from container.gunicorn_app import EngineSupervisor, HearthApplication
    from container.settings import serve_configs
    from engine.model_resolver import ModelNotFoundError, resolve_model_dir

    try:
        model_dir = resolve_model_dir(
            args.model, args.cache_dir, progress=lambda m: logger.info("%s", m)
        )
    except ModelNotFoundError as exc:
        print(f"hearth: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    runtime_dir = tempfile.mkdtemp(prefix="hearth-")
    engine_config, server_config = serve_configs(args, model_dir, runtime_dir)

    metrics_dir = tempfile.mkdtemp(prefix="hearth-metrics-")
    # Set before any process imports prometheus_client (workers inherit it).
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    os.environ.update(server_config.to_env())
    engine_env = dict(os.environ)
    engine_env.update(engine_config.to_env())

    bind = f"unix:{args.uds}" if args.uds else f"{_host(args.host)}:{args.port}"
    warning = open_bind_warning(args.host, args.uds, bool(server_config.api_key_digests))
    if warning:
        logger.warning("%s", warning)
    options = {
        "bind": [bind],
        "workers": args.workers,
        "worker_class": "container.worker.HearthUvicornWorker",
        "graceful_timeout": max(int(args.timeout_graceful_shutdown), 1),
        "timeout": 120,
        "keepalive": 5,
        "control_socket_disable": True,
        "loglevel": args.log_level,
        "proc_name": "hearth",
        # gunicorn binds a --uds socket under this umask (its default, 0, made it 0777:
        # every local user could reach the API); 0660: the server's user and group.
        "umask": UDS_UMASK,
    }
    if args.ssl_keyfile or args.ssl_certfile:
        options.update(keyfile=args.ssl_keyfile, certfile=args.ssl_certfile)
    supervisor = EngineSupervisor(engine_env, runtime_dir)
    logger.info(
        "serving %s as %s on %s", model_dir, ", ".join(server_config.served_model_names), bind
    )
    code = 0
    try:
        HearthApplication(options, supervisor, args.worker_niceness).run()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        supervisor.stop()
        shutil.rmtree(runtime_dir, ignore_errors=True)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if supervisor.died:
        print(
            "hearth: the engine core died; exiting non-zero so the platform restarts us",
            file=sys.stderr,
        )
        return 3
    return code


UDS_UMASK = 0o117
"""A `--uds` socket is created 0660."""


def open_bind_warning(host: str, uds: str | None, has_key: bool) -> str | None:
    """The warning for a server anyone on the network can use: a non-loopback address
    and no API key (SageMaker binds 0.0.0.0 behind its own auth: a warning, not an error)."""
    if uds or has_key or _is_loopback(host):
        return None
    return (
        f"serving on {host} with no API key: anyone who can reach this address can use "
        "the model (set --api-key or HEARTH_API_KEY unless a proxy in front authenticates)"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def main(argv: list[str] | None = None) -> int:
    configure_logging(log_level_from_env())
    for noisy in ("httpx", "httpcore"):  # one line per request of `hearth bench`
        logging.getLogger(noisy).setLevel(logging.WARNING)
    parser = build_parser()
    args = parser.parse_args(argv)
    finish_many(args)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
