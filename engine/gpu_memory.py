"""GPU start-up defaults: the dtype "auto" means, and how many KV blocks fit.

The KV cache takes what ``--gpu-memory-utilization`` leaves after everything else, as
vLLM sizes it: the device's memory times the fraction, minus what is already used
(weights, the CUDA context, other processes), minus the peak a worst-case step allocates
on top (measured by one profiling forward of ``max_num_batched_tokens`` prefill tokens and
the logits of ``max_num_seqs`` rows), minus a reserve for CUDA graphs and fragmentation.
The arithmetic is a plain function so the CPU tests check it.
"""

from __future__ import annotations

from typing import Any

import torch

GRAPH_AND_FRAGMENTATION_RESERVE = 1 << 30
"""Bytes kept free after the KV cache: CUDA-graph pools, allocator slack, cuBLAS workspaces."""


def auto_dtype(device_type: str, bf16_supported: bool) -> torch.dtype:
    """``--dtype auto``: fp32 on CPU (fastest and exact there); bf16 on a GPU that has it
    (Ampere and later), else fp16, the 16-bit type every CUDA GPU runs fast."""
    if device_type != "cuda":
        return torch.float32
    return torch.bfloat16 if bf16_supported else torch.float16


def kv_cache_budget_bytes(
    total: int, free: int, peak_step: int, utilization: float, reserve: int
) -> int:
    """Bytes the KV cache may take. ``total``/``free``: the device's, read after the weights
    are loaded; ``peak_step``: what a worst-case step allocates beyond that."""
    used = total - free
    return int(total * utilization) - used - peak_step - reserve


def profile_peak_step_bytes(
    model: Any,
    num_tokens: int,
    num_logit_rows: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Peak bytes one forward of ``num_tokens`` prefill tokens (one sequence, a throwaway
    cache just big enough) plus the float32 logits of ``num_logit_rows`` rows allocates
    beyond what is allocated now. 0 on a device with no allocator statistics (CPU)."""
    is_cuda = device.type == "cuda"
    if is_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    num_blocks = -(-num_tokens // block_size)
    shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
    caches = [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(model.num_layers)
    ]
    from engine.attention import PagedAttentionBackend
    from engine.layers.attention import bind_attention
    from kernels.metadata import SeqSpan

    # The runner binds its own caches later; these exist for this one forward.
    backend = PagedAttentionBackend(dtype)
    bind_attention(model, caches, backend)
    spans = [SeqSpan(0, num_tokens, list(range(num_blocks)))]
    meta = backend.build_metadata(spans, list(range(num_tokens)), block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    # Positions wrap at the rotary table's end: a step may hold more tokens than one
    # sequence can be long, and only the memory of this forward matters.
    max_pos = int(getattr(model, "max_position_embeddings", num_tokens))
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device) % max_pos
    with torch.inference_mode():
        hidden = model(ids, positions, meta)
        rows = min(num_logit_rows, num_tokens)
        model.compute_logits(hidden[:rows])
    if not is_cuda:
        return 0
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del caches, hidden
    torch.cuda.empty_cache()
    return int(peak)
