"""Native Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) on the paged KV cache.

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

Limits: sliding-window attention is not implemented. Mistral configs carry a
`sliding_window`; the model exposes it as `self.sliding_window` and the runner must keep
`max_model_len <= sliding_window` (then the window never cuts anything and the result is
exact). Qwen2 with `use_sliding_window=True` is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.embedding import VocabEmbedding, lm_head
from engine.layers.linear import Linear, Shard
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_config
from kernels.metadata import AttentionMetadata

__all__ = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "head_dim_of",
    "rope_config",
]


def head_dim_of(config: Any) -> int:
    """Per-head width: the config's explicit `head_dim` (which may differ from
    hidden/heads, e.g. Mistral Nemo) or hidden/heads. One rule, so the attention layers
    and the KV cache the runner sizes from `LlamaForCausalLM.head_dim` always agree."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Fused-QKV projection, rotary, paged attention, output projection (GQA)."""

    def __init__(
        self,
        config: Any,
        prefix: str,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        device: torch.device,
        qkv_bias: bool,
        o_bias: bool,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_dim: int = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        shards = [
            Shard(f"{prefix}.q_proj", self.q_size, rotary_heads=self.num_heads),
            Shard(f"{prefix}.k_proj", self.kv_size, rotary_heads=self.num_kv_heads),
            Shard(f"{prefix}.v_proj", self.kv_size),
        ]
        # Rows: [q (num_heads*head_dim) | k (num_kv_heads*head_dim) | v (same)].
        self.qkv_proj = Linear(
            hidden,
            self.q_size + 2 * self.kv_size,
            shards,
            bias=qkv_bias,
            dtype=dtype,
            device=device,
        )
        self.o_proj = Linear(
            self.q_size, hidden, [Shard(f"{prefix}.o_proj", hidden)], bias=o_bias, dtype=dtype,
            device=device,
        )  # fmt: skip
        self.rotary_emb = rotary  # shared by every layer (one cos/sin table)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2*kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, nh, hd]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, nkv, hd]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, nkv, hd]
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, meta)  # [T, nh*hd]
        return self.o_proj(out)  # [T, H]


class LlamaMLP(nn.Module):
    """SwiGLU MLP with gate and up fused into one [2*I, H] linear."""

    def __init__(self, config: Any, prefix: str, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size: int = inter
        # Rows: [gate (I) | up (I)], the layout SiluAndMul expects.
        self.gate_up_proj = Linear(
            hidden, 2 * inter, [Shard(f"{prefix}.gate_proj", inter), Shard(f"{prefix}.up_proj", inter)],
            bias=bias, dtype=dtype, device=device,
        )  # fmt: skip
        self.down_proj = Linear(
            inter, hidden, [Shard(f"{prefix}.down_proj", hidden)], bias=bias, dtype=dtype,
            device=device,
        )  # fmt: skip
        self.act_fn = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden)))  # [T, H]


MlpFactory = Callable[[Any, int, str, torch.dtype, torch.device], nn.Module]
"""``make_mlp(config, layer_idx, layer_prefix, dtype, device)``: a decoder layer's MLP,
[T, H] → [T, H] (a dense `LlamaMLP`, or a sparse MoE block in engine/models/mixtral.py)."""


def dense_mlp(
    config: Any, layer_idx: int, prefix: str, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """The Llama family's MLP: `LlamaMLP` under ``{prefix}.mlp``."""
    return LlamaMLP(config, f"{prefix}.mlp", dtype, device)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; takes and returns the (hidden, residual) pair of the vLLM stream."""

    def __init__(
        self,
        config: Any,
        prefix: str,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        device: torch.device,
        qkv_bias: bool,
        o_bias: bool,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        eps = float(config.rms_norm_eps)
        self.self_attn = LlamaAttention(
            config, f"{prefix}.self_attn", rotary, dtype, device, qkv_bias=qkv_bias, o_bias=o_bias
        )
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)

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

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        device: torch.device,
        qkv_bias: bool,
        o_bias: bool,
        make_mlp: MlpFactory = dense_mlp,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device)
        theta, scaling = rope_config(config)
        rotary = RotaryEmbedding(
            head_dim_of(config), config.max_position_embeddings, theta, scaling, dtype, device
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config,
                f"model.layers.{i}",
                rotary,
                dtype,
                device,
                qkv_bias=qkv_bias,
                o_bias=o_bias,
                mlp=make_mlp(config, i, f"model.layers.{i}", dtype, device),
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, float(config.rms_norm_eps), dtype, device)

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
    `head_dim`, `vocab_size`, plus `sliding_window` (None, or the window the runner must
    not exceed with max_model_len) and `dtype`.
    """

    qkv_bias_default: bool = False
    """Subclasses whose q/k/v always carry a bias (Qwen2) set this."""
    o_bias_follows_attention_bias: bool = True
    """Llama's `attention_bias` also adds a bias to o_proj; Qwen2's o_proj never has one."""
    make_mlp = staticmethod(dense_mlp)
    """Each decoder layer's MLP (`MlpFactory`); MoE subclasses return a sparse block."""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self._check_supported(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = self.qkv_bias_default or attention_bias
        o_bias = attention_bias and self.o_bias_follows_attention_bias
        self.config = config
        self.dtype = dtype
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_dim: int = head_dim_of(config)
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.max_position_embeddings: int = config.max_position_embeddings
        self.sliding_window: int | None = self._sliding_window(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

        self.model = LlamaModel(
            config, dtype, device, qkv_bias=qkv_bias, o_bias=o_bias, make_mlp=self.make_mlp
        )
        head_name = "model.embed_tokens" if self.tie_word_embeddings else "lm_head"
        self.lm_head = lm_head(
            self.model.embed_tokens, self.tie_word_embeddings, head_name, dtype, device
        )

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

    @staticmethod
    def _sliding_window(config: Any) -> int | None:
        window = getattr(config, "sliding_window", None)
        return int(window) if window else None

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
        """Copy HF-named checkpoint tensors into the (fused) parameters.

        Each `Linear` shard's ``.weight``/``.bias`` lands in its row slice; everything
        else maps one to one. Copies cast to the model dtype and move to its device.
        Raises on an unknown tensor or on any parameter slice left unwritten, so a wrong
        checkpoint never serves garbage.
        """
        targets = self._weight_targets()
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed by build_cos_sin_cache
                if name == "lm_head.weight" and self.tie_word_embeddings:
                    continue  # some tied checkpoints store it anyway; embed_tokens wins
                target = targets.get(name)
                if target is None:
                    raise ValueError(
                        f"unexpected tensor {name!r} in checkpoint for {type(self).__name__}"
                    )
                param, start, length = target
                dst = param if start is None else param.narrow(0, start, length)
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dst.shape)}"
                    )
                dst.copy_(tensor)
                loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")

    def _weight_targets(self) -> dict[str, tuple[torch.Tensor, int | None, int]]:
        """HF tensor name → (parameter, row offset or None for the whole tensor, rows)."""
        targets: dict[str, tuple[torch.Tensor, int | None, int]] = {
            "model.embed_tokens.weight": (self.model.embed_tokens.weight, None, 0),
            "model.norm.weight": (self.model.norm.weight, None, 0),
        }
        for module in self.modules():
            if not isinstance(module, Linear) or module.weight is self.model.embed_tokens.weight:
                continue
            single = len(module.shards) == 1
            for shard, start in module.shard_offsets():
                row = None if single else start
                targets[f"{shard.checkpoint}.weight"] = (module.weight, row, shard.rows)
                if module.bias is not None:
                    targets[f"{shard.checkpoint}.bias"] = (module.bias, row, shard.rows)
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            targets[f"{p}input_layernorm.weight"] = (layer.input_layernorm.weight, None, 0)
            targets[f"{p}post_attention_layernorm.weight"] = (
                layer.post_attention_layernorm.weight,
                None,
                0,
            )
        return targets


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama without biases; `sliding_window` is exposed for the runner to cap
    max_model_len (the window itself is not applied)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: bias on q/k/v (never on o_proj); sliding-window layers are refused."""

    qkv_bias_default = True
    o_bias_follows_attention_bias = False

    @staticmethod
    def _sliding_window(config: Any) -> int | None:
        layer_types = getattr(config, "layer_types", None) or []
        if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
            raise ValueError("Qwen2 with use_sliding_window=True is not supported")
        return None  # `sliding_window` is set in Qwen2 configs but unused without the flag
