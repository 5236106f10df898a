"""The torch reference attention's per-step plan: gather indices and masks, built once.

Every tensor here is derived from the step's ``AttentionMetadata`` alone, and the model
calls attention once per layer with the same metadata, so the first layer builds the plan
and stores it on ``meta.reference_plan``; the other layers reuse it. A typed plan (rather
than a string-keyed cache) keeps what is cached, and for which dtype, in one place.

A sliding window changes only the masks: its plan is built once per distinct window
(Gemma 3 interleaves windowed and global layers) and kept in
``meta.reference_window_plans``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata

__all__ = ["DecodePlan", "PrefillPlan", "ReferenceAttentionPlan", "reference_plan"]


@dataclass(frozen=True, slots=True)
class DecodePlan:
    block_ids: torch.Tensor
    """[num_decodes * num_blocks] int64: each sequence's cache blocks, row after row."""
    mask: torch.Tensor
    """[num_decodes, 1, 1, num_blocks * block_size] additive: 0 up to seq_len, -inf past."""


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    num_tokens: int
    """Tokens in the prefill part of the step."""
    block_ids: torch.Tensor
    """[num_prefills * num_blocks] int64 (causal_only: the lone chunk's own blocks)."""
    causal_only: bool
    """A lone chunk with no cached prefix: plain ``is_causal`` attention, no mask or padding."""
    tok_idx: torch.Tensor | None = None
    """[num_prefills * max_query_len] int64: the prefill token each padded query row reads
    (rows past a chunk's end repeat a valid token and are dropped by ``out_idx``)."""
    out_idx: torch.Tensor | None = None
    """[num_tokens] int64: the padded row holding each prefill token's output."""
    mask: torch.Tensor | None = None
    """[num_prefills, 1, max_query_len, num_blocks * block_size] additive causal-with-offset."""


@dataclass(frozen=True, slots=True)
class ReferenceAttentionPlan:
    dtype: torch.dtype
    """Dtype of the masks (the query's)."""
    block_size: int
    window: int | None
    """The sliding window the masks apply (None: global causal attention)."""
    decode: DecodePlan | None
    """None when the step has no decodes."""
    prefill: PrefillPlan | None
    """None when the step has no prefill chunks."""


def reference_plan(
    meta: AttentionMetadata, block_size: int, dtype: torch.dtype, window: int | None = None
) -> ReferenceAttentionPlan:
    """The step's plan from ``meta.reference_plan`` (or, for a sliding `window`,
    ``meta.reference_window_plans``), built there on the first call (or rebuilt when a
    call asks for another dtype or block size)."""
    if window is not None:
        plans = meta.reference_window_plans
        if plans is None:
            plans = meta.reference_window_plans = {}
        plan = plans.get(window)
    else:
        plan = meta.reference_plan
    if plan is None or plan.dtype != dtype or plan.block_size != block_size:
        plan = ReferenceAttentionPlan(
            dtype=dtype,
            block_size=block_size,
            window=window,
            decode=(
                _decode_plan(meta, block_size, dtype, window) if meta.num_decode_tokens else None
            ),
            prefill=_prefill_plan(meta, block_size, dtype, window) if meta.num_prefills else None,
        )
        if window is not None:
            plans[window] = plan
        else:
            meta.reference_plan = plan
    return plan


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_table(
    tables: torch.Tensor, rows: int, max_seq_len: int, block_size: int
) -> torch.Tensor:
    """``[rows, blocks]`` int64 block ids covering ``max_seq_len`` (at least one block); a
    table narrower than that is padded with block 0, whose slots the mask hides."""
    num_blocks = max(1, cdiv(max_seq_len, block_size))
    table = tables[:rows, :num_blocks].long()
    if table.shape[1] < num_blocks:
        table = F.pad(table, (0, num_blocks - table.shape[1]))
    return table


def _additive_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``valid``, -inf elsewhere: an additive mask measured faster than a boolean
    one in the CPU flash kernel."""
    mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    mask.masked_fill_(~valid, float("-inf"))
    return mask


def _decode_plan(
    meta: AttentionMetadata, block_size: int, dtype: torch.dtype, window: int | None
) -> DecodePlan:
    b = meta.num_decode_tokens
    seq_lens = meta.decode_seq_lens[:b].long()  # [B]
    table = _block_table(meta.decode_block_tables, b, meta.decode_max_seq_len, block_size)
    num_blocks = table.shape[1]  # [B, num_blocks]
    pos = torch.arange(num_blocks * block_size, device=seq_lens.device)
    valid = pos[None, :] < seq_lens[:, None]  # [B, L]
    if window is not None:  # the query sits at seq_len - 1 and sees `window` keys
        valid &= pos[None, :] >= seq_lens[:, None] - window
    mask = _additive_mask(valid, dtype)
    return DecodePlan(block_ids=table.reshape(-1), mask=mask[:, None, None, :])  # [B, 1, 1, L]


def _prefill_plan(
    meta: AttentionMetadata, block_size: int, dtype: torch.dtype, window: int | None
) -> PrefillPlan:
    p = meta.num_prefills
    qsl = meta.prefill_query_start_loc[: p + 1].long()  # [P + 1]
    q_lens = qsl[1:] - qsl[:-1]  # [P]
    seq_lens = meta.prefill_seq_lens[:p].long()  # [P]
    device = seq_lens.device
    num_tokens = int(qsl[-1])
    max_q = meta.prefill_max_query_len
    table = _block_table(meta.prefill_block_tables, p, meta.prefill_max_seq_len, block_size)
    num_blocks = table.shape[1]  # [P, num_blocks]
    if p == 1 and int(seq_lens[0]) == num_tokens and (window is None or num_tokens <= window):
        # A lone chunk with no cached prefix (that the window never cuts): plain causal
        # attention over its own keys.
        n_blk = cdiv(num_tokens, block_size)
        return PrefillPlan(num_tokens, table[0, :n_blk].reshape(-1), causal_only=True)
    j = torch.arange(max_q, device=device)
    # Padded layout [P, max_q]: row i, column j holds token qsl[i] + j of the prefill
    # part; columns past q_len point at any valid token and are dropped afterwards.
    tok_idx = (qsl[:-1, None] + j).clamp_(max=max(num_tokens - 1, 0))
    chunk_of_token = torch.repeat_interleave(torch.arange(p, device=device), q_lens)
    t = torch.arange(num_tokens, device=device)
    out_idx = chunk_of_token * max_q + (t - qsl[chunk_of_token])  # [num_tokens]
    # Query j of chunk i sits at position prefix_i + j and sees keys 0..prefix_i + j
    # (with a window: only the last `window` of them). Padding rows (j >= q_len) are
    # placed at the chunk's last position: they see its keys, so never a fully masked
    # row, hence never a NaN.
    q_pos = torch.minimum((seq_lens - q_lens)[:, None] + j, seq_lens[:, None] - 1)  # [P, max_q]
    k_pos = torch.arange(num_blocks * block_size, device=device)
    valid = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
        k_pos[None, None, :] < seq_lens[:, None, None]
    )  # [P, max_q, L]
    if window is not None:
        valid &= k_pos[None, None, :] > q_pos[:, :, None] - window
    return PrefillPlan(
        num_tokens,
        table.reshape(-1),
        causal_only=False,
        tok_idx=tok_idx.reshape(-1),
        out_idx=out_idx,
        mask=_additive_mask(valid, dtype)[:, None],  # [P, 1, max_q, L]
    )
