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


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` (GeGLU: Gemma's ``gelu_pytorch_tanh``), gate rows first:
    the torch op on CUDA and in the exact mode, the C kernel on the fast path (since stop
    47; a Gemma 3 forward is then a step program)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: KernelOps = kernels

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_tanh_and_mul(gate_up)


def gated_activation(name: str) -> nn.Module:
    """The gated activation layer for a config's ``hidden_act`` / ``hidden_activation``."""
    if name == "silu":
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return GeluTanhAndMul()
    raise ValueError(f"activation {name!r} is not supported (silu, gelu_pytorch_tanh)")
