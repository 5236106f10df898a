"""The one reader of hearth's settings: `hearth serve` flags and their `HEARTH_<FLAG>`
variables, turned into the engine's and the API workers' configs.

`hearth serve` (and so SageMaker's `serve`, which maps `SM_HEARTH_<FLAG>` onto the same
flags), and the Lambda entry all resolve their settings here, so one environment gives
the same `EngineConfig` and `ServerConfig` everywhere (docs/architecture.md,
"Configuration"). A new setting is one flag in `container/flags.py` plus its config
field and one line in `serve_configs`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from container.flags import add_serve_flags, finish_many
from engine.config import EngineConfig
from handlers.config import ServerConfig, digest_api_key, path_label

DEFAULT_SERVED_NAME = "smollm2"
"""What the embedded default model is called when no MODEL is given."""


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s [hearth] %(message)s",
        force=True,
    )


def parse_serve_args(
    argv: Sequence[str] = (), environ: Mapping[str, str] = os.environ
) -> argparse.Namespace:
    """`hearth serve`'s arguments from `argv` over the environment (for entries that have
    no command line of their own, such as Lambda)."""
    parser = argparse.ArgumentParser(prog="hearth serve", add_help=False)
    add_serve_flags(parser, environ)
    args = parser.parse_args(list(argv))
    finish_many(args)
    return args


def read_chat_template(value: str | None) -> str | None:
    """--chat-template is a file path or the template text itself."""
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


def serve_configs(
    args: argparse.Namespace, model_dir: str | None = None, runtime_dir: str | None = None
) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the API workers' configs from parsed `serve` arguments.

    `model_dir` is the resolved model directory when the caller resolved it (the CLI does,
    in the master); None leaves `args.model` for the engine to resolve (Lambda, whose
    import must not wait for a conversion). `runtime_dir` is the engine's socket
    directory the CLI made for this run (Lambda's in-process engine needs none).
    """
    try:
        engine = _engine_config(args, model_dir)
    except ValueError as exc:  # EngineConfig names the flag and what it accepts
        raise SystemExit(f"hearth: {exc}") from None
    served = args.served_model_name or (
        [DEFAULT_SERVED_NAME] if args.model is None else [args.model.rstrip("/")]
    )
    server = ServerConfig(
        model_dir=model_dir,
        served_model_names=tuple(served),
        # A name the user chose labels the metrics as given; the path --model defaults
        # it to (vLLM's default, what clients send as `model`) only by its last part.
        metrics_model_name="" if args.served_model_name else path_label(served[0]),
        api_key_digests=tuple(digest_api_key(k) for k in args.api_key),
        response_role=args.response_role,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template=read_chat_template(args.chat_template),
        trust_request_chat_template=args.trust_request_chat_template,
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods or ["*"]),
        allowed_headers=tuple(args.allowed_headers or ["*"]),
        allow_credentials=args.allow_credentials,
        enable_request_id_headers=args.enable_request_id_headers,
        sse_keep_alive_interval=args.sse_keep_alive_interval,
        request_timeout=args.request_timeout,
        enable_stateful_sessions=args.enable_stateful_sessions,
        session_ttl=args.session_ttl,
        generation_config=args.generation_config,
        enable_server_load_tracking=args.enable_server_load_tracking,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        server_dev_mode=args.server_dev_mode,
        enable_profiler_routes=args.profiler_config is not None
        and args.profiler_config.profiler is not None,
        enable_lora=args.enable_lora,
        enable_runtime_lora_updating=args.enable_runtime_lora_updating,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        root_path=args.root_path,
        max_log_len=args.max_log_len,
        disable_log_requests=args.disable_log_requests,
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
        max_stop_strings=args.max_stop_strings,
        max_request_body_bytes=args.max_request_body_bytes,
        engine_heartbeat_timeout=args.engine_heartbeat_timeout,
        responses_store_max_entries=args.responses_store_max_entries,
        responses_store_max_bytes=args.responses_store_max_bytes,
        responses_store_ttl=args.responses_store_ttl,
        runtime_dir=runtime_dir,
    )
    return engine, server


def prepare_model(environ: Mapping[str, str] = os.environ) -> str:
    """Resolve the model `hearth serve` would serve in this environment (a GGUF is
    converted once into --cache-dir): the image build and `make setup` run this, so the
    first start loads plain safetensors from the very cache the server will look in."""
    from engine.model_resolver import resolve_model_dir

    args = parse_serve_args((), environ)
    return resolve_model_dir(args.model, args.cache_dir)


def configs_from_env(
    environ: Mapping[str, str] = os.environ,
) -> tuple[EngineConfig, ServerConfig]:
    """What `hearth serve` would run with in this environment, model left unresolved."""
    return serve_configs(parse_serve_args((), environ))


def _engine_config(args: argparse.Namespace, model_dir: str | None) -> EngineConfig:
    return EngineConfig(
        model=model_dir or args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kernels=args.kernels,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_chunk=args.max_prefill_chunk,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        scheduling_policy=args.scheduling_policy,
        num_threads=args.num_threads,
        disable_log_stats=args.disable_log_stats,
        log_level=args.log_level,
        cpu_isa=args.cpu_isa,
        cache_dir=args.cache_dir,
        kernel_cache_dir=args.kernel_cache_dir,
        enable_lora=args.enable_lora,
        lora_modules=lora_modules(args, model_dir),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        profiler=args.profiler_config,
        test_fault_file=args.test_fault_file,
        test_step_delay=args.test_step_delay,
    )


ADAPTERS_FOLDER = "adapters"
"""A model directory's subfolder of PEFT adapters, one per directory, registered under
the directory's name with --enable-lora (how SageMaker model artifacts carry them)."""


def parse_lora_module(item: str) -> tuple[str, str]:
    """``NAME=PATH`` or vLLM's JSON form ``{"name": ..., "path": ...}``."""
    text = item.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
            name, path = spec["name"], spec["path"]
        except (ValueError, KeyError, TypeError):
            raise SystemExit(
                f'hearth: --lora-modules {item!r}: JSON must be {{"name": ..., "path": ...}}'
            ) from None
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise SystemExit(f"hearth: --lora-modules {item!r} is not NAME=PATH")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise SystemExit(f"hearth: --lora-modules {item!r} needs a name and a path")
    return name.strip(), path.strip()


def lora_modules(args: argparse.Namespace, model_dir: str | None) -> tuple[tuple[str, str], ...]:
    """--lora-modules, then the model directory's adapters/ folder (names given on the
    command line win)."""
    if not args.enable_lora:
        return tuple(parse_lora_module(item) for item in args.lora_modules)  # refused later
    modules = [parse_lora_module(item) for item in args.lora_modules]  # twice: refused
    names = {name for name, _ in modules}
    for root in dict.fromkeys(p for p in (args.model, model_dir) if p):
        folder = Path(root) / ADAPTERS_FOLDER
        if not folder.is_dir():
            continue
        for sub in sorted(folder.iterdir()):
            if (sub / "adapter_config.json").is_file() and sub.name not in names:
                modules.append((sub.name, str(sub)))
                names.add(sub.name)
    return tuple(modules)
