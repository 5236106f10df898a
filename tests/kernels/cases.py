"""Helpers that build a paged-cache step the way the engine would: for tests and benchmarks.

Not used by the serving path. A step is described by a list of ``(seq_len, query_len)``
pairs, decodes first (``query_len == 1``); blocks are handed out from a shuffled pool so
block tables are non-contiguous, as they are after the engine has run for a while.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import reference
from kernels.metadata import AttentionMetadata, SeqSpan

__all__ = [
    "PagedStep",
    "as_kv_cache",
    "cpu_attention_tables",
    "held_by_kv_cache",
    "make_step",
    "naive_attention",
    "scatter_dense_kv",
]


def as_kv_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cache of ``dtype`` holding float32 ``x [..., head_dim]``: int8 caches are rows with
    their scales (`kernels.reference.quantize_kv_int8`), the float kinds ``x.to(dtype)``."""
    return reference.quantize_kv_int8(x) if dtype == torch.int8 else x.to(dtype)


def held_by_kv_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 values a cache of ``dtype`` holds for ``x`` (the oracle's K or V)."""
    if dtype == torch.int8:
        return reference.dequantize_kv_int8(reference.quantize_kv_int8(x))
    return x.to(dtype).float()


@dataclass
class PagedStep:
    """One step's metadata plus the per-sequence layout it was built from."""

    meta: AttentionMetadata
    block_tables: list[list[int]]
    """Per sequence, its cache block ids in position order."""
    seq_lens: list[int]
    query_lens: list[int]
    positions: torch.Tensor
    """[num_tokens] int64: position of every query token of the step."""


def make_step(
    seqs: list[tuple[int, int]],
    block_size: int,
    num_blocks: int,
    *,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    table_pad: int = 0,
    num_decodes: int | None = None,
) -> PagedStep:
    """Build ``AttentionMetadata`` for ``seqs`` = ``[(seq_len, query_len), ...]``.

    Sequences with ``query_len == 1`` must come first and are the decodes; the rest are
    prefill chunks whose cached prefix is ``seq_len - query_len``. ``table_pad`` adds
    extra zero columns to the block tables (the engine pads tables to a common width).
    ``num_decodes`` overrides the count of leading decodes, e.g. to make a 1-token prefill.
    """
    assert all(1 <= q_len <= seq_len for seq_len, q_len in seqs)
    if num_decodes is None:
        num_decodes = 0
        while num_decodes < len(seqs) and seqs[num_decodes][1] == 1:
            num_decodes += 1
    assert all(q_len == 1 for _, q_len in seqs[:num_decodes])

    need = [-(-s // block_size) for s, _ in seqs]
    assert sum(need) <= num_blocks, "not enough cache blocks"
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    tables: list[list[int]] = []
    for n in need:
        tables.append(pool[:n])
        pool = pool[n:]

    slots: list[int] = []
    positions: list[int] = []
    for (seq_len, q_len), table in zip(seqs, tables, strict=True):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)

    spans = [
        SeqSpan(seq_len - q_len, q_len, table)
        for (seq_len, q_len), table in zip(seqs, tables, strict=True)
    ]
    meta = AttentionMetadata.build(
        spans, slots, block_size, torch.device(device), token_index=True, num_decodes=num_decodes
    )
    if table_pad:  # the engine pads tables to a common width: kernels must not care

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, table_pad))

        meta.decode_block_tables = pad(meta.decode_block_tables)
        meta.prefill_block_tables = pad(meta.prefill_block_tables)
        assert meta.seq_block_tables is not None
        meta.seq_block_tables = pad(meta.seq_block_tables)
    return PagedStep(
        meta=meta,
        block_tables=tables,
        seq_lens=[s for s, _ in seqs],
        query_lens=[q for _, q in seqs],
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
    )


def scatter_dense_kv(
    step: PagedStep,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Put each sequence's whole dense K/V (``[seq_len, nkv, hd]``) at its pages, by plain
    indexing per sequence: independent of ``write_kv_cache``."""
    block_size = k_cache.shape[1]
    for table, k, v in zip(step.block_tables, keys, values, strict=True):
        pos = torch.arange(k.shape[0])
        blocks = torch.tensor(table, dtype=torch.int64)[pos // block_size]
        k_cache[blocks.to(k_cache.device), (pos % block_size).to(k_cache.device)] = k
        v_cache[blocks.to(v_cache.device), (pos % block_size).to(v_cache.device)] = v


def cpu_attention_tables(step: PagedStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The C attention kernel's view of a step: block tables as one zero-padded int32
    matrix, and per query token its sequence's row and its context length (position + 1)."""
    width = max(len(t) for t in step.block_tables)
    tables = torch.zeros(len(step.block_tables), width, dtype=torch.int32)
    for i, t in enumerate(step.block_tables):
        tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    token_seq = torch.tensor(
        [i for i, q in enumerate(step.query_lens) for _ in range(q)], dtype=torch.int32
    )
    return tables, token_seq, (step.positions + 1).to(torch.int32)


def naive_attention(
    step: PagedStep,
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense causal attention per sequence and per head in float64, no paging: the oracle.

    Sequence i's queries are its ``query_lens[i]`` consecutive rows of ``query`` (decodes
    first, then prefill chunks, the step's token order) at positions
    ``seq_len - q_len .. seq_len - 1``; each sees keys ``0 ..`` its own position (with a
    ``sliding_window`` W: only ``position - W + 1 ..`` its own position). ``sinks``
    ``[num_heads]``: head h's softmax gets one more logit, ``sinks[h]``, whose weight is
    dropped (gpt-oss).
    """
    num_heads = query.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    row = 0
    for seq_len, q_len, k, v in zip(step.seq_lens, step.query_lens, keys, values, strict=True):
        group = num_heads // k.shape[1]
        for h in range(num_heads):
            q_h = query[row : row + q_len, h].double().cpu()  # [q_len, hd]
            k_h = k[:seq_len, h // group].double().cpu()  # [seq_len, hd]
            v_h = v[:seq_len, h // group].double().cpu()
            scores = q_h @ k_h.T * scale  # [q_len, seq_len]
            q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
            k_pos = torch.arange(seq_len)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            if sliding_window is not None:
                scores = scores.masked_fill(k_pos <= q_pos - sliding_window, float("-inf"))
            if sinks is not None:
                sink = torch.full((q_len, 1), float(sinks[h]), dtype=torch.float64)
                weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[:, :-1]
            else:
                weights = torch.softmax(scores, dim=-1)
            out[row : row + q_len, h] = weights @ v_h
        row += q_len
    return out


def attention_inputs(seqs, nh, nkv, hd, bs, kv_dtype, seed=0):
    """Random paged attention inputs of sequences ``seqs`` ((seq_len, query_len) each) in
    caches of ``kv_dtype`` (one dtype, or (keys', values')): (step, query, the keys and
    values as the caches hold them, k_cache, v_cache, tables, token_seq, token_ctx)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // bs) for s, _ in seqs) + 8
    step = make_step(seqs, bs, num_blocks, generator=gen, num_decodes=0)
    # Slots no sequence owns hold noise (never read as a key: masked or outside the tables).
    k_cache = torch.randn(num_blocks, bs, nkv, hd, generator=gen)
    v_cache = torch.randn(num_blocks, bs, nkv, hd, generator=gen)
    keys = [torch.randn(s, nkv, hd, generator=gen) for s, _ in seqs]
    values = [torch.randn(s, nkv, hd, generator=gen) for s, _ in seqs]
    scatter_dense_kv(step, keys, values, k_cache, v_cache)
    dk, dv = kv_dtype if isinstance(kv_dtype, tuple) else (kv_dtype, kv_dtype)
    k_cache, v_cache = as_kv_cache(k_cache, dk), as_kv_cache(v_cache, dv)
    keys = [held_by_kv_cache(k, dk) for k in keys]  # what the cache holds
    values = [held_by_kv_cache(v, dv) for v in values]
    query = torch.randn(sum(q for _, q in seqs), nh, hd, generator=gen)
    tables, token_seq, token_ctx = cpu_attention_tables(step)
    return step, query, keys, values, k_cache, v_cache, tables, token_seq, token_ctx


def poison_blocks_before_windows(
    step: PagedStep, bs: int, window: int, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """Fill with NaN every cache block that lies wholly before the sliding window of all of
    its sequence's query rows, as a freed block another sequence reused would be: a kernel
    that reads one shows NaN. An int8 cache gets a NaN row scale (every value NaN)."""
    for table, seq_len, q_len in zip(
        step.block_tables, step.seq_lens, step.query_lens, strict=True
    ):
        first_seen = seq_len - q_len - window + 1
        for i, block in enumerate(table):
            if (i + 1) * bs <= first_seen:
                for cache in (k_cache, v_cache):
                    if cache.dtype == torch.int8:
                        cache[block, ..., -4:] = torch.tensor([math.nan]).view(torch.int8)
                    else:
                        cache[block] = math.nan
