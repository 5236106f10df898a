"""The LoRA hook of one `Linear`: its stacked slots and the step it reads them for.

`Linear.forward` computes its output with its `LinearMethod` (dense, GGUF blocks, int8:
whichever start-up chose) and then, when LoRA is on, hands it here, so the adapters
work over every linear method without any method knowing of them. The step's per-token
slots live on one `LoRAContext` shared by every layer, set by the runner before the
forward and cleared after (None: no token of the step uses an adapter; nothing runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from kernels import LoRAStack, LoRAStep
from kernels.cpu import ops as cpu_ops


@dataclass(slots=True)
class LoRAContext:
    step: LoRAStep | None = None


class LinearLoRA:
    """Stacked A/B of ``num_slots`` adapters for one (possibly fused) linear layer."""

    def __init__(
        self,
        context: LoRAContext,
        shard_rows: list[int],
        in_features: int,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        native: bool = False,
    ) -> None:
        self.context = context
        self.add_lora = cpu_ops.add_lora if native else kernels.add_lora
        """The C kernel for a linear the CPU fast path computes (`native`; one call per
        linear and step instead of two torch ops per adapter and shard), else the
        dispatched reference / Triton op."""
        bounds = [0]
        for rows in shard_rows:
            bounds.append(bounds[-1] + rows)
        num_shards, out = len(shard_rows), bounds[-1]
        self.stack = LoRAStack(
            lora_a=torch.zeros(
                (num_slots, num_shards, max_rank, in_features), dtype=dtype, device=device
            ),
            lora_b=torch.zeros((num_slots, out, max_rank), dtype=dtype, device=device),
            scales=torch.zeros((num_slots, num_shards), dtype=torch.float32, device=device),
            shard_bounds=tuple(bounds),
            ranks=[[0] * num_shards for _ in range(num_slots)],
            row_shard=torch.repeat_interleave(
                torch.arange(num_shards, dtype=torch.int32),
                torch.tensor(shard_rows),
            ).to(device),
            scale_values=[[0.0] * num_shards for _ in range(num_slots)],
        )

    def clear_slot(self, slot: int) -> None:
        stack = self.stack
        stack.lora_a[slot].zero_()
        stack.lora_b[slot].zero_()
        stack.scales[slot].zero_()
        stack.ranks[slot] = [0] * len(stack.ranks[slot])
        stack.scale_values[slot] = [0.0] * len(stack.scale_values[slot])

    def set_shard(
        self, slot: int, shard: int, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
    ) -> None:
        """Copy one shard's A ``[r, in]`` and B ``[rows, r]`` into the slot."""
        stack = self.stack
        rank = int(lora_a.shape[0])
        lo, hi = stack.shard_bounds[shard], stack.shard_bounds[shard + 1]
        stack.lora_a[slot, shard, :rank].copy_(lora_a)
        stack.lora_b[slot, lo:hi, :rank].copy_(lora_b)
        stack.scales[slot, shard] = scale
        stack.ranks[slot][shard] = rank
        stack.scale_values[slot][shard] = scale

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the method's output for ``x``) plus each token's adapter term."""
        step = self.context.step
        if step is None:
            return y
        return self.add_lora(y, x, self.stack, step)
