"""RMSNorm, alone or fused with the residual add of the vLLM residual stream."""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.layers.kernel_ops import KernelOps
from engine.layers.linear import empty_parameter


class RMSNorm(nn.Module):
    """``forward(x)`` → ``norm(x)``; ``forward(x, residual)`` → ``(norm(x + residual), x +
    residual)``, which saves one read and write of the stream per norm. The kernel backend
    may do the fused form in place (kernels/cpu/ops.py); callers never reuse `x`.
    `ops` is the kernel namespace chosen at start-up (engine/layers/kernel_ops.py).

    `weight_offset`: Gemma's checkpoints store ``w`` and multiply by ``(1 + w)``. The loader
    adds the offset to the weight once (engine/models/weights.py), so every kernel (torch,
    Triton, C) runs the plain ``weight * normed`` form unchanged; in float32 that is the
    same arithmetic as Gemma's (the sum ``1 + w`` is float32 there too).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device,
        weight_offset: float = 0.0,
    ):
        super().__init__()
        self.eps = float(eps)
        self.weight = empty_parameter((hidden_size,), dtype, device)
        self.weight_offset = float(weight_offset)
        self.ops: KernelOps = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def per_head(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """This norm (head-wide) over each of the `heads` heads of ``x`` ``[T, heads * hd]``."""
        return self.ops.head_rms_norm(x, self.weight, self.eps, heads)
