"""Triton paged attention: a decode kernel and a chunked-prefill kernel over the block cache.

Both are flash-attention style: K/V tiles of ``BLOCK_N`` positions are read straight from
the paged cache (each position's block id looked up in the block table, so a tile may span
several cache blocks and the cache block size need not equal the tile), scores go through
an online softmax in float32, and nothing of size ``seq_len`` is materialised.

* decode: one program per (sequence, kv head). The ``GROUP`` query heads that share the kv
  head are the rows of one ``tl.dot``, so each K/V tile is read once per kv head, not once
  per query head.
* split-KV decode (flash-decoding): when a decode batch has too few (sequence, kv head)
  programs to fill the GPU and contexts are long, each sequence's context is cut into
  ``num_splits`` slices run by separate programs, then a small reduce kernel merges the
  partial softmax states. The slice bounds come from the device-side ``seq_lens``, and the
  split count only from host values fixed per batch shape, so CUDA graphs capture it.
* prefill: one program per (chunk, query head, ``BLOCK_M`` queries). Query j of a chunk of
  length q sits at position ``seq_len - q + j`` and sees keys up to and including its own
  position; the key loop stops at the last position the block's queries can see.
* sliding window ``WINDOW`` (0: none): a query at position p sees keys p - WINDOW + 1 .. p.
  The key loops start at the first position any of their rows can see, so keys (and
  cache blocks) before the window are never read: they may have been freed and reused.

* attention sinks ``SINKS`` (gpt-oss): a per-head logit that joins the softmax
  denominator and attends to nothing. The online softmax simply starts from it: running
  max = the sink (log2 units), running sum = 1, accumulator 0, which is the sink as a
  key whose value is zero. In split-KV decode only split 0 starts from it.

Rows that no query owns (padding heads in a group, queries past a chunk's end) are masked
on store and kept finite: every such row still sees key 0, so no NaN is ever computed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata

__all__ = ["decode_num_splits", "paged_attention_triton"]

_LOG2E = 1.4426950408889634

SPLIT_MIN_SEQ_LEN = 1024
"""Below this longest context, one program per (sequence, kv head) finishes quickly."""
MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Context slices per sequence for a decode batch: enough programs for about two
    waves over the ``num_sms`` multiprocessors, only when contexts are long (1 = no split).

    Depends on host values only (under CUDA graphs ``max_seq_len`` is ``max_model_len``),
    so capture and replay agree."""
    programs = num_seqs * num_kv_heads
    if max_seq_len < SPLIT_MIN_SEQ_LEN or programs <= 0 or programs >= num_sms:
        return 1
    want = -(-2 * num_sms // programs)
    return max(1, min(want, MAX_SPLITS, max_seq_len // MIN_KEYS_PER_SPLIT))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: splitting only when a test asks for it
    return torch.cuda.get_device_properties(device).multi_processor_count


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
def _sink_state(sinks_ptr, heads, mask, ROWS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The online softmax's starting (max, sum) per row: the rows' sink logits in log2
    units and 1 with ``HAS_SINKS`` (the sink is a key of value zero), else (-inf, 0)."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.zeros([ROWS], dtype=tl.float32) + sink
        l_i = tl.full([ROWS], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def _attend(
    q,
    q_pos,
    m_i,
    l_i,
    lo,
    hi,
    kv_len,
    table,
    k_cache_ptr,
    v_cache_ptr,
    kvh,
    qk_scale,
    stride_cb,
    stride_cs,
    stride_ch,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    FP32_DOT: tl.constexpr,
    WINDOW: tl.constexpr = 0,
):
    """The loop every kernel here shares: online softmax of the query rows ``q``
    ``[ROWS, BLOCK_D]`` over cache positions ``lo .. hi`` of kv head ``kvh`` (the sequence's
    block ``table``), in K/V tiles of ``BLOCK_N``. Positions ``>= kv_len`` are masked and
    never loaded; ``CAUSAL``: row r also sees only positions ``<= q_pos[r]`` (and, with a
    ``WINDOW``, ``> q_pos[r] - WINDOW``).

    ``(m_i, l_i)`` is the starting state (`_sink_state`). Returns ``(acc, m_i, l_i)``:
    the unnormalised ``[ROWS, BLOCK_D]`` accumulator, and per row the running max (log2
    units) and sum of exponentials."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N]
        n_mask = pos < kv_len
        blk = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _scores(q, k, FP32_DOT) * qk_scale  # [ROWS, BLOCK_N], log2 units
        if CAUSAL:
            visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
            if WINDOW > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        else:
            visible = n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _weighted(p, v, FP32_DOT)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _load_group_query(
    q_ptr,
    seq,
    kvh,
    stride_qt,
    stride_qh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Decode token ``seq``'s ``GROUP`` query heads that share kv head ``kvh``, as the rows
    of one tile: ``(q [BLOCK_H, BLOCK_D], heads [BLOCK_H], h_mask [BLOCK_H])``; padding
    rows are zeros (they still see key 0, so they stay finite)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    heads = kvh * GROUP + offs_h  # the query heads of this kv head: [BLOCK_H]
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    return q, heads, h_mask


@triton.jit
def _paged_attention_decode_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    sinks_ptr,
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
    WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if WINDOW > 0:  # the query sits at seq_len - 1: its window starts at seq_len - WINDOW
        lo = tl.maximum(seq_len - WINDOW, 0)
    q, heads, h_mask = _load_group_query(
        q_ptr, seq, kvh, stride_qt, stride_qh, GROUP, HEAD_DIM, BLOCK_H, BLOCK_D
    )
    m_i, l_i = _sink_state(sinks_ptr, heads, h_mask, BLOCK_H, HAS_SINKS)
    acc, _, l_i = _attend(
        q,
        heads,  # unused: not causal
        m_i,
        l_i,
        lo,
        seq_len,
        seq_len,
        block_tables_ptr + seq * stride_bt,
        k_cache_ptr,
        v_cache_ptr,
        kvh,
        qk_scale,
        stride_cb,
        stride_cs,
        stride_ch,
        BLOCK_H,
        HEAD_DIM,
        BLOCK_SIZE,
        BLOCK_D,
        BLOCK_N,
        False,
        FP32_DOT,
    )
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(
        out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


@triton.jit
def _paged_attention_decode_split_kernel(
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    sinks_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Split-KV (flash-decoding) pass 1: program (seq, kv head, split) runs the online
    softmax over its slice of the context and stores the unnormalised accumulator with its
    running max and sum. The slice is computed from the sequence's length on the device,
    so one launch shape (and one CUDA graph) serves every context length; splits past the
    end store an empty state (max -inf, sum 0)."""
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    part = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * part
    hi = tl.minimum(lo + part, seq_len)
    if WINDOW > 0:  # splits wholly before the window run an empty loop
        lo = tl.maximum(lo, seq_len - WINDOW)
    q, heads, h_mask = _load_group_query(
        q_ptr, seq, kvh, stride_qt, stride_qh, GROUP, HEAD_DIM, BLOCK_H, BLOCK_D
    )
    m_i, l_i = _sink_state(sinks_ptr, heads, h_mask, BLOCK_H, HAS_SINKS)
    if HAS_SINKS:  # the sink joins one split only: the others start empty
        first = split == 0
        m_i = tl.where(first, m_i, float("-inf"))
        l_i = tl.where(first, l_i, 0.0)
    acc, m_i, l_i = _attend(
        q,
        heads,  # unused: not causal
        m_i,
        l_i,
        lo,
        hi,
        hi,
        block_tables_ptr + seq * stride_bt,
        k_cache_ptr,
        v_cache_ptr,
        kvh,
        qk_scale,
        stride_cb,
        stride_cs,
        stride_ch,
        BLOCK_H,
        HEAD_DIM,
        BLOCK_SIZE,
        BLOCK_D,
        BLOCK_N,
        False,
        FP32_DOT,
    )
    # Partials: [num_seqs, NUM_HEADS, NUM_SPLITS] (+ [HEAD_DIM]), contiguous.
    offs_d = tl.arange(0, BLOCK_D)
    row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_H]
    tl.store(part_m_ptr + row, m_i, mask=h_mask)
    tl.store(part_l_ptr + row, l_i, mask=h_mask)
    tl.store(
        part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        acc,
        mask=h_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


@triton.jit
def _paged_attention_decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Split-KV pass 2: program (seq, head) rescales each split's accumulator to the
    common max and divides by the combined sum. A row with no keys at all (a padding
    row with context 0) gets zeros, never NaN."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    base = (seq * NUM_HEADS + head) * NUM_SPLITS
    m = tl.load(part_m_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + base + offs_s, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # [BLOCK_S]; 0 for empty splits
    acc = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l_s * w, axis=0)
    out = num / tl.where(den > 0.0, den, 1.0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
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
    sinks_ptr,
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
    WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    chunk = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    q_start = tl.load(query_start_loc_ptr + chunk)
    q_len = tl.load(query_start_loc_ptr + chunk + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + chunk)
    prefix = seq_len - q_len
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    tok = (token_offset + q_start + offs_m).to(tl.int64)  # [BLOCK_M] rows of query/out
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    # Rows past q_len sit at the chunk's last position: they see its keys, stay finite.
    q_pos = tl.minimum(prefix + offs_m, seq_len - 1)
    # Keys past the block's last query position are invisible to all its rows. A block
    # wholly past the chunk's end gets an empty loop (and stores nothing).
    kv_end = tl.minimum(seq_len, prefix + m_start + BLOCK_M)
    kv_end = tl.where(m_start < q_len, kv_end, 0)
    kv_start = 0
    if WINDOW > 0:  # keys before the block's first query's window are invisible to all
        kv_start = tl.maximum(prefix + m_start - WINDOW + 1, 0)
    m_i, l_i = _sink_state(
        sinks_ptr, head + tl.zeros([BLOCK_M], dtype=tl.int32), m_mask, BLOCK_M, HAS_SINKS
    )
    acc, _, l_i = _attend(
        q,
        q_pos,
        m_i,
        l_i,
        kv_start,
        kv_end,
        seq_len,
        block_tables_ptr + chunk * stride_bt,
        k_cache_ptr,
        v_cache_ptr,
        head // GROUP,
        qk_scale,
        stride_cb,
        stride_cs,
        stride_ch,
        BLOCK_M,
        HEAD_DIM,
        BLOCK_SIZE,
        BLOCK_D,
        BLOCK_N,
        True,
        FP32_DOT,
        WINDOW,
    )
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
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    *,
    block_m: int = 64,
    block_n: int = 64,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``[T, num_heads, hd]`` attention output of the step described by ``meta``.

    Rows past the step's decode and prefill tokens (there are none today) are left
    unwritten. ``block_m``/``block_n`` are the prefill query tile and the K/V tile;
    ``num_splits`` forces the split-KV decode slice count (None: ``decode_num_splits``).
    ``sliding_window``, ``sinks``: see ``kernels.reference.paged_attention``.
    """
    _check(query, k_cache, v_cache, meta)
    if sinks is not None:
        assert sinks.shape == (query.shape[1],), f"sinks {tuple(sinks.shape)} vs heads"
        assert sinks.device == query.device, "sinks must be on the query's device"
        sinks = sinks.to(torch.float32).contiguous()  # read as float32 logits
    has_sinks = sinks is not None
    sinks_arg = sinks if sinks is not None else query  # never read without HAS_SINKS
    _, num_heads, hd = query.shape
    _, block_size, nkv, _ = k_cache.shape
    group = num_heads // nkv
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    fp32_dot = query.dtype == torch.float32 or (_interpreted() and query.dtype == torch.bfloat16)
    window = int(sliding_window or 0)
    qk_scale = scale * _LOG2E
    block_d = max(16, triton.next_power_of_2(hd))  # tl.dot needs K >= 16
    cs = k_cache.stride()
    nd = meta.num_decode_tokens
    if num_splits is None and nd > 0:
        num_splits = decode_num_splits(nd, nkv, meta.decode_max_seq_len, _num_sms(query.device))
    if nd > 0 and num_splits is not None and num_splits > 1:
        _decode_split(
            query, k_cache, v_cache, meta, out, qk_scale, num_splits, block_n, fp32_dot, window,
            sinks,
        )  # fmt: skip
    elif nd > 0:
        _paged_attention_decode_kernel[(nd, nkv)](
            out,
            query,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            sinks_arg,
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
            WINDOW=window,
            HAS_SINKS=has_sinks,
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
            sinks_arg,
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
            WINDOW=window,
            HAS_SINKS=has_sinks,
            num_warps=4,
        )
    return out


def _decode_split(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor,
    qk_scale: float,
    num_splits: int,
    block_n: int,
    fp32_dot: bool,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    """The decode rows of ``out`` through the two split-KV kernels."""
    nd = meta.num_decode_tokens
    _, num_heads, hd = query.shape
    _, block_size, nkv, _ = k_cache.shape
    group = num_heads // nkv
    cs = k_cache.stride()
    f32 = {"dtype": torch.float32, "device": query.device}
    part_out = torch.empty((nd, num_heads, num_splits, hd), **f32)
    part_m = torch.empty((nd, num_heads, num_splits), **f32)
    part_l = torch.empty((nd, num_heads, num_splits), **f32)
    block_d = max(16, triton.next_power_of_2(hd))
    _paged_attention_decode_split_kernel[(nd, nkv, num_splits)](
        part_out,
        part_m,
        part_l,
        query,
        k_cache,
        v_cache,
        meta.decode_block_tables,
        meta.decode_seq_lens,
        sinks if sinks is not None else query,
        qk_scale,
        query.stride(0),
        query.stride(1),
        cs[0],
        cs[1],
        cs[2],
        meta.decode_block_tables.stride(0),
        NUM_HEADS=num_heads,
        NUM_SPLITS=num_splits,
        GROUP=group,
        HEAD_DIM=hd,
        BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        FP32_DOT=fp32_dot,
        WINDOW=window,
        HAS_SINKS=sinks is not None,
        num_warps=4,
    )
    _paged_attention_decode_reduce_kernel[(nd, num_heads)](
        out,
        part_out,
        part_m,
        part_l,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        NUM_SPLITS=num_splits,
        HEAD_DIM=hd,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_D=block_d,
        num_warps=1,
    )
