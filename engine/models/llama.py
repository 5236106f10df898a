"""Native Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) on the paged KV cache,
and the base every other dense decoder here builds on (engine/models/qwen3.py, gemma3.py,
phi3.py, smollm3.py).

The model file only composes layers (`engine/layers`): which kernel computes a linear,
a norm or attention is decided at start-up (docs/architecture.md, "Backends"), never here.
The engine runs one forward per step over the *flattened* tokens of every scheduled
sequence (decodes first, then prefill chunks; no batch dim, no padding), so this module
differs from transformers' in three ways that matter:

- attention reads and writes the paged cache through the step's `AttentionMetadata`
  instead of an attention mask;
- q/k/v and gate/up projections are fused into one `Linear` each, whose `Shard`s name the
  HF checkpoint's separate tensors;
- the residual stream follows vLLM: each layer returns `(hidden, residual)` and the next
  norm fuses the residual add, saving one read and write of the stream per norm.

Numerics otherwise follow transformers exactly (same op order in float32 under the exact
methods), which the parity tests check token for token.

What differs between architectures is data, read from the config by a few hooks that a
subclass overrides (`_attention_options`, `_layer_windows`, `_rotary_for_layer`,
`_decoder_layer`, `_embedding`): the attention and MLP blocks themselves
(`engine/layers/self_attention.py`, `engine/layers/mlp.py`) and the weight loading
(`engine/models/weights.py`) are written once.

Sliding windows: each layer's window comes from the config (`_layer_windows`: Mistral's
`sliding_window` on every layer; Qwen2/Qwen3/Gemma 3/SmolLM3 `layer_types`) and is
honoured by every attention backend; `sliding_window` is the window that bounds *every*
layer (None if any layer is global), which lets the block manager free the blocks that
fell out of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.layers.embedding import VocabEmbedding, lm_head
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_config
from engine.layers.self_attention import SelfAttention
from engine.models.weights import load_checkpoint
from kernels.metadata import AttentionMetadata

__all__ = [
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaModel",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "head_dim_of",
    "layer_windows",
    "rope_config",
]


def head_dim_of(config: Any) -> int:
    """Per-head width: the config's explicit `head_dim` (which may differ from
    hidden/heads, e.g. Mistral Nemo) or hidden/heads. One rule, so the attention layers
    and the KV cache the runner sizes from `LlamaForCausalLM.head_dim` always agree."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: global), the way transformers reads the config.

    With `layer_types` (Qwen2/3, Gemma 3, SmolLM3, gpt-oss): ``"sliding_attention"``
    layers get `sliding_window`; every other layer is global. Qwen2/Qwen3's configs
    clear `sliding_window` unless `use_sliding_window`, SmolLM3 checks the flag per
    layer, so the flag is honoured where it exists. Without `layer_types` (Mistral,
    Phi-3): `sliding_window` applies to every layer.
    """
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    window = int(window) if window else None
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * n
    if len(types) < n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    return [window if types[i] == "sliding_attention" else None for i in range(n)]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; takes and returns the (hidden, residual) pair of the vLLM stream."""

    def __init__(
        self,
        self_attn: SelfAttention,
        mlp: nn.Module,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device,
        norm_weight_offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype, device, norm_weight_offset)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype, device, norm_weight_offset)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # first layer: the embedding output is the residual
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:  # residual <- hidden + residual; hidden <- norm(residual)
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (no LM head)."""

    def __init__(self, embed_tokens: VocabEmbedding, layers: list[nn.Module], norm: RMSNorm):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, H]
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        if residual is None:  # zero layers: only the final norm
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden  # [T, H]


class LlamaForCausalLM(nn.Module):
    """Llama 2/3 and SmolLM2: the engine-facing model (forward, compute_logits, load_weights).

    Attributes the runner reads to size the KV cache: `num_layers`, `num_kv_heads`,
    `head_dim`, `vocab_size`, plus `sliding_window` (None, or the window every layer
    attends within: blocks wholly before it can be freed) and `dtype`.
    """

    qkv_bias_default: bool = False
    """Subclasses whose q/k/v always carry a bias (Qwen2) set this."""
    o_bias_follows_attention_bias: bool = True
    """Llama's `attention_bias` also adds a bias to o_proj; Qwen2's o_proj never has one."""
    norm_weight_offset: float = 0.0
    """Gemma's RMSNorms multiply by ``1 + w`` (engine/layers/norm.py)."""
    fused_checkpoint: bool = False
    """The checkpoint stores fused ``qkv_proj`` / ``gate_up_proj`` tensors (Phi-3)."""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self._check_supported(config)
        self.config = config
        self.dtype = dtype
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_dim: int = head_dim_of(config)
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.max_position_embeddings: int = config.max_position_embeddings
        self.layer_windows: list[int | None] = self._layer_windows(config)
        self.sliding_window: int | None = self._sliding_window(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self._rotaries: dict[object, RotaryEmbedding] = {}

        eps = float(config.rms_norm_eps)
        layers = [
            self._decoder_layer(config, i, f"model.layers.{i}", dtype, device)
            for i in range(config.num_hidden_layers)
        ]
        norm = RMSNorm(config.hidden_size, eps, dtype, device, self.norm_weight_offset)
        self.model = LlamaModel(self._embedding(config, dtype, device), layers, norm)
        del self._rotaries  # the layers hold them
        head_name = "model.embed_tokens" if self.tie_word_embeddings else "lm_head"
        self.lm_head = lm_head(
            self.model.embed_tokens, self.tie_word_embeddings, head_name, dtype, device
        )

    # -- what an architecture overrides -------------------------------------------------
    @staticmethod
    def _check_supported(config: Any) -> None:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
        partial = getattr(config, "partial_rotary_factor", 1.0)
        rope = getattr(config, "rope_parameters", None) or {}
        if isinstance(rope, dict):
            partial = rope.get("partial_rotary_factor", partial)
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported")

    @classmethod
    def _layer_windows(cls, config: Any) -> list[int | None]:
        return layer_windows(config)

    @classmethod
    def _sliding_window(cls, config: Any) -> int | None:
        """The window every layer attends within, or None when some layer is global."""
        windows = cls._layer_windows(config)
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    def _embedding(self, config: Any, dtype: torch.dtype, device: torch.device) -> VocabEmbedding:
        return VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device)

    def _rotary_for_layer(
        self, config: Any, index: int, dtype: torch.dtype, device: torch.device
    ) -> RotaryEmbedding | None:
        """Layer `index`'s rotary table (None: a layer without rotary); one table is built
        per distinct (theta, scaling) and shared."""
        theta, scaling = rope_config(config)
        return self._shared_rotary(theta, scaling, config, dtype, device)

    def _shared_rotary(
        self,
        theta: float,
        scaling: dict[str, Any] | None,
        config: Any,
        dtype: torch.dtype,
        device: torch.device,
        rotary_dim: int | None = None,
    ) -> RotaryEmbedding:
        key = (theta, repr(sorted((scaling or {}).items())), rotary_dim)
        if key not in self._rotaries:
            self._rotaries[key] = RotaryEmbedding(
                rotary_dim or head_dim_of(config), config.max_position_embeddings, theta,
                scaling, dtype, device,
            )  # fmt: skip
        return self._rotaries[key]

    def _attention_options(self, config: Any, index: int) -> dict[str, Any]:
        """Keyword arguments of `SelfAttention` that differ by architecture."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return {
            "qkv_bias": self.qkv_bias_default or attention_bias,
            "o_bias": attention_bias and self.o_bias_follows_attention_bias,
        }

    def _attention(
        self, config: Any, index: int, prefix: str, dtype: torch.dtype, device: torch.device
    ) -> SelfAttention:
        return SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            head_dim_of(config), prefix, rotary=self._rotary_for_layer(config, index, dtype, device),
            dtype=dtype, device=device, sliding_window=self.layer_windows[index],
            norm_weight_offset=self.norm_weight_offset, fused_checkpoint=self.fused_checkpoint,
            **self._attention_options(config, index),
        )  # fmt: skip

    def _mlp(
        self, config: Any, index: int, prefix: str, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        """Layer `index`'s feed-forward block (the MoE models return their sparse block)."""
        activation = getattr(config, "hidden_activation", None) or getattr(
            config, "hidden_act", "silu"
        )
        return GatedMLP(
            config.hidden_size, config.intermediate_size, prefix, activation=activation,
            bias=bool(getattr(config, "mlp_bias", False)), fused_checkpoint=self.fused_checkpoint,
            dtype=dtype, device=device,
        )  # fmt: skip

    def _decoder_layer(
        self, config: Any, index: int, prefix: str, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        return LlamaDecoderLayer(
            self._attention(config, index, f"{prefix}.self_attn", dtype, device),
            self._mlp(config, index, f"{prefix}.mlp", dtype, device),
            config.hidden_size, float(config.rms_norm_eps), dtype, device, self.norm_weight_offset,
        )  # fmt: skip

    # -- engine API ---------------------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [T, H] of the step's flattened tokens (input_ids/positions: [T] int64).

        Each attention layer writes this step's K/V into the slots `meta.slot_mapping`
        names (in the cache the runner bound to it) before attending.
        """
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, V] of the N rows that will be sampled (never all prefill tokens).

        The matmul runs in the model dtype (as transformers does) and is upcast after.
        """
        return self.lm_head(hidden).float()  # [N, V]

    # -- weights ------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the (fused) parameters
        (engine/models/weights.py): raises on an unknown tensor or on any parameter slice
        left unwritten, so a wrong checkpoint never serves garbage. Some tied checkpoints
        store ``lm_head.weight`` anyway; the embedding wins."""
        ignore = ("lm_head.weight",) if self.tie_word_embeddings else ()
        load_checkpoint(self, weights, ignore=ignore)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama without biases; `sliding_window` (when set) bounds every layer."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: bias on q/k/v (never on o_proj); with `use_sliding_window`, the layers from
    `max_window_layers` on are windowed (`layer_types`)."""

    qkv_bias_default = True
    o_bias_follows_attention_bias = False
