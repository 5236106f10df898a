"""Qwen3 (dense): Llama's block with an RMSNorm over each head's q and k before rotary.

Everything else is the Llama base (engine/models/llama.py): no q/k/v bias by default
(`attention_bias` adds one to q/k/v and o, as in transformers), optional sliding-window
layers from `layer_types` (`use_sliding_window`, `max_window_layers`). Qwen3-MoE reuses
`Qwen3ForCausalLM._attention_options` for its attention and swaps the MLP (`_mlp`).
"""

from __future__ import annotations

from typing import Any

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head q/k RMSNorm (``self_attn.q_norm`` / ``k_norm``, width head_dim)."""

    def _attention_options(self, config: Any, index: int) -> dict[str, Any]:
        return {**super()._attention_options(config, index), "qk_norm_eps": config.rms_norm_eps}
