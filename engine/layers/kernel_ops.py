"""The elementwise kernels a layer calls, as one namespace chosen per model at start-up.

Norm, rotary and activation layers call ``self.ops.<op>``. By default that is the
`kernels` package (the torch reference on CPU, Triton on CUDA, by the tensor's device);
the CPU fast path gives its layers ``kernels.cpu.ops`` (the C kernels, same signatures,
possibly in place). The choice lives on the layers, not in a process-wide switch, so an
exact model and a fast one can run side by side (the quality bar does).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class KernelOps(Protocol):
    """What `kernels` and `kernels.cpu.ops` both provide (see ``kernels.reference``)."""

    def embedding(
        self,
        input_ids: torch.Tensor,
        weight: torch.Tensor,
        blocks: str = "q8_0",
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def head_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int
    ) -> torch.Tensor: ...

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...


def use_kernel_ops(model: nn.Module, ops: KernelOps) -> int:
    """Give every layer of `model` that calls elementwise kernels the namespace `ops`;
    returns how many layers took it."""
    count = 0
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops
            count += 1
    return count
