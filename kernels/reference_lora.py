"""Batched LoRA, the torch reference: one step, tokens of many adapters and of the base.

The punica / S-LoRA design: every adapter that may run is *resident* in one of
``max_loras`` slots of stacked buffers per linear layer, sized by the largest rank
(``LoRAStack``); each token of the step carries the slot of its request's adapter, or
-1 for the base (``LoRAStep``). A linear's output then gets ``y += scale * (x @ A.T) @ B.T``
row by row, in two GEMMs: *shrink* (``[T, in] -> [T, S, R]``, one low-rank projection
per shard) and *expand* (``[T, S, R] -> [T, out]``, each shard into its row range).

The reference groups the step's tokens by slot and runs each group through
``F.linear`` at the adapter's true rank, op for op what PEFT's ``lora.Linear`` computes
(``result + lora_B(lora_A(x)) * scaling``), so the exact mode stays token-identical to
transformers + PEFT. The Triton version (``kernels/triton/lora.py``) reads the same
buffers per token (BGMV) and adds the zero padding of short ranks, which changes no bit
of a sum but its order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["LoRAGroup", "LoRAStack", "LoRAStep", "add_lora", "lora_expand", "lora_shrink"]


@dataclass(slots=True)
class LoRAStack:
    """One linear layer's resident adapters (``L`` slots, ``S`` shards, rank ``R``)."""

    lora_a: torch.Tensor
    """``[L, S, R, in]``: each shard's A (``lora_A.weight``, ``[r, in]``) in rows ``:r``."""
    lora_b: torch.Tensor
    """``[L, out, R]``: each shard's B (``lora_B.weight``, ``[rows, r]``) in its row range
    of the fused output, columns ``:r``; zero where the adapter does not target a shard."""
    scales: torch.Tensor
    """``[L, S]`` float32: ``lora_alpha / r`` (rsLoRA: ``/ sqrt(r)``), 0 where untargeted."""
    shard_bounds: tuple[int, ...]
    """``S + 1`` row offsets: shard ``s`` owns output rows ``[bounds[s], bounds[s+1])``."""
    ranks: list[list[int]]
    """``ranks[slot][shard]``: the adapter's true rank there, 0 when it does not target it."""
    row_shard: torch.Tensor
    """``[out]`` int32: the shard of each output row (the Triton expand reads it)."""
    scale_values: list[list[float]]
    """`scales` as Python floats (the reference multiplies by these, as PEFT does)."""


@dataclass(frozen=True, slots=True)
class LoRAGroup:
    """The tokens of one slot in the step."""

    slot: int
    rows: torch.Tensor
    """int64 token indices of the step's flattened batch."""


@dataclass(frozen=True, slots=True)
class LoRAStep:
    """Which adapter each token of one step uses."""

    token_slots: torch.Tensor
    """``[T]`` int32: the token's slot, or -1 for the base model."""
    groups: tuple[LoRAGroup, ...]
    """The same, grouped by slot (base tokens in none); built once per step on the host."""

    @classmethod
    def build(cls, token_slots: list[int], device: torch.device) -> LoRAStep:
        """From the step's per-token slots (-1: base), in token order."""
        rows_of: dict[int, list[int]] = {}
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                rows_of.setdefault(slot, []).append(row)
        groups = tuple(
            LoRAGroup(slot, torch.tensor(rows, dtype=torch.long, device=device))
            for slot, rows in sorted(rows_of.items())
        )
        return cls(torch.tensor(token_slots, dtype=torch.int32, device=device), groups)


def lora_shrink(x: torch.Tensor, stack: LoRAStack, step: LoRAStep) -> torch.Tensor:
    """``[T, in] -> [T, S, R]``: ``x @ A.T`` for each token's slot and each shard (zeros
    for base tokens, untargeted shards and the padding past an adapter's rank)."""
    _, num_shards, max_rank, _ = stack.lora_a.shape
    h = x.new_zeros((x.shape[0], num_shards, max_rank))  # [T, S, R]
    for group in step.groups:
        xs = x.index_select(0, group.rows)  # [n, in]
        for shard, rank in enumerate(stack.ranks[group.slot]):
            if rank:
                a = stack.lora_a[group.slot, shard, :rank]  # [r, in]
                h[group.rows, shard, :rank] = F.linear(xs, a)
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, stack: LoRAStack, step: LoRAStep) -> torch.Tensor:
    """``y += (h @ B.T) * scale`` per shard, in place; returns ``y``."""
    bounds = stack.shard_bounds
    for group in step.groups:
        scales = stack.scale_values[group.slot]
        for shard, rank in enumerate(stack.ranks[group.slot]):
            if not rank:
                continue
            lo, hi = bounds[shard], bounds[shard + 1]
            b = stack.lora_b[group.slot, lo:hi, :rank]  # [rows, r]
            delta = F.linear(h[group.rows, shard, :rank], b) * scales[shard]  # [n, rows]
            y[group.rows, lo:hi] = y[group.rows, lo:hi] + delta
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, step: LoRAStep) -> torch.Tensor:
    """A linear layer's LoRA term for the whole step: ``y[t] += scale * B(A(x[t]))`` with
    the A/B of token ``t``'s slot (``y`` is the base output ``[T, out]``, updated in place)."""
    if not step.groups:
        return y
    return lora_expand(y, lora_shrink(x, stack, step), stack, step)
