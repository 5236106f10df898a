"""The element type linear weights and embedding tables are held in between loading and
packing.

On CPU the model is built in float32. A checkpoint stored in bfloat16 or float16 (most are)
was widened into it on load, so a model needed 4 bytes a weight at start-up even when the
fast path then packs every linear in 2 (`engine/layers/half_weights.py`): twice the
checkpoint's size at peak, which decided what fit on a host (a 0.9 B-parameter bf16 model
peaked at 4.0 GiB for its 1.8 GB of weights; an 8 B one needs 30 GB) and cost a float32
copy, conversion and scan of every weight.

`hold_weights_in` gives the linear weights, MoE expert stacks and token embedding tables
the checkpoint's own 16-bit type before loading, so the loader copies each tensor bit for
bit and packing reads it as is; the C kernels' gather widens a table's rows as it reads
them, so the table stays in 16 bits on the fast path (a tied LM head is packed from it).
Whatever then runs dense (the exact mode, a layer the kernels can't take, a fallback) is
widened back by `widen_dense_weights`: a 16-bit value widens to float32 exactly, so it
computes what it computed when the loader widened it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear
from engine.layers.moe import FusedMoE

__all__ = ["hold_weights_in", "widen_dense_weights"]


def _shared_ids(model: nn.Module) -> set[int]:
    return {
        id(p)
        for m in model.modules()
        if not isinstance(m, (Linear, FusedMoE, VocabEmbedding))
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


def _retype_tables(model: nn.Module, dtype: torch.dtype, make) -> int:
    """Replace every embedding table not of `dtype` by ``make(table)``, and point each
    linear that shared it (a tied LM head) at the new one; returns how many."""
    tables: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, VocabEmbedding) and module.weight.dtype != dtype:
            tables[id(module.weight)] = module.weight = nn.Parameter(
                make(module.weight), requires_grad=False
            )
    for module in model.modules():
        if isinstance(module, Linear) and id(module.weight) in tables:
            module.weight = tables[id(module.weight)]
    return len(tables)


def hold_weights_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Reallocate the (not yet loaded) linear weights and token embedding tables of `model`
    as uninitialised `dtype` tensors; returns how many weights now have it. Call between
    building the model and loading its checkpoint. (An expert linear views its MoE
    layer's new stack, and a tied head the new table: both already have `dtype`.)"""

    def make(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype, device=t.device)

    held = _retype_tables(model, dtype, make)
    shared = _shared_ids(model)
    for module in model.modules():
        if isinstance(module, FusedMoE):
            _expert_stacks(module, make)
            held += 2
    for module in model.modules():
        if isinstance(module, Linear):
            if id(module.weight) in shared or module.weight.dtype == dtype:
                continue
            module.weight = nn.Parameter(make(module.weight), requires_grad=False)
            held += 1
    return held


def widen_dense_weights(model: nn.Module, dtype: torch.dtype, tables: bool) -> int:
    """Give every linear weight still held dense (not packed away) the model's `dtype`
    again, exactly, and with `tables` (the exact mode, whose torch gather reads float32
    alone) the embedding tables too; returns how many were widened. The C kernels' gather
    widens a 16-bit table's rows itself, so the fast path keeps it in 16 bits. (A widened
    MoE stack re-points its expert linears, which then have `dtype`; a released one's
    experts are all packed.)"""

    def make(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype)

    widened = _retype_tables(model, dtype, make) if tables else 0
    for module in model.modules():
        if isinstance(module, FusedMoE) and module.w13.numel() and module.w13.dtype != dtype:
            _expert_stacks(module, make)
            widened += 2
    for module in model.modules():
        if not isinstance(module, Linear) or module.packed is not None:
            continue
        weight = module.weight
        if weight.numel() and weight.dtype != dtype:
            module.weight = nn.Parameter(make(weight), requires_grad=False)
            widened += 1
    return widened
