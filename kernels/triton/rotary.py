"""Triton rotary embedding (GPT-NeoX / HF-Llama ``rotate_half`` layout).

One program per token: it reads the token's cos/sin row once and rotates every query and
key head of that token. 16-bit inputs are rounded after each product and after the sum,
the points where transformers' eager ``q * cos + rotate_half(q) * sin`` rounds, so results
match it bit for bit barring fused multiply-adds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rotary_embedding_triton"]


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    stride_xh,
    stride_oh,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    ROUND: tl.constexpr,
):
    """Rotate ``num_heads`` heads of one token; ``x_ptr``/``out_ptr`` point at the token."""
    heads = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (d[None, :] < HALF)
    x_off = heads[:, None] * stride_xh + d[None, :]  # [BLOCK_HEADS, BLOCK_HALF]
    o_off = heads[:, None] * stride_oh + d[None, :]
    x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_off + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    if ROUND:
        o1 = (x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)
        o2 = (x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)
    else:
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
    tl.store(out_ptr + o_off, o1.to(dt), mask=mask)
    tl.store(out_ptr + o_off + HALF, o2.to(dt), mask=mask)
    if BLOCK_PASS > 0:  # partial rotary: dims past 2 * HALF are copied unchanged
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)
        pmask = (heads[:, None] < num_heads) & (p[None, :] < HEAD_DIM)
        xp = tl.load(x_ptr + heads[:, None] * stride_xh + p[None, :], mask=pmask, other=0.0)
        tl.store(out_ptr + heads[:, None] * stride_oh + p[None, :], xp, mask=pmask)


@triton.jit
def _rotary_embedding_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cache,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    ROUND: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    # cos/sin are cast to the activations' dtype first, as transformers does.
    dt = q_out_ptr.dtype.element_ty
    cos = tl.load(cache_ptr + pos * stride_cache + d, mask=dmask, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + d, mask=dmask, other=0.0)
    cos = cos.to(dt).to(tl.float32)[None, :]  # [1, BLOCK_HALF]
    sin = sin.to(dt).to(tl.float32)[None, :]
    _rotate_heads(
        q_ptr + t * stride_qt,
        q_out_ptr + t * stride_qot,
        stride_qh,
        stride_qoh,
        num_heads,
        cos,
        sin,
        HALF,
        HEAD_DIM,
        BLOCK_HEADS,
        BLOCK_HALF,
        BLOCK_PASS,
        ROUND,
    )
    _rotate_heads(
        k_ptr + t * stride_kt,
        k_out_ptr + t * stride_kot,
        stride_kh,
        stride_koh,
        num_kv_heads,
        cos,
        sin,
        HALF,
        HEAD_DIM,
        BLOCK_KV_HEADS,
        BLOCK_HALF,
        BLOCK_PASS,
        ROUND,
    )


def rotary_embedding_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns new rotated ``(query, key)``; inputs may be strided views (e.g. slices of a
    fused QKV projection) as long as head_dim is contiguous."""
    # positions: [T]; query: [T, H, D]; key: [T, KV, D]; cos_sin_cache: [max_pos, rot_dim]
    assert query.dim() == 3 and key.dim() == 3, "query/key must be [T, heads, head_dim]"
    num_tokens, num_heads, head_dim = query.shape
    assert key.shape[0] == num_tokens and key.shape[2] == head_dim, "query/key shapes differ"
    assert positions.shape == (num_tokens,), "positions must be [num_tokens]"
    assert not positions.dtype.is_floating_point, "positions must be integers"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.stride(1) == 1
    rot_dim = cos_sin_cache.shape[1]
    assert rot_dim % 2 == 0 and rot_dim <= head_dim, f"cache width {rot_dim} vs head {head_dim}"
    assert query.stride(2) == 1 and key.stride(2) == 1, "head_dim must be contiguous"
    assert query.dtype == key.dtype, "query and key dtypes differ"
    q_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(key, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return q_out, k_out
    half = rot_dim // 2
    passthrough = head_dim - rot_dim
    _rotary_embedding_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        q_out,
        k_out,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        num_heads,
        key.shape[1],
        HALF=half,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(key.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_PASS=triton.next_power_of_2(passthrough) if passthrough else 0,
        ROUND=query.dtype != torch.float32,
        num_warps=4,
    )
    return q_out, k_out
