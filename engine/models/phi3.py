"""Phi-3 and Phi-4 (``Phi3ForCausalLM``) on the Llama base.

- The checkpoint stores fused ``qkv_proj`` and ``gate_up_proj`` tensors: the same fused
  `Linear`s, each with one `Shard` (`fused_checkpoint`). Their row layouts are the ones
  the layers use (q | k | v; gate | up), so nothing is permuted.
- LongRoPE (``rope_type`` ``longrope``, Phi-3 128k, Phi-4-mini): one cos/sin table with
  the short factors below ``original_max_position_embeddings`` and the long factors
  from there on, both scaled by the attention factor: exact while a sequence stays
  below the original length; past it transformers re-encodes the whole sequence with
  the long factors, which a paged cache does not (kernels/reference.py,
  `build_cos_sin_cache`).
- A partial rotary factor (Phi-4-mini: 0.75) rotates the leading dims of each head only:
  the table is narrower than the head, which every rotary kernel handles.
- ``sliding_window`` (Phi-3-mini-4k: 2047) bounds every layer, as in transformers.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.layers.rotary import RotaryEmbedding, rope_config
from engine.models.llama import LlamaForCausalLM, head_dim_of


def partial_rotary_factor(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    factor = getattr(config, "partial_rotary_factor", 1.0) or 1.0
    if isinstance(rope, dict):
        factor = rope.get("partial_rotary_factor", factor)
    return float(factor)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4: fused checkpoint tensors, LongRoPE, partial rotary."""

    fused_checkpoint = True

    @staticmethod
    def _check_supported(config: Any) -> None:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
        rot = int(head_dim_of(config) * partial_rotary_factor(config))
        if rot <= 0 or rot % 2:
            raise ValueError(f"a rotary width of {rot} dims is not supported (must be even)")

    def _rotary_for_layer(
        self, config: Any, index: int, dtype: torch.dtype, device: torch.device
    ) -> RotaryEmbedding | None:
        theta, scaling = rope_config(config)
        rot = int(head_dim_of(config) * partial_rotary_factor(config))
        return self._shared_rotary(theta, scaling, config, dtype, device, rotary_dim=rot)

    def _attention_options(self, config: Any, index: int) -> dict[str, Any]:
        return {"qkv_bias": False, "o_bias": False}
