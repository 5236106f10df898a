"""The linear layer and the methods that compute it.

A `Linear` holds a dense ``[out_features, in_features]`` weight (what the checkpoint
gives) and a `LinearMethod` that computes ``x @ W.T + b``. The model file builds every
linear with the exact method; at start-up the engine may hand a layer another method
(`engine/backends.py` `choose_backends`), which may repack the weight into its own layout and free the
dense copy. The model file never learns which kernel runs (vLLM's ``LinearBase`` with its
``quant_method``).

Fused projections (q/k/v, gate/up) are one `Linear` whose rows are the checkpoint's
separate tensors one after the other; `Shard` names each slice, so checkpoint loading and
a quantized method's repacking find their tensors without knowing the architecture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from engine.lora.layer import LinearLoRA

__all__ = ["Linear", "LinearMethod", "Shard", "UnquantizedLinearMethod", "empty_parameter"]


def empty_parameter(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> nn.Parameter:
    """An uninitialised, frozen parameter: loading overwrites every element."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


@dataclass(frozen=True, slots=True)
class Shard:
    """One checkpoint tensor's rows inside a (possibly fused) linear weight."""

    checkpoint: str
    """The Hugging Face module name, e.g. ``model.layers.0.self_attn.q_proj`` (its
    ``.weight`` and ``.bias`` are the tensors)."""
    rows: int
    rotary_heads: int | None = None
    """For q/k projections: the head count whose rows GGUF converters permute for rotary
    (engine/layers/gguf_linear.py undoes it); None for every other tensor."""


class LinearMethod:
    """How a `Linear` computes: owns the weight's layout and the kernel.

    `apply` is the only call on the forward path. `name` is what the start-up log and
    /version count.
    """

    name = "base"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """The dense weight in the model dtype through ``F.linear`` (oneDNN on CPU, cuBLAS on
    GPU): op for op what transformers computes, so the exact mode stays token-identical."""

    name = "dense"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


UNQUANTIZED = UnquantizedLinearMethod()


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` computed by `self.method`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        shards: list[Shard],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        if sum(s.rows for s in shards) != out_features:
            raise ValueError(f"shards cover {sum(s.rows for s in shards)} of {out_features} rows")
        self.in_features = in_features
        self.out_features = out_features
        self.shards = shards
        self.weight = empty_parameter((out_features, in_features), dtype, device)
        self.bias = empty_parameter((out_features,), dtype, device) if bias else None
        self.method: LinearMethod = UNQUANTIZED
        self.packed: object | None = None
        """The method's own copy of the weight (e.g. GGUF blocks), when it keeps one."""
        self.lora: LinearLoRA | None = None
        """Resident LoRA adapters (`engine/lora/manager.py` attaches them with
        --enable-lora): their term is added after the method, whichever it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        if self.lora is not None:
            y = self.lora.apply(x, y)
        return y

    def shard_offsets(self) -> list[tuple[Shard, int]]:
        """Each shard with its first row."""
        out, start = [], 0
        for shard in self.shards:
            out.append((shard, start))
            start += shard.rows
        return out

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, method={self.method.name}"


def non_linear_parameter_ids(model: nn.Module) -> set[int]:
    """Ids of the parameters some module other than a `Linear` owns: a tied LM head's weight
    is the token table, which lookups read, so packing must not free it nor loading skip it."""
    return {
        id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(False)
    }
