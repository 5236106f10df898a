"""SmolLM3 (``SmolLM3ForCausalLM``): Llama with no rotary on every few layers (NoPE).

``config.no_rope_layers[i]`` is 1 for a layer with rotary and 0 for a NoPE layer (by
default every fourth layer, `no_rope_layer_interval`); a NoPE layer's attention is
the same block built without a rotary table. Sliding windows, when
`use_sliding_window` is set, sit on the NoPE layers (`layer_types`).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama's block; NoPE layers from `no_rope_layers`."""

    def _rotary_for_layer(
        self, config: Any, index: int, dtype: torch.dtype, device: torch.device
    ) -> RotaryEmbedding | None:
        flags = getattr(config, "no_rope_layers", None)
        if flags is not None and not flags[index]:
            return None
        return super()._rotary_for_layer(config, index, dtype, device)
