"""gpt-oss's MoE block on the shared MoE layer, and its checkpoint's expert tensors.

NOTE: only the feed-forward half of gpt-oss is here; `GptOssForCausalLM` is not
registered yet. Its attention needs what hearth's attention backends do not have yet
(per-head attention sinks in the softmax; YaRN rope; alternating sliding-window layers
are the dense helper's `layer_types` windows). The block below is checked against
transformers' ``GptOssMLP`` (tests/engine/test_moe_parity.py), so the model class only
has to compose it.

What differs from Mixtral / Qwen3-MoE:

- the router has a bias and takes the top k of the *logits*, then a softmax over those
  k (in the model dtype);
- every expert projection has a bias, and the activation is the clamped SwiGLU
  (``kernels.reference_moe.swiglu_oai``: alpha 1.702, limit 7);
- the checkpoint stores the experts stacked and transposed, with gate and up
  *interleaved* in the last dimension: ``mlp.experts.gate_up_proj`` [E, H, 2I] (gate at
  even columns, up at odd), ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H],
  ``down_proj_bias`` [E, H]. `split_stacked_experts` turns them into per-expert tensors
  in hearth's layout (gate rows, then up rows, ``[out, in]``), named as the experts'
  `Shard`s, so the generic loader (engine/models/weights.py) fills the stacked weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from engine.layers.moe import ExpertNames, FusedMoE, SparseMoeBlock, TopKRouter

__all__ = ["GPT_OSS_EXPERTS", "gpt_oss_moe", "split_stacked_experts"]

GPT_OSS_EXPERTS = ExpertNames(
    gate="experts.{e}.gate_proj", up="experts.{e}.up_proj", down="experts.{e}.down_proj"
)
"""Per-expert names `split_stacked_experts` gives the stacked checkpoint tensors."""

_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
"""The constants `swiglu_oai` computes with (every released gpt-oss config)."""


def gpt_oss_moe(
    config: Any, prefix: str, dtype: torch.dtype, device: torch.device
) -> SparseMoeBlock:
    """A layer's ``mlp`` (under `prefix`): bias-ed top-k-then-softmax router, bias-ed
    experts with the clamped SwiGLU."""
    for key, value in _SWIGLU.items():
        if float(getattr(config, key, value)) != value:
            raise ValueError(
                f"gpt-oss {key}={getattr(config, key)} is not supported (only {value})"
            )
    num_experts = int(config.num_local_experts)
    router = TopKRouter(
        config.hidden_size, num_experts, int(config.num_experts_per_tok), f"{prefix}.router",
        scoring="topk_softmax", weights_in_model_dtype=True, bias=True, dtype=dtype,
        device=device,
    )  # fmt: skip
    experts = FusedMoE(
        num_experts, config.hidden_size, config.intermediate_size, prefix, GPT_OSS_EXPERTS,
        activation="swiglu_oai", bias=True, dtype=dtype, device=device,
    )  # fmt: skip
    return SparseMoeBlock(router, experts)


def split_stacked_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each stacked ``experts.*`` tensor replaced by its
    per-expert slices under `GPT_OSS_EXPERTS` names (views: the loader copies them once);
    every other tensor passes through."""
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".experts.")
        if not prefix:
            yield name, tensor
            continue
        base = f"{prefix}.experts"
        for e in range(tensor.shape[0]):
            if leaf == "gate_up_proj":  # [H, 2I], gate/up interleaved in the columns
                yield f"{base}.{e}.gate_proj.weight", tensor[e, :, 0::2].t()
                yield f"{base}.{e}.up_proj.weight", tensor[e, :, 1::2].t()
            elif leaf == "gate_up_proj_bias":  # [2I]
                yield f"{base}.{e}.gate_proj.bias", tensor[e, 0::2]
                yield f"{base}.{e}.up_proj.bias", tensor[e, 1::2]
            elif leaf == "down_proj":  # [I, H]
                yield f"{base}.{e}.down_proj.weight", tensor[e].t()
            elif leaf == "down_proj_bias":  # [H]
                yield f"{base}.{e}.down_proj.bias", tensor[e]
            else:
                raise ValueError(f"unexpected gpt-oss expert tensor {name!r}")
