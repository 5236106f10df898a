"""gpt-oss (``GptOssForCausalLM``): the Llama decoder with attention sinks, YaRN rope,
alternating sliding-window layers, biased q/k/v/o and a sparse MoE block.

What differs from the dense base (`LlamaForCausalLM`), each data the base's hooks read:

- attention: q/k/v/o projections with biases (``attention_bias``, default True), the
  plain ``head_dim ** -0.5`` scale, and learned per-head **attention sinks**
  (``self_attn.sinks`` [num_heads]: one extra logit per head in the softmax
  denominator), computed by the attention backend (kernels/reference.py,
  kernels/triton/paged_attention.py; the CPU C kernel has none, so `choose_backends`
  never gives it a gpt-oss model). The parameter lives on the `Attention` layer,
  ``self_attn.attn.sinks``; `load_weights` maps the checkpoint's name onto it;
- rope: **YaRN** (``rope_parameters`` type ``yarn``: factor 32 over 4096 original
  positions in the released configs), with cos and sin scaled by its attention factor
  (kernels/reference.py ``build_cos_sin_cache``); the rotation is rotate-half, as Llama's;
- windows: ``layer_types`` alternates ``sliding_attention`` (``sliding_window``, 128 in
  the released configs) and ``full_attention``, read by the base's `layer_windows`
  (as for Gemma 3);
- norms: RMSNorm as Llama's; transformers multiplies by the weight in float32 before the
  cast (and keeps the norm weights in float32), which is the same arithmetic in float32
  but may differ in the last bit under bfloat16;
- the MLP is the MoE block below.

The MoE block (`gpt_oss_moe`) is checked against transformers' ``GptOssMLP``
(tests/engine/test_moe_parity.py); what differs from Mixtral / Qwen3-MoE:

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

The released checkpoints store ``gate_up_proj`` and ``down_proj`` as MXFP4
(``quantization_config.quant_method`` ``mxfp4``; ``*_blocks`` / ``*_scales`` tensors,
biases dense): `load_weights` dequantizes them once, to the model dtype on its device
(engine/models/mxfp4.py, bitwise transformers' reader), before the split above; the
model then runs them dense. Any other ``quant_method`` is refused at construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.layers.moe import ExpertNames, FusedMoE, SparseMoeBlock, TopKRouter
from engine.models.llama import LlamaForCausalLM
from engine.models.mxfp4 import dequantize_mxfp4_tensors
from engine.models.weights import load_checkpoint

__all__ = ["GPT_OSS_EXPERTS", "GptOssForCausalLM", "gpt_oss_moe", "split_stacked_experts"]

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


def _sinks_on_attention(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """``...self_attn.sinks`` → ``...self_attn.attn.sinks`` (the `Attention` layer holds
    them); every other tensor passes through."""
    for name, tensor in weights:
        if name.endswith(".self_attn.sinks"):
            name = name.removesuffix(".sinks") + ".attn.sinks"
        yield name, tensor


_QUANT_METHODS = ("mxfp4",)
"""``quantization_config.quant_method`` values a gpt-oss checkpoint may carry (its
experts are dequantized at load)."""


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss-20b / gpt-oss-120b (the released MXFP4 experts or dense ones) and their
    fine-tunes."""

    qkv_bias_default = False  # ``attention_bias`` (True in every gpt-oss config) decides

    @staticmethod
    def _check_supported(config: Any) -> None:
        LlamaForCausalLM._check_supported(config)
        quant = getattr(config, "quantization_config", None)  # a dict in config.json
        if quant is None:
            return
        method = (
            quant.get("quant_method")
            if isinstance(quant, dict)
            else getattr(quant, "quant_method", quant)
        )
        if method not in _QUANT_METHODS:
            raise ValueError(
                f"gpt-oss quantization {method!r} is not supported "
                f"(only {', '.join(_QUANT_METHODS)}, dequantized at load)"
            )

    def _attention_options(self, config: Any, index: int) -> dict[str, Any]:
        return {**super()._attention_options(config, index), "sinks": True}

    def _mlp(
        self, config: Any, index: int, prefix: str, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        return gpt_oss_moe(config, prefix, dtype, device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The base's loader over the checkpoint with its MXFP4 experts dequantized (to
        the model's dtype, on its device), its stacked experts split per expert and the
        sinks named after the layer that holds them."""
        ignore = ("lm_head.weight",) if self.tie_word_embeddings else ()
        device = self.model.embed_tokens.weight.device
        dense = dequantize_mxfp4_tensors(weights, self.dtype, device)
        load_checkpoint(self, _sinks_on_attention(split_stacked_experts(dense)), ignore=ignore)
