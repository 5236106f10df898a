"""Per-step attention metadata: where every token's K/V lives in the paged cache.

Built once per engine step by the model runner and shared by every layer. Tokens of
the step are laid out decodes first (one token per sequence), then prefill chunks
(one contiguous run of tokens per sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.reference_plan import ReferenceAttentionPlan


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
    """The torch reference backend's gather indices and masks for this step, built from
    the fields above by the first layer and reused by the others (``kernels.reference_plan``).
    Whoever reuses one metadata object for a new step (a CUDA graph replay) resets it."""
