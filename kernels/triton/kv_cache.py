"""Triton scatter of the step's new K/V into the paged cache.

One program per token: all of its KV heads are one ``[kv_heads, head_dim]`` tile. Padding
tokens (slot < 0) are skipped by masking the store, so no branch diverges.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["write_kv_cache_triton"]


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_D)
    # slot >= 0 broadcast as a block compare (a scalar i1 in a mask trips the interpreter)
    slots = tl.zeros([BLOCK_HEADS, BLOCK_D], dtype=tl.int64) + slot
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & (slots >= 0)
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = slot * stride_cache_slot + h[:, None] * stride_cache_head + d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """In place: ``k_cache.view(-1, nkv, hd)[slot_mapping] = key`` (same for v), slots < 0
    skipped. Tokens past ``len(slot_mapping)`` are ignored."""
    # key/value: [T, nkv, hd]; caches: [num_blocks, block_size, nkv, hd]; slot_mapping: [T]
    assert key.dim() == 3 and value.shape == key.shape, "key/value must be [T, nkv, hd]"
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, "caches must match"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    nkv, hd = k_cache.shape[2:]
    assert key.shape[1:] == (nkv, hd), f"key {tuple(key.shape)} vs cache {tuple(k_cache.shape)}"
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert slot_mapping.dim() == 1 and slot_mapping.shape[0] <= key.shape[0]
    assert not slot_mapping.dtype.is_floating_point, "slot_mapping must be integers"
    n = slot_mapping.shape[0]
    if n == 0:
        return
    _write_kv_cache_kernel[(n,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=nkv,
        HEAD_DIM=hd,
        BLOCK_HEADS=triton.next_power_of_2(nkv),
        BLOCK_D=triton.next_power_of_2(hd),
        num_warps=1 if nkv * hd <= 1024 else 4,
    )
