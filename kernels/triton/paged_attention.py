"""Triton paged attention: a decode kernel and a chunked-prefill kernel over the block cache.

Both are flash-attention style: K/V tiles of ``BLOCK_N`` positions are read straight from
the paged cache (each position's block id looked up in the block table, so a tile may span
several cache blocks and the cache block size need not equal the tile), scores go through
an online softmax in float32, and nothing of size ``seq_len`` is materialised.

* decode: one program per (sequence, kv head). The ``GROUP`` query heads that share the kv
  head are the rows of one ``tl.dot``, so each K/V tile is read once per kv head, not once
  per query head.
* prefill: one program per (chunk, query head, ``BLOCK_M`` queries). Query j of a chunk of
  length q sits at position ``seq_len - q + j`` and sees keys up to and including its own
  position; the key loop stops at the last position the block's queries can see.

Rows that no query owns (padding heads in a group, queries past a chunk's end) are masked
on store and kept finite: every such row still sees key 0, so no NaN is ever computed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata

__all__ = ["paged_attention_triton"]

_LOG2E = 1.4426950408889634


@triton.jit
def _scores(q, k, FP32_DOT: tl.constexpr):
    """``q @ k.T`` accumulated in float32. ``FP32_DOT``: exact float32 products (for float32
    inputs the default TF32 would cost ~3 decimal digits against the reference; bf16 inputs
    are upcast under the interpreter, whose ``tl.dot`` reads bf16 storage as integers)."""
    if FP32_DOT:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(q, tl.trans(k))


@triton.jit
def _weighted(p, v, FP32_DOT: tl.constexpr):
    """``p @ v`` with the probabilities rounded to v's dtype first, as on tensor cores."""
    p = p.to(v.dtype)
    if FP32_DOT:
        return tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(p, v)


@triton.jit
def _paged_attention_decode_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h  # the query heads of this kv head: [BLOCK_H]
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for start in range(0, seq_len, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N]
        n_mask = pos < seq_len
        blk = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _scores(q, k, FP32_DOT) * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _weighted(p, v, FP32_DOT)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _paged_attention_prefill_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    token_offset,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    chunk = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    q_start = tl.load(query_start_loc_ptr + chunk)
    q_len = tl.load(query_start_loc_ptr + chunk + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + chunk)
    prefix = seq_len - q_len
    kvh = head // GROUP
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    tok = (token_offset + q_start + offs_m).to(tl.int64)  # [BLOCK_M] rows of query/out
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    q_pos = prefix + offs_m  # rows past q_len sit at >= seq_len: they see every key, stay finite
    # Keys past the block's last query position are invisible to all its rows. A block
    # wholly past the chunk's end gets an empty loop (and stores nothing).
    kv_end = tl.minimum(seq_len, prefix + m_start + BLOCK_M)
    kv_end = tl.where(m_start < q_len, kv_end, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + chunk * stride_bt
    for start in range(0, kv_end, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N]
        n_mask = pos < seq_len
        blk = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _scores(q, k, FP32_DOT) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _weighted(p, v, FP32_DOT)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def _interpreted() -> bool:
    """Whether the kernels were built for the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return type(_paged_attention_decode_kernel).__name__ == "InterpretedFunction"


def _check(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    assert query.dim() == 3, f"query must be [T, heads, head_dim], got {tuple(query.shape)}"
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, "caches must match"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "cache layout"
    _, block_size, nkv, hd = k_cache.shape
    assert query.shape[2] == hd, f"head_dim {query.shape[2]} vs cache {hd}"
    assert query.shape[1] % nkv == 0, f"{query.shape[1]} heads not a multiple of {nkv} kv heads"
    assert query.stride(2) == 1, "query head_dim must be contiguous"
    assert query.dtype == k_cache.dtype == v_cache.dtype, "query/cache dtypes differ"
    assert meta.block_size == block_size, f"meta block_size {meta.block_size} vs {block_size}"
    if meta.num_decode_tokens:
        assert meta.decode_block_tables.dtype == torch.int32
        assert meta.decode_block_tables.stride(1) == 1
        assert meta.decode_seq_lens.dtype == torch.int32
        assert meta.decode_block_tables.device == query.device
    if meta.num_prefills:
        assert meta.prefill_block_tables.dtype == torch.int32
        assert meta.prefill_block_tables.stride(1) == 1
        assert meta.prefill_seq_lens.dtype == torch.int32
        assert meta.prefill_query_start_loc.dtype == torch.int32
        assert meta.prefill_block_tables.device == query.device


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """``[T, num_heads, hd]`` attention output of the step described by ``meta``.

    Rows past the step's decode and prefill tokens (there are none today) are left
    unwritten. ``block_m``/``block_n`` are the prefill query tile and the K/V tile.
    """
    _check(query, k_cache, v_cache, meta)
    _, num_heads, hd = query.shape
    _, block_size, nkv, _ = k_cache.shape
    group = num_heads // nkv
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    fp32_dot = query.dtype == torch.float32 or (_interpreted() and query.dtype == torch.bfloat16)
    qk_scale = scale * _LOG2E
    block_d = max(16, triton.next_power_of_2(hd))  # tl.dot needs K >= 16
    cs = k_cache.stride()
    nd = meta.num_decode_tokens
    if nd > 0:
        _paged_attention_decode_kernel[(nd, nkv)](
            out,
            query,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            qk_scale,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            cs[0],
            cs[1],
            cs[2],
            meta.decode_block_tables.stride(0),
            GROUP=group,
            HEAD_DIM=hd,
            BLOCK_SIZE=block_size,
            BLOCK_H=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
            BLOCK_D=block_d,
            BLOCK_N=block_n,
            FP32_DOT=fp32_dot,
            num_warps=4,
        )
    if meta.num_prefills > 0 and meta.prefill_max_query_len > 0:
        grid = (meta.num_prefills, num_heads, triton.cdiv(meta.prefill_max_query_len, block_m))
        _paged_attention_prefill_kernel[grid](
            out,
            query,
            k_cache,
            v_cache,
            meta.prefill_block_tables,
            meta.prefill_seq_lens,
            meta.prefill_query_start_loc,
            nd,
            qk_scale,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            cs[0],
            cs[1],
            cs[2],
            meta.prefill_block_tables.stride(0),
            GROUP=group,
            HEAD_DIM=hd,
            BLOCK_SIZE=block_size,
            BLOCK_M=block_m,
            BLOCK_D=block_d,
            BLOCK_N=block_n,
            FP32_DOT=fp32_dot,
            num_warps=4,
        )
    return out
