"""Gemma 3 (text: ``Gemma3ForCausalLM``, config ``Gemma3TextConfig``) on the Llama base.

What Gemma 3 changes, each as data for the shared layers:

- RMSNorm multiplies by ``(1 + w)``: `norm_weight_offset` 1, added to the weights once at
  load (engine/layers/norm.py), so the norm kernels are the plain ones;
- embeddings scaled by ``sqrt(hidden_size)`` (rounded to the model dtype first);
- GeGLU MLP (``gelu_pytorch_tanh``);
- a norm before *and after* both attention and MLP (`Gemma3DecoderLayer`);
- per-head q/k norms, softmax scale ``query_pre_attn_scalar ** -0.5``;
- interleaved sliding-window and global layers (`layer_types`), each kind with its own
  rotary base (``rope_parameters["sliding_attention"]`` / ``["full_attention"]``; the
  global one may carry linear scaling);
- optional final logit soft-capping (``final_logit_softcapping``).

Refused: attention-logit soft-capping (Gemma 2's; Gemma 3 configs leave it None) and
bidirectional attention (the embedding variants).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.layers.embedding import VocabEmbedding
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_config
from engine.layers.self_attention import SelfAttention
from engine.models.llama import LlamaForCausalLM
from kernels.metadata import AttentionMetadata


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: ``h + post_attn(attn(in(h)))``, then ``h + post_ff(mlp(pre_ff(h)))``,
    on the fused (hidden, residual) stream: the residual add happens inside the next
    pre-norm, as in the Llama layer (``x + r`` is ``r + x`` bit for bit)."""

    def __init__(
        self,
        self_attn: SelfAttention,
        mlp: nn.Module,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp

        def norm() -> RMSNorm:
            return RMSNorm(hidden_size, eps, dtype, device, weight_offset=1.0)

        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        return self.post_feedforward_layernorm(hidden), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text decoder (the 1B checkpoints, and the text half of ``Gemma3TextConfig``)."""

    norm_weight_offset = 1.0

    @staticmethod
    def _check_supported(config: Any) -> None:
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation={act!r} is not supported (gelu_pytorch_tanh)")
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("attn_logit_softcapping is not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (decoder only)")

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, dtype, device)
        cap = getattr(config, "final_logit_softcapping", None)
        self.final_logit_softcapping: float | None = float(cap) if cap else None

    def _embedding(self, config: Any, dtype: torch.dtype, device: torch.device) -> VocabEmbedding:
        scale = config.hidden_size**0.5
        return VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, scale=scale)

    def _rotary_for_layer(
        self, config: Any, index: int, dtype: torch.dtype, device: torch.device
    ) -> RotaryEmbedding | None:
        kind = config.layer_types[index]
        theta, scaling = rope_config(config, layer_type=kind)
        return self._shared_rotary(theta, scaling, config, dtype, device)

    def _attention_options(self, config: Any, index: int) -> dict[str, Any]:
        bias = bool(getattr(config, "attention_bias", False))
        return {
            "qkv_bias": bias,
            "o_bias": bias,
            "qk_norm_eps": config.rms_norm_eps,
            "scale": float(config.query_pre_attn_scalar) ** -0.5,
        }

    def _decoder_layer(
        self, config: Any, index: int, prefix: str, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        return Gemma3DecoderLayer(
            self._attention(config, index, f"{prefix}.self_attn", dtype, device),
            self._mlp(config, index, f"{prefix}.mlp", dtype, device),
            config.hidden_size, float(config.rms_norm_eps), dtype, device,
        )  # fmt: skip

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits, soft-capped as transformers does (``tanh(x / c) * c``, in the
        model dtype, before the upcast) when the config asks for it."""
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
