"""Per-step attention metadata: where every token's K/V lives in the paged cache.

Built once per engine step (by the attention backend, `AttentionMetadata.build`, the one
constructor) and shared by every layer. Tokens of the step are laid out decodes first
(one token per sequence), then prefill chunks (one contiguous run of tokens per sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from kernels.reference_plan import ReferenceAttentionPlan


class SeqSpan(NamedTuple):
    """One sequence's part of a step: what is cached, what is new, where it lives."""

    num_computed_tokens: int
    """Tokens already in the cache (the new ones start at this position)."""
    num_new_tokens: int
    """1 for a decode; the chunk length for a prefill."""
    block_ids: Sequence[int]
    """The sequence's cache blocks, in position order."""


def _block_table(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    padded = [list(r) + [0] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(rows), width)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] int64: flat cache slot (block_id * block_size + offset) of each new token."""
    block_size: int

    num_decode_tokens: int
    """The first num_decode_tokens tokens are decodes, one per sequence."""
    decode_block_tables: torch.Tensor
    """[num_decodes, max_blocks] int32 (padding entries are 0 and never read past seq_len)."""
    decode_seq_lens: torch.Tensor
    """[num_decodes] int32: context length including the new token."""
    decode_max_seq_len: int

    num_prefills: int
    prefill_query_start_loc: torch.Tensor
    """[num_prefills + 1] int32: offsets of each chunk inside the prefill part of the batch."""
    prefill_block_tables: torch.Tensor
    """[num_prefills, max_blocks] int32."""
    prefill_seq_lens: torch.Tensor
    """[num_prefills] int32: context length including this chunk (query j of a chunk of
    length q sits at position seq_len - q + j and sees keys 0 .. seq_len - q + j)."""
    prefill_max_query_len: int
    prefill_max_seq_len: int

    seq_block_tables: torch.Tensor | None = None
    """[num_seqs, max_blocks] int32: every sequence of the step in token order (decodes,
    then prefills); read by kernels that look up each token's own sequence."""
    token_seq: torch.Tensor | None = None
    """[num_tokens] int32: the row of ``seq_block_tables`` each token belongs to."""
    token_ctx: torch.Tensor | None = None
    """[num_tokens] int32: keys each token attends to (its position + 1)."""
    max_ctx: int = 0

    reference_plan: ReferenceAttentionPlan | None = None
    """The torch reference kernels' gather indices and masks for this step, built from the
    fields above by the paged attention backend before the forward
    (``kernels.reference_plan``) and read by every layer."""
    reference_window_plans: dict[int, ReferenceAttentionPlan] | None = None
    """The same per sliding window (layers with a window read these)."""

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqSpan],
        slot_mapping: Sequence[int],
        block_size: int,
        device: torch.device,
        *,
        token_index: bool = False,
        num_decodes: int | None = None,
    ) -> AttentionMetadata:
        """The metadata of one step: `seqs` decodes first, then prefill chunks, and the
        flat cache slot of every new token. `token_index` adds the per-token fields
        (``seq_block_tables``, ``token_seq``, ``token_ctx``) that kernels attending token
        by token read. The leading one-token sequences are the decodes, unless
        `num_decodes` says fewer (a one-token prefill chunk: kernel tests)."""
        if num_decodes is None:
            num_decodes = 0
            while num_decodes < len(seqs) and seqs[num_decodes].num_new_tokens == 1:
                num_decodes += 1
        decodes, prefills = seqs[:num_decodes], seqs[num_decodes:]
        if any(s.num_new_tokens != 1 for s in decodes):
            raise ValueError("decodes (one new token) must come before every prefill chunk")
        decode_lens = [s.num_computed_tokens + 1 for s in decodes]
        prefill_lens = [s.num_computed_tokens + s.num_new_tokens for s in prefills]
        query_lens = [s.num_new_tokens for s in prefills]
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        meta = cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            block_size=block_size,
            num_decode_tokens=num_decodes,
            decode_block_tables=_block_table([s.block_ids for s in decodes], device),
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32, device=device),
            decode_max_seq_len=max(decode_lens, default=0),
            num_prefills=len(prefills),
            prefill_query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            prefill_block_tables=_block_table([s.block_ids for s in prefills], device),
            prefill_seq_lens=torch.tensor(prefill_lens, dtype=torch.int32, device=device),
            prefill_max_query_len=max(query_lens, default=0),
            prefill_max_seq_len=max(prefill_lens, default=0),
        )
        if token_index:
            ctx: list[int] = []
            token_seq: list[int] = []
            for row, s in enumerate(seqs):
                ctx.extend(
                    range(s.num_computed_tokens + 1, s.num_computed_tokens + s.num_new_tokens + 1)
                )
                token_seq.extend([row] * s.num_new_tokens)
            meta.seq_block_tables = _block_table([s.block_ids for s in seqs], device)
            meta.token_seq = torch.tensor(token_seq, dtype=torch.int32, device=device)
            meta.token_ctx = torch.tensor(ctx, dtype=torch.int32, device=device)
            meta.max_ctx = max(ctx, default=0)
        return meta

    @classmethod
    def for_decode_graph(
        cls,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        block_size: int,
        max_seq_len: int,
    ) -> AttentionMetadata:
        """A pure-decode step whose tensors are persistent buffers a CUDA graph reads
        (engine/cuda_graphs.py); `max_seq_len` is the longest context the graph allows,
        so kernel choices made from it are the same at capture and at replay."""
        dev = slot_mapping.device
        empty = torch.zeros(0, dtype=torch.int32, device=dev)
        return cls(
            slot_mapping=slot_mapping,
            block_size=block_size,
            num_decode_tokens=slot_mapping.shape[0],
            decode_block_tables=block_tables,
            decode_seq_lens=seq_lens,
            decode_max_seq_len=max_seq_len,
            num_prefills=0,
            prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=dev),
            prefill_block_tables=empty.reshape(0, 1),
            prefill_seq_lens=empty,
            prefill_max_query_len=0,
            prefill_max_seq_len=0,
        )
