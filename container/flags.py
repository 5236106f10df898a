"""`hearth serve` flags: vLLM's names where the concept is the same, each also read
from `HEARTH_<FLAG>` in the environment (the way containers are configured).

Defaults that a config also states are taken from the config (`_SERVER_DEFAULTS`,
`_ENGINE_DEFAULTS`) for the flags added with issue 15, so each is written once.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import Any

from engine.config import (
    CPU_ISAS,
    DTYPES,
    KERNELS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from engine.profiler_config import parse_profiler_config
from handlers.config import ServerConfig

_SERVER_DEFAULTS = ServerConfig()
_ENGINE_DEFAULTS = EngineConfig()

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off", ""}


WORKER_NICENESS = 7
"""Default of --worker-niceness. On 2 vCPUs, a client sending 6 MB bodies back to back kept
one worker's core busy and other clients' chat p50 went from 66 to 238 ms (3.6x); with the
workers at nice 5 it was 1.26x, the engine having the CPU it needed. Under issue 17's whole
hostile mix on the AMX host: 1.39-1.75x at nice 5, 1.23-1.31x at 7, 1.17-1.22x at 10, where
a /ping on a worker busy with a body took up to 414 ms (at 7: 133 ms at most); ordinary load
(c=1/16/64) is the same at 5 and 10 within run-to-run noise (docs/reliability.md)."""


def env_name(flag: str) -> str:
    return "HEARTH_" + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str, flag: str) -> bool:
    value = text.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise SystemExit(f"hearth: {env_name(flag)}={text!r} is not a boolean (use true or false)")


_SIZE_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """Sizes like 4GiB, 512MiB, 2G, 1.5g or a plain byte count (binary units)."""
    s = text.strip().lower().removesuffix("ib").removesuffix("b").strip()
    try:
        if s and s[-1] in _SIZE_UNITS:
            value = int(float(s[:-1]) * _SIZE_UNITS[s[-1]])
        else:
            value = int(s)
    except ValueError:
        value = -1
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (use e.g. 4GiB, 512MiB or a byte count)"
        )
    return value


class Bounded:
    """An int or float flag type with bounds: `Bounded(int, at_least=1)`,
    `Bounded(float, above=0.0)`, `Bounded(int, at_least=0, at_most=19)`. A value out of
    range is an ArgumentTypeError, which argparse reports against the flag and
    `_convert` against the variable."""

    def __init__(
        self,
        kind: type,
        *,
        at_least: float | None = None,
        above: float | None = None,
        at_most: float | None = None,
    ) -> None:
        self.kind = kind
        self.__name__ = kind.__name__  # argparse's "invalid int value: 'x'"
        self.at_least = at_least
        self.above = above
        self.at_most = at_most

    def __call__(self, text: str) -> Any:
        value = self.kind(text)
        if self.at_least is not None and value < self.at_least:
            raise argparse.ArgumentTypeError(f"{text!r} is below the minimum {self.at_least}")
        if self.above is not None and not value > self.above:
            raise argparse.ArgumentTypeError(f"{text!r} must be greater than {self.above}")
        if self.at_most is not None and value > self.at_most:
            raise argparse.ArgumentTypeError(f"{text!r} is above the maximum {self.at_most}")
        return value


_TYPE_NAMES = {int: "an integer", float: "a number"}


def _convert(type: Callable[[str], Any], raw: str, flag: str, choices: Any = None) -> Any:
    """An environment value through the flag's type and choices, as argparse would."""
    try:
        value = type(raw)
    except argparse.ArgumentTypeError as exc:
        raise SystemExit(f"hearth: {env_name(flag)}: {exc}") from None
    except ValueError:
        kind = _TYPE_NAMES.get(getattr(type, "kind", type), "a valid value")
        raise SystemExit(f"hearth: {env_name(flag)}={raw!r} is not {kind}") from None
    if choices is not None and value not in choices:
        allowed = ", ".join(map(str, choices))
        raise SystemExit(f"hearth: {env_name(flag)}={raw!r} is not one of: {allowed}")
    return value


SECRET_LIST_FLAGS = frozenset({"--api-key"})
"""List flags whose variable holds secrets: split on newlines only (a key may hold a
comma: `abc,def` was two weaker keys), and set-but-empty is an error, not "no key" (a
failed `$(aws secretsmanager ...)` silently turned auth off)."""


def env_list(flag: str, raw: str | None, name: str) -> list[str]:
    """The items of a list flag's variable (`name`: the variable, for the message)."""
    if raw is None:
        return []
    if flag not in SECRET_LIST_FLAGS:
        return [v for v in raw.split(",") if v]
    items = [v.strip() for v in raw.splitlines() if v.strip()]
    if not items:
        raise SystemExit(
            f"hearth: {name} is set but empty; refusing to start without the key it was "
            "meant to hold (unset it to serve without a key)"
        )
    return items


class FlagAdder:
    """Adds flags whose defaults come from HEARTH_<FLAG> in `environ` when set."""

    def __init__(
        self,
        parser: argparse.ArgumentParser | argparse._ArgumentGroup,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        self.parser = parser
        self.environ = environ

    def value(
        self,
        flag: str,
        type: Callable[[str], Any],
        default: Any,
        help: str,
        hidden: bool = False,
        **kwargs: Any,
    ) -> None:
        """`hidden`: a test hook, left out of --help but read like any other flag."""
        raw = self.environ.get(env_name(flag))
        if raw is not None:
            default = _convert(type, raw, flag, kwargs.get("choices"))
        self.parser.add_argument(
            flag,
            type=type,
            default=default,
            help=argparse.SUPPRESS if hidden else f"{help} [env {env_name(flag)}]",
            **kwargs,
        )

    def switch(self, flag: str, default: bool, help: str, alias_env: str | None = None) -> None:
        """An on/off flag; its default from HEARTH_<FLAG>, else from `alias_env` (another
        server's variable of the same meaning) when set."""
        raw = self.environ.get(env_name(flag))
        if raw is None and alias_env is not None:
            raw = self.environ.get(alias_env)
        if raw is not None:
            default = parse_bool(raw, flag)
        self.parser.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=default,
            help=f"{help} [env {env_name(flag)}]",
        )

    def many(self, flag: str, help: str, repeat_only: bool = False, **kwargs: Any) -> None:
        """A list flag: `--flag a b` (vLLM style), or with repeat_only `--flag a --flag b`,
        for flags that come before the positional MODEL and must not swallow it."""
        raw = self.environ.get(env_name(flag))
        default = env_list(flag, raw, env_name(flag))
        separated = "one per line" if flag in SECRET_LIST_FLAGS else "comma-separated"
        self.parser.add_argument(
            flag,
            nargs=None if repeat_only else "+",
            action="append" if repeat_only else "extend",
            default=None,
            help=f"{help} [env {env_name(flag)}, {separated}]",
            **kwargs,
        )
        self.parser.set_defaults(**{"_default_" + flag.lstrip("-").replace("-", "_"): default})


def finish_many(args: argparse.Namespace) -> None:
    """Flags given on the command line replace the environment's list, not extend it."""
    for key in list(vars(args)):
        if key.startswith("_default_"):
            name = key.removeprefix("_default_")
            if getattr(args, name) is None:
                setattr(args, name, getattr(args, key))
            delattr(args, key)


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """HEARTH_LOG_LEVEL before any command line is parsed (the logging of every
    subcommand is set up first); `hearth serve --log-level` then takes over."""
    raw = environ.get(env_name("--log-level"))
    if raw is None:
        return "info"
    return _convert(str.lower, raw, "--log-level", LOG_LEVELS)


SERVE_USAGE = "hearth serve [MODEL] [flags]   (hearth serve --help lists every flag)"


def add_serve_flags(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] = os.environ
) -> None:
    """Every `hearth serve` flag, defaults read from `environ` (docs/architecture.md,
    "Configuration"); `container/settings.py` turns the parsed flags into configs."""
    # A short usage line: argparse prints it above every error, and the full one is
    # ~40 lines that would bury the one line that matters.
    parser.usage = SERVE_USAGE
    parser.add_argument(
        "model",
        nargs="?",
        default=environ.get("HEARTH_MODEL"),
        help="Hugging Face model directory or .gguf file; default: the embedded "
        "SmolLM2-135M-Instruct [env HEARTH_MODEL]",
    )
    net = FlagAdder(parser.add_argument_group("server"), environ)
    net.value("--host", str, "127.0.0.1", "Address to bind")
    net.value("--port", int, 8000, "Port to bind")
    net.value("--uds", str, None, "Serve on this Unix domain socket instead of host:port")
    net.value("--workers", int, 1, "API worker processes (they share one engine)")
    net.value(
        "--worker-niceness",
        Bounded(int, at_least=0, at_most=19),
        WORKER_NICENESS,
        "How much lower the API workers' CPU priority is than the engine's (nice "
        "increment, 0-19; 0: the same): a worker parsing one client's 6 MB bodies then "
        "never takes a core from the step that serves every request",
    )
    net.many(
        "--api-key",
        "Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but "
        "/ping, /health and /version, /metrics included (repeat the flag for several keys)",
        repeat_only=True,
    )
    net.value("--root-path", str, "", "Path prefix set by a proxy in front of the server")
    net.value("--ssl-keyfile", str, None, "TLS private key file")
    net.value("--ssl-certfile", str, None, "TLS certificate file")
    net.many("--allowed-origins", "CORS origins (none by default)")
    net.many("--allowed-methods", "CORS methods (default all, when origins are set)")
    net.many("--allowed-headers", "CORS headers (default all, when origins are set)")
    net.switch("--allow-credentials", False, "CORS: allow credentials")
    net.value("--log-level", str.lower, "info", "Log level", choices=LOG_LEVELS)
    net.value(
        "--timeout-graceful-shutdown",
        float,
        20.0,
        "Seconds gunicorn waits after SIGTERM before it kills the workers (whole seconds; "
        "SageMaker kills at 30): in-flight requests get this less ~3.5 s, then streams still "
        "open end with an error event",
    )

    api = FlagAdder(parser.add_argument_group("OpenAI API"), environ)
    api.many("--served-model-name", "Names clients use in 'model' (the first is reported)")
    api.value("--chat-template", str, None, "Chat template: a file path or the template text")
    api.switch(
        "--trust-request-chat-template",
        False,
        "Accept 'chat_template' in request bodies (arbitrary Jinja from clients)",
    )
    api.value("--response-role", str, "assistant", "Role of generated chat messages")
    api.value(
        "--tool-call-parser",
        str,
        None,
        "Tool-call format (default: detected from the chat template)",
        choices=["hermes", "llama3_json", "mistral"],
    )
    api.value(
        "--reasoning-parser",
        str,
        None,
        "Move <think>...</think> (think) or gpt-oss's analysis channel (harmony) into "
        "reasoning_content (default: harmony for gpt-oss, think when the template has <think>)",
        choices=["think", "harmony", "none"],
    )
    api.switch(
        "--enable-request-id-headers",
        False,
        "Echo X-Request-Id in responses (a generated one when the request has none)",
    )
    api.value(
        "--sse-keep-alive-interval",
        float,
        None,
        "Seconds between SSE keep-alive comments while a stream waits, for proxies that "
        "close quiet connections (default: none; some clients cannot parse comments)",
    )
    api.value(
        "--request-timeout",
        float,
        None,
        "Seconds after which a request still generating ends with a 504 error and is "
        "aborted (default: no limit; the SageMaker `serve` entry sets 60 on real-time "
        "endpoints, 3600 on asynchronous ones and in batch transform)",
    )
    api.switch(
        "--enable-stateful-sessions",
        _SERVER_DEFAULTS.enable_stateful_sessions,
        "SageMaker stateful sessions on /invocations (NEW_SESSION / CLOSE; a session's "
        "prefix KV blocks are kept warm until it closes or expires)",
    )
    api.value(
        "--session-ttl",
        Bounded(float, above=0.0),
        _SERVER_DEFAULTS.session_ttl,
        "Seconds from NEW_SESSION until a stateful session expires",
    )
    api.value(
        "--generation-config",
        str,
        _SERVER_DEFAULTS.generation_config,
        "Default sampling parameters: auto (the model's generation_config.json sets "
        "temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens where a "
        "request leaves them out, as vLLM does) or vllm (OpenAI's defaults only)",
        choices=("auto", "vllm"),
    )
    api.switch("--enable-server-load-tracking", False, "Expose GET /load")
    api.switch(
        "--enable-tokenizer-info-endpoint",
        False,
        "Expose GET /tokenizer_info (the tokenizer's configuration and chat template)",
    )
    api.switch(
        "--server-dev-mode",
        False,
        "Expose vLLM's developer routes (POST /reset_prefix_cache, /reset_mm_cache, "
        "/reset_encoder_cache, GET /server_info); for benchmarking and debugging, not "
        "production: any caller with the API key can flush the prefix cache",
    )
    api.switch(
        "--enable-prompt-tokens-details", False, "Report usage.prompt_tokens_details.cached_tokens"
    )
    api.value(
        "--max-log-len", int, None, "Characters of each prompt shown in debug logs (default: all)"
    )
    api.switch("--disable-log-requests", False, "No per-request log line")
    api.value(
        "--max-logprobs",
        Bounded(int, at_least=0),
        _SERVER_DEFAULTS.max_logprobs,
        "Largest top_logprobs / logprobs / prompt_logprobs a request may ask for",
    )
    api.value("--max-n", Bounded(int, at_least=1), _SERVER_DEFAULTS.max_n, "Largest n (choices)")
    api.value(
        "--max-stop-strings",
        Bounded(int, at_least=1),
        _SERVER_DEFAULTS.max_stop_strings,
        "Most stop strings one request may send",
    )
    api.value(
        "--max-request-body-bytes",
        parse_bytes,
        _SERVER_DEFAULTS.max_request_body_bytes,
        "Largest request body, e.g. 6MiB (a bigger one is a 413; SageMaker real-time's own "
        "limit is 6 MiB; in batch transform `serve` sets it from MaxPayloadInMB)",
    )
    api.value(
        "--responses-store-max-entries",
        Bounded(int, at_least=0),
        _SERVER_DEFAULTS.responses_store_max_entries,
        "Stored responses (/v1/responses with store: true) kept at most, shared by all API "
        "workers; the oldest go first; 0 stores nothing",
    )
    api.value(
        "--responses-store-max-bytes",
        parse_bytes,
        _SERVER_DEFAULTS.responses_store_max_bytes,
        "Bytes of stored responses and their conversations kept at most, e.g. 256MiB",
    )
    api.value(
        "--responses-store-ttl",
        Bounded(float, above=0.0),
        _SERVER_DEFAULTS.responses_store_ttl,
        "Seconds a stored response is kept",
    )
    api.value(
        "--engine-heartbeat-timeout",
        Bounded(float, above=0.0),
        _SERVER_DEFAULTS.engine_heartbeat_timeout,
        "Seconds without an engine heartbeat after which /ping and /health answer 503, "
        "waiting and running requests end with a 503 and new ones are refused (a long step "
        "keeps the heartbeat fresh)",
    )

    eng = FlagAdder(parser.add_argument_group("engine"), environ)
    eng.value("--device", str, "auto", "auto, cpu or cuda[:N]")
    eng.value(
        "--dtype",
        str,
        "auto",
        "auto (fp32 on CPU; bf16 on GPU, fp16 where the GPU lacks bf16), float32, bfloat16, "
        "float16",
        choices=DTYPES,
    )
    eng.value(
        "--quantization",
        str,
        "auto",
        "Weights: gguf (a GGUF's own Q4_1/Q8_0 blocks with float32 activations; CPU; no "
        "result depends on batch size), gguf-bf16 (the same blocks for steps under 16 tokens "
        "on AMX, under 6 on AVX512-BF16, bfloat16 tiles with float32 sums from there up; "
        "needs AMX-BF16 or AVX512-BF16), gguf-int8 (the "
        "blocks times int8 activations: faster, below the quality bar), none (dense weights "
        "of --dtype), q8_0 (a model without a GGUF quantized to Q8_0 at load, as gguf: "
        "faster, below the quality bar); auto = gguf-bf16 where AMX-BF16 or AVX512-BF16 "
        "runs, gguf on other CPUs, none on a GPU; any --dtype other than auto asks for the "
        "exact mode (none). A model "
        "without a GGUF (safetensors) runs the gguf modes from its own weights in 16 bits "
        "(bfloat16 or float16 where they hold every value, else rounded to float16)",
        choices=QUANTIZATIONS,
    )
    eng.value(
        "--kernels",
        str.lower,
        "auto",
        "Kernel backend: auto (Triton on GPU, torch reference on CPU), torch or triton",
        choices=KERNELS,
    )
    eng.value(
        "--max-model-len", int, None, "Context length (prompt + output); default: the model's"
    )
    eng.value("--max-num-seqs", int, 256, "Sequences in the running batch at most")
    eng.value(
        "--max-num-batched-tokens",
        int,
        None,
        "Token budget of one step, shared by decodes and prefill chunks "
        "(default: 256 on CPU, for low time to first token; 2048 on GPU). Given "
        "without --max-prefill-chunk, no step runs past it",
    )
    eng.value(
        "--max-prefill-chunk",
        int,
        None,
        "Most prompt tokens the first prefill chunk of a step may take, past the token "
        "budget, so a long prompt needs fewer steps (default, with the default budget: 2048 "
        "where AMX tiles run the linears, 512 on other CPUs; else the budget). "
        "Running decodes wait up to one such step",
    )
    eng.value("--block-size", int, 16, "Tokens per KV cache block")
    eng.switch("--enable-prefix-caching", True, "Reuse KV blocks of shared prompt prefixes")
    eng.value(
        "--kv-cache-memory",
        parse_bytes,
        None,
        "Bytes of KV cache on CPU, e.g. 8GiB (default: up to 4 GiB, committed as it fills, "
        "and no more than the host or container has left after the weights, less a reserve)",
    )
    eng.value(
        "--kv-cache-dtype",
        str,
        "auto",
        "KV cache element type: auto (float16-int8 where --quantization auto picks the GGUF "
        "mode, and under gguf-bf16; else the model dtype), "
        "float32, float16 (the CPU fast path only: half the bytes per attention read, "
        "prompt logprobs within ~1e-3 of fp32), float16-int8 (the CPU fast path only: "
        "float16 keys, int8 values with per-row scales, 0.77x float16's bytes), or int8 "
        "(keys too: 1.88x float16's tokens in the same memory; below the top-1 quality bar, "
        "so never a default)",
        choices=KV_CACHE_DTYPES,
    )
    eng.value("--gpu-memory-utilization", float, 0.9, "Fraction of GPU memory hearth may use")
    eng.switch(
        "--enforce-eager",
        False,
        "Run every step op by op: no CUDA graphs for decode steps on GPU, no captured step program on the CPU fast path",
    )
    eng.value("--seed", int, 0, "Engine random seed")
    eng.value("--max-num-queued-reqs", int, None, "Refuse (503) when this many requests wait")
    eng.value(
        "--max-num-queued-tokens",
        int,
        None,
        "Refuse (503) when waiting prompts hold this many tokens",
    )
    eng.value(
        "--scheduling-policy",
        str,
        "fcfs",
        "fcfs (by API request: a request of many inputs takes turns with later ones) or priority (lower value runs first)",
        choices=SCHEDULING_POLICIES,
    )
    eng.value(
        "--profiler-config",
        parse_profiler_config,
        None,
        "The torch profiler behind POST /start_profile and /stop_profile, as JSON: "
        '\'{"profiler": "torch", "torch_profiler_dir": "/abs/dir"}\' (vLLM\'s fields; traces '
        "and an op table are written there); unset: no profiler routes",
    )
    eng.value("--num-threads", int, None, "torch threads of the engine (CPU; default all cores)")
    eng.value(
        "--cpu-isa",
        str.lower,
        _ENGINE_DEFAULTS.cpu_isa,
        "CPU kernels' instruction set: auto (the best this host has) or one to force",
        choices=CPU_ISAS,
    )
    eng.switch("--disable-log-stats", False, "No periodic engine statistics line")
    lora = FlagAdder(parser.add_argument_group("LoRA adapters"), environ)
    lora.switch(
        "--enable-lora",
        False,
        "Serve LoRA adapters: a request's 'model' (or SageMaker's adapter header) picks "
        "one; the model's adapters/ folder is registered",
    )
    lora.switch(
        "--enable-runtime-lora-updating",
        False,
        "With --enable-lora, the routes that load and unload adapters while serving "
        "(vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, SageMaker's /adapters, "
        "which adapter inference components need); vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true "
        "works too",
        alias_env="VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    )
    lora.many(
        "--lora-modules",
        "Adapters to register at start: NAME=PATH (a PEFT directory or an s3:// URL) or "
        'JSON {"name": ..., "path": ...}',
    )
    lora.value(
        "--max-loras",
        Bounded(int, at_least=1),
        _ENGINE_DEFAULTS.max_loras,
        "Adapters resident at once (one step mixes at most this many); others load on demand",
    )
    lora.value(
        "--max-lora-rank",
        Bounded(int, at_least=1),
        _ENGINE_DEFAULTS.max_lora_rank,
        "Largest adapter rank accepted; sizes the stacked adapter buffers",
    )
    eng.value(
        "--cache-dir",
        str,
        None,
        "Where converted GGUF models are cached (default ~/.cache/hearth/models, or "
        "$TMPDIR/hearth-models-<uid> when the home directory is read-only)",
    )
    eng.value(
        "--kernel-cache-dir",
        str,
        None,
        "Where the compiled CPU kernels are cached (default $XDG_CACHE_HOME/hearth/kernels, "
        "else ~/.cache/hearth/kernels; must be owned by this user or root and writable by "
        "neither group nor others)",
    )
    eng.value(
        "--test-fault-file",
        str,
        None,
        "Test hook: the engine step that finds this file deletes it and fails",
        hidden=True,
    )
    eng.value(
        "--test-step-delay",
        Bounded(float, above=0.0),
        None,
        "Test hook: seconds every engine step sleeps first",
        hidden=True,
    )
