"""The C attention kernel of the CPU fast path as a backend (kernels/cpu/hearth_cpu.c).

It attends token by token over each token's own sequence (decodes and prefill chunks
take the same path), reading the paged cache in place, so its metadata carries the
per-token fields. Every output depends only on the token's own sequence: results do not
change with batch size, chunking or thread count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend
from kernels.cpu import ops
from kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from engine.layers.attention import Attention


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    token_index = True

    def __init__(self) -> None:
        self.scratch = ops.AttentionScratch()

    @staticmethod
    def supported(head_dim: int, dtype: torch.dtype, device: torch.device) -> str | None:
        """None when the kernel can run, else why not."""
        if device.type != "cpu" or dtype != torch.float32:
            return "the C attention kernel computes in float32 on the CPU"
        if head_dim % 32:
            return f"head_dim {head_dim} is not a multiple of 32"
        if not ops.available():
            return "no AVX2 on this host"
        return None

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert layer.kv_cache is not None
        assert meta.seq_block_tables is not None and meta.token_seq is not None
        assert meta.token_ctx is not None
        k_cache, v_cache = layer.kv_cache
        ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.stride(2) != 1 or (layer.num_heads > 1 and q.stride(1) != layer.head_dim):
            q = q.contiguous()
        rows = (
            q.view(q.shape[0], -1)
            if q.is_contiguous()
            else q.as_strided((q.shape[0], layer.num_heads * layer.head_dim), (q.stride(0), 1))
        )  # [T, nh*hd] rows with the query's row stride
        return ops.paged_attention(
            rows, layer.num_heads, layer.num_kv_heads, layer.head_dim, k_cache, v_cache,
            meta.seq_block_tables, meta.token_seq, meta.token_ctx, meta.max_ctx, layer.scale,
            self.scratch,
        )  # fmt: skip
