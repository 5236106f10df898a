"""`hearth`: serve a model, benchmark a server, deploy to AWS.

`hearth serve [MODEL]` resolves the model (converting a GGUF once, cached), hands the
engine and API settings to the processes through the environment, and runs gunicorn
with uvicorn workers around one engine core process.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from container.flags import add_serve_flags, finish_many

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
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_serve_flags(serve)
    serve.set_defaults(func=run_serve)

    from container.bench_cli import add_bench_command

    add_bench_command(sub)
    try:
        from infra.cli import add_commands
    except ImportError:  # infra is optional at run time (boto3 missing)
        pass
    else:
        add_commands(sub)
    return parser


def _read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    if len(value) < 4096 and path.is_file():
        return path.read_text()
    if "{" not in value:
        raise SystemExit(
            f"hearth: --chat-template {value!r} is neither a file nor a Jinja template"
        )
    return value


def build_configs(args: argparse.Namespace, model_dir: str):  # -> (EngineConfig, ServerConfig)
    from engine.config import EngineConfig
    from handlers.config import ServerConfig, digest_api_key

    engine = EngineConfig(
        model=model_dir,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        scheduling_policy=args.scheduling_policy,
        num_threads=args.num_threads,
        disable_log_stats=args.disable_log_stats,
    )
    served = args.served_model_name or (["smollm2"] if args.model is None else [])
    server = ServerConfig(
        model_dir=model_dir,
        served_model_names=tuple(served) or (args.model.rstrip("/"),),
        api_key_digests=tuple(digest_api_key(k) for k in args.api_key),
        response_role=args.response_role,
        chat_template=_read_chat_template(args.chat_template),
        trust_request_chat_template=args.trust_request_chat_template,
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods or ["*"]),
        allowed_headers=tuple(args.allowed_headers or ["*"]),
        allow_credentials=args.allow_credentials,
        enable_request_id_headers=args.enable_request_id_headers,
        sse_keep_alive_interval=args.sse_keep_alive_interval,
        request_timeout=args.request_timeout,
        enable_server_load_tracking=args.enable_server_load_tracking,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        root_path=args.root_path,
        max_log_len=args.max_log_len,
    )
    return engine, server


def run_serve(args: argparse.Namespace) -> int:
    from container.gunicorn_app import EngineSupervisor, HearthApplication
    from engine.ipc import ENV_ENGINE_CONFIG, ENV_RUNTIME_DIR
    from engine.model_loader import ModelNotFoundError, resolve_model_dir
    from engine.process import config_to_env

    if not args.api_key and os.environ.get("HEARTH_API_KEY"):
        args.api_key = [os.environ["HEARTH_API_KEY"]]
    try:
        model_dir = resolve_model_dir(args.model, progress=lambda m: logger.info("%s", m))
    except ModelNotFoundError as exc:
        print(f"hearth: {exc}", file=sys.stderr)
        return 2
    engine_config, server_config = build_configs(args, model_dir)

    runtime_dir = tempfile.mkdtemp(prefix="hearth-")
    metrics_dir = tempfile.mkdtemp(prefix="hearth-metrics-")
    # Set before any process imports prometheus_client (workers inherit it).
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    os.environ[ENV_RUNTIME_DIR] = runtime_dir
    os.environ.update(server_config.to_env())
    engine_env = dict(os.environ)
    engine_env[ENV_ENGINE_CONFIG] = config_to_env(engine_config)

    bind = f"unix:{args.uds}" if args.uds else f"{_host(args.host)}:{args.port}"
    options = {
        "bind": [bind],
        "workers": args.workers,
        "worker_class": "container.worker.HearthUvicornWorker",
        "graceful_timeout": max(int(args.timeout_graceful_shutdown), 1),
        "timeout": 120,
        "keepalive": 5,
        "control_socket_disable": True,
        "loglevel": os.environ.get("HEARTH_LOG_LEVEL", "info").lower(),
        "proc_name": "hearth",
    }
    if args.ssl_keyfile or args.ssl_certfile:
        options.update(keyfile=args.ssl_keyfile, certfile=args.ssl_certfile)
    supervisor = EngineSupervisor(engine_env)
    logger.info(
        "serving %s as %s on %s", model_dir, ", ".join(server_config.served_model_names), bind
    )
    code = 0
    try:
        HearthApplication(options, supervisor).run()
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


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("HEARTH_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s [hearth] %(message)s",
    )
    for noisy in ("httpx", "httpcore"):  # one line per request of `hearth bench`
        logging.getLogger(noisy).setLevel(logging.WARNING)
    parser = build_parser()
    args = parser.parse_args(argv)
    finish_many(args)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
