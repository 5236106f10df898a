"""The gated MLP every dense decoder here uses: ``down(act(gate(x)) * up(x))``."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.activation import gated_activation
from engine.layers.linear import Linear, Shard


class GatedMLP(nn.Module):
    """Gate and up fused into one ``[2 * I, H]`` linear (gate rows first, the layout the
    gated activations expect), then the activation and ``down_proj``.

    `fused_checkpoint`: the checkpoint already stores one ``gate_up_proj`` tensor (Phi-3);
    otherwise ``gate_proj`` and ``up_proj`` are two shards of the fused weight. The MoE
    experts reuse the same activation layers (engine/layers/activation.py).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        prefix: str,
        *,
        activation: str = "silu",
        bias: bool = False,
        fused_checkpoint: bool = False,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        inter = intermediate_size
        self.intermediate_size = inter
        if fused_checkpoint:
            shards = [Shard(f"{prefix}.gate_up_proj", 2 * inter)]
        else:
            shards = [Shard(f"{prefix}.gate_proj", inter), Shard(f"{prefix}.up_proj", inter)]
        self.gate_up_proj = Linear(
            hidden_size, 2 * inter, shards, bias=bias, dtype=dtype, device=device
        )
        self.down_proj = Linear(
            inter, hidden_size, [Shard(f"{prefix}.down_proj", hidden_size)], bias=bias,
            dtype=dtype, device=device,
        )  # fmt: skip
        self.act_fn = gated_activation(activation)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden)))  # [T, H]
