"""Gated activations of fused gate/up projections."""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.layers.kernel_ops import KernelOps


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` of a ``[T, 2 * I]`` gate/up output (gate rows first)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: KernelOps = kernels

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(gate_up)
