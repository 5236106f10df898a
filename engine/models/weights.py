"""Checkpoint tensors → a native model's parameters, for every model file.

The model's module tree mirrors the Hugging Face names (``model.layers.3.self_attn.q_norm``
and so on), with one exception: a fused `Linear` holds several checkpoint tensors, named
by its `Shard`s. So the targets are found, not listed per architecture: each `Linear`
shard's ``.weight``/``.bias`` (a row slice of the fused parameter), and every other
parameter under its own module path. A new architecture that composes the layers gets
its loader for free, and a wrong checkpoint still fails loudly (an unknown tensor, a
shape mismatch, a parameter left unwritten).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm

Target = tuple[torch.Tensor, int | None, int]
"""(parameter, first row or None for the whole tensor, rows)."""


def weight_targets(model: nn.Module) -> dict[str, Target]:
    """HF tensor name → where it goes in `model`."""
    targets: dict[str, Target] = {}
    linear_params: set[int] = set()
    # A tied LM head is a `Linear` whose Parameter is the embedding's and whose one shard
    # is named after the embedding, so both resolve to ``model.embed_tokens.weight``.
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        linear_params.add(id(module.weight))
        if module.bias is not None:
            linear_params.add(id(module.bias))
        single = len(module.shards) == 1
        for shard, start in module.shard_offsets():
            row = None if single else start
            targets[f"{shard.checkpoint}.weight"] = (module.weight, row, shard.rows)
            if module.bias is not None:
                targets[f"{shard.checkpoint}.bias"] = (module.bias, row, shard.rows)
    for name, param in model.named_parameters():  # shared (tied) parameters appear once
        if id(param) not in linear_params:
            targets[name] = (param, None, 0)
    return targets


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    ignore: Collection[str] = (),
    ignore_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",),
) -> None:
    """Copy HF-named checkpoint tensors into `model` (cast to its dtype, on its device).

    `ignore`: names to skip (a tied head some checkpoints store anyway); names ending in
    `ignore_suffixes` are skipped too (rotary tables are recomputed). Raises on an unknown
    tensor, a shape mismatch or any target left unwritten. Norms with a
    ``weight_offset`` (Gemma's ``1 + w``) get it added once, after the copy. A model
    given ``deferred_weights`` (`load_model`'s `defer_linears`) leaves the linear
    weights it wants unread but their sample rows (engine/layers/deferred_weights.py).
    """
    targets = weight_targets(model)
    deferred = getattr(model, "deferred_weights", None)
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if name in ignore or name.endswith(ignore_suffixes):
                continue
            target = targets.get(name)
            if target is None:
                raise ValueError(
                    f"unexpected tensor {name!r} in checkpoint for {type(model).__name__}"
                )
            param, start, length = target
            dst = param if start is None else param.narrow(0, start, length)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            if deferred is not None and deferred.wants(param):
                deferred.record(name, param, start, length, tensor)
            else:
                dst.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")
        for module in model.modules():
            if isinstance(module, RMSNorm) and module.weight_offset:
                module.weight.add_(module.weight_offset)
