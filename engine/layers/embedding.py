"""Token embedding and the LM head that may share its weight."""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.layers.kernel_ops import KernelOps
from engine.layers.linear import Linear, Shard, empty_parameter


class VocabEmbedding(nn.Module):
    """Rows of the token table; `scale` multiplies them (Gemma's ``sqrt(hidden)``, rounded
    to the model dtype first, as transformers does: 55.4256 becomes 55.5 in bf16)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        scale: float | None = None,
    ):
        super().__init__()
        self.weight = empty_parameter((vocab_size, hidden_size), dtype, device)
        self.ops: KernelOps = kernels
        self.blocks = "q8_0"
        """The GGUF format of a table held as the file's rows (uint8; the fast path's
        `gather_table_from_blocks`)."""
        if scale is None:
            self.scale: torch.Tensor | None = None
        else:
            scale_t = torch.tensor(scale, dtype=torch.float32).to(device=device, dtype=dtype)
            self.register_buffer("scale", scale_t, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.ops.embedding(input_ids, self.weight, self.blocks, self.scale)  # [T, H]


def lm_head(
    embedding: VocabEmbedding, tied: bool, checkpoint: str, dtype: torch.dtype, device: torch.device
) -> Linear:
    """The ``[vocab, hidden]`` output projection. A tied head shares the embedding's
    Parameter (no copy); `checkpoint` is then the embedding's name, which a quantized
    method reads its blocks from."""
    vocab, hidden = embedding.weight.shape
    head = Linear(hidden, vocab, [Shard(checkpoint, vocab)], bias=False, dtype=dtype, device=device)
    if tied:
        head.weight = embedding.weight
    return head
