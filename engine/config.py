"""Engine configuration: one frozen dataclass built by the CLI and passed to the core.

Values that depend on the loaded model (max_model_len when not given, the number of
KV blocks) are resolved by the core at start-up; see `ResolvedModelInfo`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None
    """Local HF directory or .gguf file; None serves the embedded default (SmolLM2)."""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16; auto keeps the checkpoint's (fp32 on CPU)."""
    device: str = "auto"
    """auto | cpu | cuda[:N]."""
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step, shared by decodes and prefill chunks."""
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None
    """Bytes of KV cache on CPU (default: 2 GiB or what max_num_seqs * max_model_len needs, the smaller)."""
    gpu_memory_utilization: float = 0.9
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


class ModelInfo(msgspec.Struct, kw_only=True):
    """What the serving layer needs to know about the loaded model, resolved by the engine."""

    model_dir: str
    """Plain HF directory (config, tokenizer, safetensors) the engine loaded; tokenizer lives here."""
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    block_size: int
