"""The element type linear weights are held in between loading and packing.

On CPU the model is built in float32. A checkpoint stored in bfloat16 or float16 (most are)
was widened into it on load, so a model needed 4 bytes a weight at start-up even when the
fast path then packs every linear in 2 (`engine/layers/half_weights.py`): twice the
checkpoint's size at peak, which decided what fit on a host (a 0.9 B-parameter bf16 model
peaked at 5.4 GiB for its 1.8 GB of weights) and cost a float32 copy, conversion and scan
of every weight.

`hold_linears_in` gives the linear weights (and MoE expert stacks) the checkpoint's own
16-bit type before loading, so the loader copies each tensor bit for bit and packing reads
it as is. Whatever then runs dense (the exact mode, a layer the kernels can't take, a
fallback) is widened back by `widen_dense_linears`: a 16-bit value widens to float32
exactly, so it computes what it computed when the loader widened it.

A weight shared with a module that is not a `Linear` (the token embedding a tied LM head
reads) keeps the model's type: the embedding lookup reads it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.layers.moe import FusedMoE

__all__ = ["hold_linears_in", "widen_dense_linears"]


def _shared_ids(model: nn.Module) -> set[int]:
    return {
        id(p)
        for m in model.modules()
        if not isinstance(m, (Linear, FusedMoE))
        for p in m.parameters(recurse=False)
    }


def _expert_stacks(moe: FusedMoE, make) -> None:
    """Replace `moe`'s stacked expert weights by ``make(stack)`` and point each expert
    linear at its slice of the new stacks."""
    moe.w13 = make(moe.w13)
    moe.w2 = make(moe.w2)
    for e, (gate_up, down) in enumerate(zip(moe.gate_up, moe.down, strict=True)):
        gate_up.weight = nn.Parameter(moe.w13[e], requires_grad=False)
        down.weight = nn.Parameter(moe.w2[e], requires_grad=False)


def hold_linears_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Reallocate the (not yet loaded) linear weights of `model` as uninitialised `dtype`
    tensors; returns how many weights now have it. Call between building the model and
    loading its checkpoint."""

    def make(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype, device=t.device)

    shared = _shared_ids(model)
    held = 0
    experts: set[int] = set()
    for module in model.modules():
        if isinstance(module, FusedMoE):
            _expert_stacks(module, make)
            experts |= {id(m) for m in (*module.gate_up, *module.down)}
            held += 2
    for module in model.modules():
        if isinstance(module, Linear) and id(module) not in experts:
            if id(module.weight) in shared or module.weight.dtype == dtype:
                continue
            module.weight = nn.Parameter(make(module.weight), requires_grad=False)
            held += 1
    return held


def widen_dense_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Give every linear weight still held dense (not packed away) the model's `dtype`
    again, exactly; returns how many were widened."""

    def make(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype)

    widened = 0
    experts: set[int] = set()
    for module in model.modules():
        if isinstance(module, FusedMoE):
            experts |= {id(m) for m in (*module.gate_up, *module.down)}
            if module.w13.numel() and module.w13.dtype != dtype:
                _expert_stacks(module, make)
                widened += 2
    for module in model.modules():
        if not isinstance(module, Linear) or id(module) in experts:
            continue
        weight = module.weight
        if weight.numel() and weight.dtype != dtype:
            module.weight = nn.Parameter(make(weight), requires_grad=False)
            widened += 1
    return widened
