"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm before rotary) with a sparse MoE
block in place of the MLP on the sparse layers.

A layer is sparse unless it is listed in `mlp_only_layers`, and then only every
`decoder_sparse_step`-th layer (``(index + 1) % step == 0``), as transformers decides;
the other layers keep Qwen3's dense MLP (`intermediate_size`), the sparse ones route
each token to `num_experts_per_tok` of `num_experts` experts of width
`moe_intermediate_size`. The router's softmax is float32, renormalised over the top k
only with `norm_topk_prob`, and its weights are cast back to the model dtype
(transformers' ``Qwen3MoeTopKRouter``). Checkpoint names: ``mlp.gate`` and
``mlp.experts.E.gate_proj/up_proj/down_proj``, the `Shard`s of the router and the
experts (engine/layers/moe.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.layers.moe import ExpertNames, FusedMoE, SparseMoeBlock, TopKRouter
from engine.models.qwen3 import Qwen3ForCausalLM

__all__ = ["Qwen3MoeForCausalLM", "is_sparse_layer"]

QWEN3_MOE_EXPERTS = ExpertNames(
    gate="experts.{e}.gate_proj", up="experts.{e}.up_proj", down="experts.{e}.down_proj"
)


def is_sparse_layer(config: Any, index: int) -> bool:
    """Whether layer `index` has the MoE block (transformers' ``Qwen3MoeDecoderLayer``)."""
    mlp_only = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return index not in mlp_only and config.num_experts > 0 and (index + 1) % step == 0


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-30B-A3B, Qwen3-235B-A22B and their fine-tunes."""

    def _mlp(
        self, config: Any, index: int, prefix: str, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        if not is_sparse_layer(config, index):
            return super()._mlp(config, index, prefix, dtype, device)
        num_experts = int(config.num_experts)
        router = TopKRouter(
            config.hidden_size, num_experts, int(config.num_experts_per_tok), f"{prefix}.gate",
            norm_topk_prob=bool(config.norm_topk_prob), weights_in_model_dtype=True,
            dtype=dtype, device=device,
        )  # fmt: skip
        experts = FusedMoE(
            num_experts, config.hidden_size, config.moe_intermediate_size, prefix,
            QWEN3_MOE_EXPERTS, dtype=dtype, device=device,
        )  # fmt: skip
        return SparseMoeBlock(router, experts)
