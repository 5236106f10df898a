"""Engine configuration: one frozen dataclass built by the CLI and passed to the core.

It validates itself on construction (each error names the flag and what it accepts), so
a bad setting fails where it is made. What depends on the host and the model (device,
dtype, context length) is resolved once by `engine.resolved_config.resolve`; the KV
block count by the core once the weights are loaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from engine.pooling_config import PoolingConfig
from engine.profiler_config import ProfilerConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "gguf", "gguf-bf16", "gguf-int8", "q8_0", "none")
KERNELS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "float16-int8", "int8")
SCHEDULING_POLICIES = ("fcfs", "priority")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{flag} must be one of {', '.join(allowed)}, not {value!r}")


def _at_least(flag: str, value: float | None, low: float) -> None:
    if value is not None and value < low:
        raise ValueError(f"{flag} must be at least {low:g}, not {value!r}")


ENV_VAR = "HEARTH_ENGINE_CONFIG"
"""The transport of the whole EngineConfig from the CLI to the engine core process
(docs/architecture.md, "Configuration"): one JSON variable written by `to_env`, not a
setting of its own. The settings themselves are read by container/settings.py."""

DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
"""How stale the engine's heartbeat may be before workers call it hung (--engine-
heartbeat-timeout; see engine/ipc.py Heartbeat: a long step keeps it fresh, so this does
not depend on step length)."""

CPU_ISAS = ("auto", "avx2", "avx512", "avx512_vnni", "amx")
"""What `--cpu-isa` may name: auto picks the best the host has."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None
    """Local HF directory or .gguf file; None serves the embedded default (SmolLM2)."""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16; auto keeps the checkpoint's (fp32 on CPU)."""
    quantization: str = "auto"
    """auto | gguf | gguf-bf16 | gguf-int8 | none: see `engine.backends`."""
    device: str = "auto"
    """auto | cpu | cuda[:N]."""
    kernels: str = "auto"
    """auto | torch | triton: the kernel backend, handed to `kernels.select_backend` once
    at start-up (auto: Triton for CUDA tensors, the torch reference otherwise)."""
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    """Token budget of one engine step, shared by decodes and prefill chunks; None picks
    by device (`default_token_budget`)."""
    max_prefill_chunk: int | None = None
    """Most prompt tokens the first prefill chunk of a step may take, past the budget
    (engine/scheduler.py); None: the budget when `max_num_batched_tokens` is given (a hard
    cap, as in vLLM), else by device and kernels (`default_prefill_chunk`)."""
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None
    """Bytes of KV cache on CPU (default: 4 GiB or what max_num_seqs * max_model_len needs, the smaller; RAM is committed as blocks fill)."""
    kv_cache_dtype: str = "auto"
    """auto | float32 | float16 | float16-int8 | int8 (--kv-cache-dtype): auto is the model
    dtype (float16-int8 under gguf-bf16); float16 (the CPU fast path only) halves the bytes
    its C attention reads; int8 (the CPU fast path only) stores each (token, kv head) row as
    int8 with a float32 scale: 1.88x float16's tokens per byte, opt-in (it misses the top-1
    bar); float16-int8: float16 keys, int8 values (0.77x float16's bytes; passes the bar)."""
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    """GPU: no CUDA graphs; every step runs eagerly (see engine/cuda_graphs.py)."""
    num_kv_blocks: int | None = None
    """Test/diagnostic override of the block count."""
    seed: int = 0
    max_num_queued_reqs: int | None = None
    """Admission refuses a request when this many are already waiting (503)."""
    max_num_queued_tokens: int | None = None
    scheduling_policy: str = "fcfs"
    """fcfs | priority."""
    num_threads: int | None = None
    """torch intra-op threads of the engine process (default: all cores)."""
    disable_log_stats: bool = False
    log_level: str = "info"
    """Python logging level of the engine core process (--log-level)."""
    cpu_isa: str = "auto"
    """The CPU kernels' instruction set (`CPU_ISAS`): auto, or one to force (--cpu-isa)."""
    cache_dir: str | None = None
    """Where converted GGUFs are cached (--cache-dir); None: the resolver's default. The
    engine resolves the model itself only when the caller did not (Lambda)."""
    kernel_cache_dir: str | None = None
    """Where the compiled CPU kernels are cached (--kernel-cache-dir); None: the default."""
    enable_lora: bool = False
    """Serve LoRA adapters (--enable-lora): every q/k/v/o/gate/up/down `Linear` gets
    `max_loras` stacked slots of rank `max_lora_rank` (engine/lora/manager.py)."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """(name, source) of the adapters registered at start (--lora-modules and the model's
    ``adapters/`` folder); a source is a local directory or an ``s3://`` URL."""
    max_loras: int = 1
    """Adapters resident at once, so at most this many different ones in one step (vLLM's
    default, 1)."""
    max_lora_rank: int = 16
    """Largest adapter rank; sizes the stacked buffers (vLLM's default, 16)."""
    profiler: ProfilerConfig | None = None
    """--profiler-config (vLLM's): the torch profiler that /start_profile and
    /stop_profile run over engine steps (engine/profiler.py); None: no profiler routes."""
    test_fault_file: str | None = None
    """Test hook (--test-fault-file, hidden): a step that finds this file deletes it and
    fails, so the reliability tests can fail one step of a real server."""
    test_step_delay: float | None = None
    """Test hook (--test-step-delay, hidden): seconds every step sleeps first, so a test
    can make a request take long on any host (the mode timeouts of `serve`)."""

    # -- environment transport ------------------------------------------------------
    def to_env(self) -> dict[str, str]:
        """The environment entries that make `from_env()` rebuild this config."""
        return {ENV_VAR: msgspec.json.encode(self).decode()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineConfig:
        """The config the CLI exported; defaults when the variable is unset."""
        raw = (os.environ if environ is None else environ).get(ENV_VAR)
        return msgspec.json.decode(raw, type=cls) if raw else cls()

    def __post_init__(self) -> None:
        _choice("--dtype", self.dtype, DTYPES)
        _choice("--quantization", self.quantization, QUANTIZATIONS)
        _choice("--kernels", self.kernels.strip().lower(), KERNELS)
        _choice("--scheduling-policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _choice("--log-level", self.log_level.lower(), LOG_LEVELS)
        _choice("--cpu-isa", self.cpu_isa, CPU_ISAS)
        _choice("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        for flag, value in (
            ("--max-model-len", self.max_model_len),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--max-prefill-chunk", self.max_prefill_chunk),
            ("--block-size", self.block_size),
            ("--kv-cache-memory", self.kv_cache_memory),
            ("num_kv_blocks", self.num_kv_blocks),
            ("--num-threads", self.num_threads),
            ("--max-loras", self.max_loras),
            ("--max-lora-rank", self.max_lora_rank),
        ):
            _at_least(flag, value, 1)
        _at_least("--max-num-queued-reqs", self.max_num_queued_reqs, 0)
        _at_least("--max-num-queued-tokens", self.max_num_queued_tokens, 0)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {', '.join(names)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], not {self.gpu_memory_utilization!r}"
            )


class ModelInfo(msgspec.Struct, kw_only=True):
    """What the serving layer needs to know about the loaded model, resolved by the engine."""

    model_dir: str
    """HF directory the engine loaded (config, tokenizer, and safetensors or a converted GGUF's
    `WEIGHTS_IN_GGUF`); the tokenizer lives here."""
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    block_size: int
    quantization: str = "none"
    """What `--quantization` resolved to: ``gguf`` (the CPU fast path) or ``none``."""
    kernels: str = ""
    """Weights and kernels in one line, incl. the host ISA they were chosen for."""
    pooling: PoolingConfig | None = None
    """How the engine pools embeddings for this model; None: it serves none (an engine
    that predates embeddings, or a test double that does not say)."""
    architecture: str = ""
    """The native model class serving it (``Qwen3ForCausalLM``, ...): `/version` and
    `/v1/models` show it."""
    max_num_seqs: int = 0
    """Sequences the engine runs in one batch (--max-num-seqs): SageMaker batch
    transform's MaxConcurrentTransforms (GET /execution-parameters)."""
    engine_config: dict[str, object] | None = None
    """The EngineConfig the engine runs with, with what it resolved (max_model_len, the
    step budget, the first prompt chunk) in place of 'auto' / None: GET /server_info.
    The API workers never see the engine's own configuration otherwise."""


CPU_TOKEN_BUDGET = 256
"""Default step budget on CPU. A CPU step costs time in proportion to its tokens, so a
small budget spreads a burst of prompts over several steps: the first prompts get their
first token after one short step instead of all of them after one long one (median TTFT
about halves), and running decodes wait at most one short step. Throughput does not
drop: the kernels are as efficient at 256 rows as at 2048."""
GPU_TOKEN_BUDGET = 2048
"""vLLM's default: a GPU step's time barely grows with its tokens."""


def default_token_budget(device_type: str) -> int:
    return CPU_TOKEN_BUDGET if device_type == "cpu" else GPU_TOKEN_BUDGET


TILES_PREFILL_CHUNK = 2048
"""Default longest first prompt chunk of a CPU step where AMX tiles run the linears. A step
also runs every running sequence's decode, whose attention over long contexts costs as much
as a few hundred prompt tokens: cut into 256-token chunks, a 4096-token prompt paid that 16
times. At c=16 (AMX host, docs/performance.md) 2048 took the median time to first token of
1024- and 4096-token prompts from 2.9 to 2.5 s and from 19.1 to 13.9 s and output tok/s
up 15 %; running decodes wait up to one such step (~0.6 s) while a long prompt prefills,
as they do under vLLM's CPU budget of 2048."""
CPU_PREFILL_CHUNK = 512
"""The same on other CPUs (AVX512-BF16 dot products, the float32 block kernels), whose GEMMs
gain nothing past a few hundred rows. On the Zen 5 host (docs/performance.md, stop 30), c=16,
two runs each: 512 against 2048 gave the same tok/s and TTFT within the runs' spread (1024
tokens in: 201 vs 193 tok/s, TTFT p50 2.9 vs 3.2 s; 4096: 44.4 vs 43.0, 19.5 vs 19.3 s) with
about half the ITL p99 at 1024 and a third at 4096 (425 vs 1427 ms); 256 lost at 4096 (40.6
tok/s, TTFT 23.3 s)."""


def default_prefill_chunk(device_type: str, budget: int, tiled_linears: bool) -> int:
    """The first prompt chunk's default: on a GPU the budget (a step's time barely grows
    with its tokens); on a CPU `TILES_PREFILL_CHUNK` where the linears run on AMX tiles
    (`Backends.tiled_linears`), else `CPU_PREFILL_CHUNK`; never below the budget."""
    if device_type != "cpu":
        return budget
    return max(TILES_PREFILL_CHUNK if tiled_linears else CPU_PREFILL_CHUNK, budget)
