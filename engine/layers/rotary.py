"""Rotary position embedding over a precomputed cos/sin table."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import kernels
from engine.layers.kernel_ops import KernelOps
from kernels import build_cos_sin_cache


def rope_config(config: Any, layer_type: str | None = None) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a transformers 5 or 4 style config.

    transformers 5 folds theta and scaling into `config.rope_parameters`
    (`{"rope_type": "llama3", "rope_theta": ..., "factor": ...}`); older configs have
    `rope_theta` plus an optional `rope_scaling`. The scaling dict handed to the kernel
    always carries `rope_type` and never `rope_theta`; `None` means plain RoPE.
    `layer_type`: configs with one parameter set per kind of layer (Gemma 3:
    ``rope_parameters["sliding_attention"]`` / ``["full_attention"]``) give that one.
    """
    params = getattr(config, "rope_parameters", None)
    if layer_type is not None and isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(config, "rope_theta", 10000.0))
        legacy = getattr(config, "rope_scaling", None)
        scaling = dict(legacy) if legacy else {}
    if "type" in scaling:  # the pre-4.45 spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return theta, None
    if rope_type == "longrope":
        scaling.setdefault(
            "original_max_position_embeddings",
            getattr(config, "original_max_position_embeddings", config.max_position_embeddings),
        )
    if rope_type == "llama3" and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = config.max_position_embeddings
    if rope_type == "yarn" and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = getattr(
            config, "original_max_position_embeddings", None
        ) or (config.max_position_embeddings)
    if rope_type == "yarn" and scaling.get("factor") is None:  # transformers' fallback
        scaling["factor"] = (
            config.max_position_embeddings / scaling["original_max_position_embeddings"]
        )
    return theta, scaling


class RotaryEmbedding(nn.Module):
    """``rotate_half`` RoPE (GPT-NeoX / HF Llama) of q and k at their positions."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        cos_sin = build_cos_sin_cache(head_dim, max_position, theta, dtype, device, scaling)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)  # [max_pos, head_dim]
        self.ops: KernelOps = kernels

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim] → rotated (q, k)."""
        return self.ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
