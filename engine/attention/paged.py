"""The `kernels` ops as an attention backend: Triton on CUDA, the torch reference on CPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend
from engine.cuda_graphs import CudaGraphRunner, build_cuda_graphs
from kernels import paged_attention, write_kv_cache
from kernels.metadata import AttentionMetadata
from kernels.reference_plan import reference_plan

if TYPE_CHECKING:
    from engine.layers.attention import Attention


class PagedAttentionBackend(AttentionBackend):
    """`write_kv_cache` + `paged_attention` through the kernel dispatch. On CPU the torch
    reference needs gather indices and masks per step: `prepare` builds them once (the
    plan), before any layer runs."""

    name = "paged"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def capture_graphs(
        self,
        model: torch.nn.Module,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device,
        enforce_eager: bool,
        say: Callable[[str], None],
    ) -> CudaGraphRunner | None:
        """Decode CUDA graphs on a CUDA device (engine/cuda_graphs.py); None on CPU or with
        ``--enforce-eager``. Each replay calls `prepare` on the graph's metadata."""
        return build_cuda_graphs(
            model, self, block_size, max_model_len, max_num_seqs, device, enforce_eager, say
        )

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        if not meta.slot_mapping.is_cuda:
            meta.reference_plan = None
            meta.reference_window_plans = None
            reference_plan(meta, block_size, self.dtype)

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert layer.kv_cache is not None
        k_cache, v_cache = layer.kv_cache
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(
            q, k_cache, v_cache, meta, layer.scale, layer.sliding_window, layer.sinks
        )  # [T, nh, hd]
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)
