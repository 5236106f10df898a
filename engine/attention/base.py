"""What every attention backend does: build a step's metadata, run a layer's attention."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kernels.metadata import AttentionMetadata, SeqSpan

if TYPE_CHECKING:
    from engine.layers.attention import Attention


class AttentionBackend:
    """One per engine. `build_metadata` runs once per step; `forward` once per layer."""

    name = "base"
    token_index = False
    """Whether `build_metadata` adds the per-token fields (token_seq, token_ctx)."""

    def build_metadata(
        self,
        seqs: Sequence[SeqSpan],
        slot_mapping: Sequence[int],
        block_size: int,
        device: torch.device,
        num_decodes: int | None = None,
    ) -> AttentionMetadata:
        meta = AttentionMetadata.build(
            seqs, slot_mapping, block_size, device, token_index=self.token_index,
            num_decodes=num_decodes,
        )  # fmt: skip
        self.prepare(meta, block_size)
        return meta

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Per-step work every layer shares (called again before each CUDA graph replay
        of a reused metadata object); nothing by default."""

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError
