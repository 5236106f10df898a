"""Mixtral: the Mistral decoder with a sparse MoE block (top-2 of 8 experts in the
released checkpoints) in place of every dense MLP.

Attention, norms, rotary and the residual stream are Mistral's (`MistralForCausalLM`);
only the MLP differs, so this file composes `engine/layers/moe.py` into the Llama
decoder through its `_mlp` hook. Checkpoint names (``model.layers.N.block_sparse_moe
.gate`` and ``.experts.E.w1/w3/w2``: gate, up, down) are the `Shard`s of the router and
of each expert's `Linear`, whose weights are views of the stacked expert tensors, so the
Llama loader fills them unchanged. The router keeps float32 weights, always renormalised
over the top k (transformers' ``MixtralTopKRouter``).

As for Mistral, a config's `sliding_window` (set in some checkpoints) bounds every layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.layers.moe import ExpertNames, FusedMoE, SparseMoeBlock, TopKRouter
from engine.models.llama import MistralForCausalLM

__all__ = ["MixtralForCausalLM"]

MIXTRAL_EXPERTS = ExpertNames(gate="experts.{e}.w1", up="experts.{e}.w3", down="experts.{e}.w2")


def mixtral_moe(
    config: Any, prefix: str, dtype: torch.dtype, device: torch.device
) -> SparseMoeBlock:
    """A layer's ``block_sparse_moe`` (under `prefix`): every Mixtral layer is sparse."""
    num_experts = int(config.num_local_experts)
    router = TopKRouter(
        config.hidden_size, num_experts, int(config.num_experts_per_tok), f"{prefix}.gate",
        norm_topk_prob=True, dtype=dtype, device=device,
    )  # fmt: skip
    experts = FusedMoE(
        num_experts, config.hidden_size, config.intermediate_size, prefix, MIXTRAL_EXPERTS,
        dtype=dtype, device=device,
    )  # fmt: skip
    return SparseMoeBlock(router, experts)


class MixtralForCausalLM(MistralForCausalLM):
    """Mixtral 8x7B / 8x22B and their fine-tunes."""

    def _mlp(
        self, config: Any, index: int, prefix: str, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        # The base names the block ``{layer}.mlp``; Mixtral's checkpoint says block_sparse_moe.
        layer = prefix.removesuffix(".mlp")
        return mixtral_moe(config, f"{layer}.block_sparse_moe", dtype, device)
