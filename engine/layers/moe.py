"""The sparse mixture-of-experts layer: a top-k router and the experts it sends tokens to.

`SparseMoeBlock` = `TopKRouter` + `FusedMoE`. The router picks ``top_k`` experts per
token and their weights; the experts compute the gated MLPs of the routed rows, batched
per expert (``kernels/reference_moe.py`` `moe_combine`: one sort, one matmul per expert
over all its rows; no loop over tokens).

Expert weights are stored once, stacked: ``w13`` [E, 2 * I, H] (gate rows, then up rows,
as the dense MLP's fused gate/up) and ``w2`` [E, H, I], which is the layout the grouped
GEMM kernel reads. Each expert's slice is also a `Linear` (``gate_up[e]``, ``down[e]``)
whose weight is a view of the stacked tensor and whose `Shard`s name the checkpoint's
per-expert tensors (``experts.N.w1/w3/w2`` for Mixtral, ``experts.N.gate_proj/up_proj/
down_proj`` for Qwen3-MoE). So checkpoint loading fills the stacked tensors through the
same shard mechanism as every dense linear (no MoE case in the loader), and on CPU the
experts run through the same linear methods as dense layers.

*How* the experts compute is the layer's `MoEMethod`, chosen at start-up like a linear
method (``engine/backends.py``): `ExpertLinearsMoEMethod` (each expert's `Linear`
through its own linear method; the default, the CPU path) or `GroupedGemmMoEMethod`
(``kernels.fused_moe``: the Triton grouped GEMM on CUDA). The model file never learns
which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.layers.linear import Linear, Shard
from kernels.reference_moe import ACTIVATIONS, moe_combine

__all__ = [
    "PACKED_EXPERTS",
    "ExpertLinearsMoEMethod",
    "ExpertNames",
    "FusedMoE",
    "GroupedGemmMoEMethod",
    "MoEMethod",
    "PackedExpertsMoEMethod",
    "SparseMoeBlock",
    "TopKRouter",
    "use_moe_method",
]


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """The checkpoint's module names of expert ``e`` (format strings over ``{e}``)."""

    gate: str
    up: str
    down: str


class TopKRouter(nn.Module):
    """``router_logits = x @ W.T (+ b)`` → the top-k experts of each token and their weights.

    ``scoring``:
      - ``"softmax_topk"`` (Mixtral, Qwen3-MoE): softmax over all experts in float32, then
        top-k; renormalised over the k when ``norm_topk_prob``;
      - ``"topk_softmax"`` (gpt-oss): top-k of the logits, softmax over those k.
    ``weights_in_model_dtype``: cast the weights back to the model dtype (Qwen3-MoE, gpt-oss)
    or keep them float32 (Mixtral), where transformers does.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        checkpoint: str,
        *,
        scoring: str = "softmax_topk",
        norm_topk_prob: bool = True,
        weights_in_model_dtype: bool = False,
        bias: bool = False,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        if scoring not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"unknown router scoring {scoring!r}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in 1..{num_experts} (the expert count)")
        self.top_k = top_k
        self.scoring = scoring
        self.norm_topk_prob = norm_topk_prob
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = Linear(
            hidden_size, num_experts, [Shard(checkpoint, num_experts)], bias=bias, dtype=dtype,
            device=device,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] → (topk_weights [T, k], topk_ids [T, k] int64)."""
        logits = self.gate(x)  # [T, E]
        if self.scoring == "topk_softmax":
            values, ids = torch.topk(logits, self.top_k, dim=-1)
            weights = F.softmax(values, dim=1, dtype=values.dtype)
        else:
            probs = F.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, ids


class MoEMethod:
    """How a `FusedMoE` computes its routed experts (the MoE counterpart of
    ``LinearMethod``); `name` is what the start-up log reports."""

    name = "base"

    def block(self, layer: FusedMoE, router: TopKRouter, x: torch.Tensor) -> torch.Tensor:
        """The whole MoE block of `layer`: `router` picks each token's experts, `apply`
        computes them (a method may do both at once)."""
        topk_weights, topk_ids = router(x)
        return self.apply(layer, x, topk_weights, topk_ids)

    def apply(
        self,
        layer: FusedMoE,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class ExpertLinearsMoEMethod(MoEMethod):
    """Tokens grouped per expert, each group through that expert's `Linear` modules: their
    linear methods compute (``F.linear`` on the dense weight in the exact mode), so the
    experts are computed like any dense layer."""

    name = "expert-linears"

    def apply(
        self,
        layer: FusedMoE,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
            return layer.down[e](layer.act(layer.gate_up[e](xe)))

        return moe_combine(x, topk_weights, topk_ids, layer.num_experts, expert)


class GroupedGemmMoEMethod(MoEMethod):
    """``kernels.fused_moe`` over the stacked weights: one grouped GEMM launch per
    projection on CUDA (Triton), the torch reference elsewhere. Needs the dense stacked
    weights, so it is only chosen in the exact mode."""

    name = "grouped-gemm"

    def apply(
        self,
        layer: FusedMoE,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return kernels.fused_moe(
            x, layer.w13, layer.w2, topk_weights, topk_ids, layer.b13, layer.b2, layer.activation
        )


class PackedExpertsMoEMethod(MoEMethod):
    """The CPU fast path's SwiGLU experts, all packed for the float32-activation GEMMs: the
    whole block in one C call from the router's logits (``kernels/cpu/ops.py`` `moe_block`:
    each token's softmax top-k, then the same grouping and GEMMs as
    `ExpertLinearsMoEMethod`, the activation by the C kernel the dense MLP uses), which the
    step program replays as one op; without it a MoE model's step ran op by op in Python.
    Falls back to the torch router and the expert linears when an expert carries LoRA
    adapters (or the router scores otherwise than softmax then top-k)."""

    name = "packed-experts"

    def block(self, layer: FusedMoE, router: TopKRouter, x: torch.Tensor) -> torch.Tensor:
        from kernels.cpu import ops

        if self._packed(layer) and router.scoring == "softmax_topk" and x.dtype == torch.float32:
            logits = router.gate(x)
            return ops.moe_block(
                x, logits, layer.packed_experts, router.top_k, router.norm_topk_prob
            )
        return super().block(layer, router, x)

    def apply(
        self,
        layer: FusedMoE,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        from kernels.cpu import capture, ops

        if not self._packed(layer) or capture.active() is not None:
            return EXPERT_LINEARS.apply(layer, x, topk_weights, topk_ids)
        return ops.moe_experts(x, topk_weights, topk_ids, layer.packed_experts)

    @staticmethod
    def _packed(layer: FusedMoE) -> bool:
        """Whether the layer's experts run packed: LoRA hooks go on every expert of a
        projection or on none (`engine/lora/manager.py` picks linears by their names'
        suffix, the same for each expert), so the first expert of each says, where a scan
        of all of them cost every MoE layer of every step."""
        return (
            layer.packed_experts is not None
            and layer.gate_up[0].lora is None
            and layer.down[0].lora is None
        )


EXPERT_LINEARS = ExpertLinearsMoEMethod()
GROUPED_GEMM = GroupedGemmMoEMethod()
PACKED_EXPERTS = PackedExpertsMoEMethod()


def _view_parameter(stacked: torch.Tensor, index: int) -> nn.Parameter:
    """Expert ``index``'s slice of a stacked tensor as a frozen Parameter sharing its
    storage: writing the Parameter (checkpoint loading) writes the stacked tensor."""
    return nn.Parameter(stacked[index], requires_grad=False)


class FusedMoE(nn.Module):
    """``num_experts`` gated MLPs over stacked weights; ``forward(x, topk_weights, topk_ids)``
    → the routing-weighted sum of each token's experts, [T, H].

    ``activation``: a key of ``kernels.reference_moe.ACTIVATIONS`` (``silu``: SwiGLU;
    ``swiglu_oai``: gpt-oss's clamped form). ``bias``: per-expert biases on both
    projections (gpt-oss).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        prefix: str,
        names: ExpertNames,
        *,
        activation: str = "silu",
        bias: bool = False,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation {activation!r}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.act: Callable[[torch.Tensor], torch.Tensor] = ACTIVATIONS[activation]
        inter = intermediate_size
        # Stacked storage (buffers: the per-expert Parameters below are their views, so the
        # parameters are counted once).
        self.register_buffer(
            "w13", torch.empty((num_experts, 2 * inter, hidden_size), dtype=dtype, device=device),
            persistent=False,
        )  # fmt: skip
        self.register_buffer(
            "w2", torch.empty((num_experts, hidden_size, inter), dtype=dtype, device=device),
            persistent=False,
        )  # fmt: skip
        self.b13: torch.Tensor | None = None
        self.b2: torch.Tensor | None = None
        if bias:
            self.b13 = torch.empty((num_experts, 2 * inter), dtype=dtype, device=device)
            self.b2 = torch.empty((num_experts, hidden_size), dtype=dtype, device=device)
        self.gate_up = nn.ModuleList()
        self.down = nn.ModuleList()
        for e in range(num_experts):
            gate_up = Linear(
                hidden_size, 2 * inter,
                [Shard(f"{prefix}.{names.gate.format(e=e)}", inter),
                 Shard(f"{prefix}.{names.up.format(e=e)}", inter)],
                bias=bias, dtype=dtype, device=device,
            )  # fmt: skip
            down = Linear(
                inter, hidden_size, [Shard(f"{prefix}.{names.down.format(e=e)}", hidden_size)],
                bias=bias, dtype=dtype, device=device,
            )  # fmt: skip
            gate_up.weight = _view_parameter(self.w13, e)
            down.weight = _view_parameter(self.w2, e)
            if self.b13 is not None and self.b2 is not None:
                gate_up.bias = _view_parameter(self.b13, e)
                down.bias = _view_parameter(self.b2, e)
            self.gate_up.append(gate_up)
            self.down.append(down)
        self.method: MoEMethod = EXPERT_LINEARS
        self.packed_experts: Any = None
        """`kernels.cpu.ops.PackedExperts` of the experts' packed linears, for
        `PackedExpertsMoEMethod` (engine/backends.py sets both)."""

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.method.apply(self, x, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, {self.hidden_size} -> {self.intermediate_size}, "
            f"activation={self.activation}, method={self.method.name}"
        )


class SparseMoeBlock(nn.Module):
    """Router, then experts: the MLP of a MoE decoder layer, [T, H] → [T, H]."""

    def __init__(self, router: TopKRouter, experts: FusedMoE) -> None:
        super().__init__()
        self.router = router
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.method.block(self.experts, self.router, x)


def use_moe_method(model: nn.Module, method: MoEMethod) -> int:
    """Give every `FusedMoE` of `model` the method; returns how many took it."""
    count = 0
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.method = method
            count += 1
    return count
