"""The attention layer: paged KV cache in, attention out; the kernel is the backend's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.layers.linear import empty_parameter
from kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from engine.attention.base import AttentionBackend

KVCache = tuple[torch.Tensor, torch.Tensor]
"""(k_cache, v_cache) of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""


class Attention(nn.Module):
    """Causal attention of the step's tokens over their sequences' paged K/V.

    Writes the step's k and v into the cache slots ``meta.slot_mapping`` names, then
    attends. The model runner binds `kv_cache` and `backend` once (`bind`); the model
    file never sees either.

    `sliding_window` (None: global attention): a query at position p sees only the keys
    at positions ``p - sliding_window + 1 .. p`` (the window counts the token itself, as
    transformers' sliding-window mask and vLLM do). Every backend honours it.

    `sinks` (gpt-oss): a learned logit per query head, ``[num_heads]``, that joins each
    softmax's denominator and attends to nothing (kernels/reference.py
    ``paged_attention``). It is a parameter of this layer (``...self_attn.attn.sinks``;
    the model file maps the checkpoint's name onto it). A backend whose kernel has no
    sink term must refuse the layer (`supports`), never run it without.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        sinks: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads do not split into {num_kv_heads} kv heads")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.sinks: nn.Parameter | None = None
        if sinks:
            if dtype is None or device is None:
                raise ValueError("an Attention with sinks needs the model dtype and device")
            self.sinks = empty_parameter((num_heads,), dtype, device)
        self.kv_cache: KVCache | None = None
        self.backend: AttentionBackend | None = None

    def bind(self, kv_cache: KVCache, backend: AttentionBackend) -> None:
        self.kv_cache = kv_cache
        self.backend = backend

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] → [T, num_heads *
        head_dim]."""
        if self.backend is None or self.kv_cache is None:
            raise RuntimeError("Attention.bind was not called (the model runner binds it)")
        return self.backend.forward(self, q, k, v, meta)


def has_sinks(model: nn.Module) -> bool:
    """Whether some attention layer of `model` has attention sinks (gpt-oss)."""
    return any(isinstance(m, Attention) and m.sinks is not None for m in model.modules())


def bind_attention(model: nn.Module, kv_caches: list[KVCache], backend: AttentionBackend) -> None:
    """Give every `Attention` of `model`, in order, its layer's cache and the backend."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != len(kv_caches):
        raise ValueError(f"{len(layers)} attention layers but {len(kv_caches)} KV caches")
    for layer, cache in zip(layers, kv_caches, strict=True):
        layer.bind(cache, backend)
