"""Native Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) on the paged KV cache.

The engine runs one forward per step over the *flattened* tokens of every scheduled
sequence (decodes first, then prefill chunks; no batch dim, no padding), so this module
differs from transformers' in three ways that matter:

- attention goes through `kernels.write_kv_cache` + `kernels.paged_attention`, driven by
  the step's `AttentionMetadata` instead of an attention mask;
- q/k/v and gate/up projections are fused into one matmul each (`qkv_proj`,
  `gate_up_proj`), built by `load_weights` from the HF checkpoint's separate tensors;
- the residual stream follows vLLM: each layer returns `(hidden, residual)` and the next
  norm is `fused_add_rms_norm`, saving one read and write of the stream per norm.

Numerics otherwise follow transformers exactly (same op order in float32), which the
parity tests check token for token.

Limits: sliding-window attention is not implemented. Mistral configs carry a
`sliding_window`; the model exposes it as `self.sliding_window` and the runner must keep
`max_model_len <= sliding_window` (then the window never cuts anything and the result is
exact). Qwen2 with `use_sliding_window=True` is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import (
    build_cos_sin_cache,
    fused_add_rms_norm,
    paged_attention,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    write_kv_cache,
)
from kernels.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]
"""(k_cache, v_cache) of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised, frozen parameter: `load_weights` overwrites every element."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def head_dim_of(config: Any) -> int:
    """Per-head width: the config's explicit `head_dim` (which may differ from
    hidden/heads, e.g. Mistral Nemo) or hidden/heads. One rule, so the attention layers
    and the KV cache the runner sizes from `LlamaForCausalLM.head_dim` always agree."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_config(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a transformers 5 or 4 style config.

    transformers 5 folds theta and scaling into `config.rope_parameters`
    (`{"rope_type": "llama3", "rope_theta": ..., "factor": ...}`); older configs have
    `rope_theta` plus an optional `rope_scaling`. The scaling dict handed to the kernel
    always carries `rope_type` and never `rope_theta`; `None` means plain RoPE.
    """
    params = getattr(config, "rope_parameters", None)
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
    if rope_type == "llama3" and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = config.max_position_embeddings
    return theta, scaling


class LlamaAttention(nn.Module):
    """Fused-QKV attention over the paged cache (GQA: num_kv_heads divides num_heads)."""

    def __init__(
        self,
        config: Any,
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
        self.scale = self.head_dim**-0.5
        # Rows: [q (num_heads*head_dim) | k (num_kv_heads*head_dim) | v (same)].
        self.qkv_proj = _empty((self.q_size + 2 * self.kv_size, hidden), dtype, device)
        self.qkv_bias = (
            _empty((self.q_size + 2 * self.kv_size,), dtype, device) if qkv_bias else None
        )
        self.o_proj = _empty((hidden, self.q_size), dtype, device)
        self.o_bias = _empty((hidden,), dtype, device) if o_bias else None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = F.linear(hidden, self.qkv_proj, self.qkv_bias)  # [T, q_size + 2*kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, nh, hd]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, nkv, hd]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, nkv, hd]
        q, k = rotary_embedding(positions, q, k, cos_sin_cache)
        k_cache, v_cache = kv_cache
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, nh, hd]
        out = out.reshape(num_tokens, self.q_size)  # [T, nh*hd]
        return F.linear(out, self.o_proj, self.o_bias)  # [T, H]


class LlamaMLP(nn.Module):
    """SwiGLU MLP with gate and up fused into one [2*I, H] weight."""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size: int = inter
        # Rows: [gate (I) | up (I)], the layout silu_and_mul expects.
        self.gate_up_proj = _empty((2 * inter, hidden), dtype, device)
        self.gate_up_bias = _empty((2 * inter,), dtype, device) if bias else None
        self.down_proj = _empty((hidden, inter), dtype, device)
        self.down_bias = _empty((hidden,), dtype, device) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(hidden, self.gate_up_proj, self.gate_up_bias)  # [T, 2I]
        act = silu_and_mul(gate_up)  # [T, I]
        return F.linear(act, self.down_proj, self.down_bias)  # [T, H]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; takes and returns the (hidden, residual) pair of the vLLM stream."""

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        device: torch.device,
        qkv_bias: bool,
        o_bias: bool,
    ) -> None:
        super().__init__()
        self.eps = float(config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, dtype, device, qkv_bias=qkv_bias, o_bias=o_bias)
        self.mlp = LlamaMLP(config, dtype, device)
        self.input_layernorm = _empty((config.hidden_size,), dtype, device)
        self.post_attention_layernorm = _empty((config.hidden_size,), dtype, device)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # first layer: the embedding output is the residual
            residual = hidden
            hidden = rms_norm(hidden, self.input_layernorm, self.eps)
        else:  # residual <- hidden + residual; hidden <- norm(residual)
            hidden, residual = fused_add_rms_norm(hidden, residual, self.input_layernorm, self.eps)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin_cache)
        hidden, residual = fused_add_rms_norm(
            hidden, residual, self.post_attention_layernorm, self.eps
        )
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
    ) -> None:
        super().__init__()
        self.eps = float(config.rms_norm_eps)
        self.embed_tokens = _empty((config.vocab_size, config.hidden_size), dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype, device, qkv_bias=qkv_bias, o_bias=o_bias)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = _empty((config.hidden_size,), dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed_tokens)  # [T, H]
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, cos_sin_cache)
        if residual is None:  # zero layers: only the final norm
            return rms_norm(hidden, self.norm, self.eps)
        hidden, _ = fused_add_rms_norm(hidden, residual, self.norm, self.eps)
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

        self.model = LlamaModel(config, dtype, device, qkv_bias=qkv_bias, o_bias=o_bias)
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens  # the same Parameter: no copy
        else:
            self.lm_head = _empty((config.vocab_size, config.hidden_size), dtype, device)

        theta, scaling = rope_config(config)
        cos_sin = build_cos_sin_cache(
            self.head_dim, self.max_position_embeddings, theta, dtype, device, scaling
        )  # [max_position, head_dim] = cat(cos, sin)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)
        self.native: Any = None
        """A `NativeCpuForward` once the engine turns the CPU fast path on (`use_native`)."""

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
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, H] of the step's flattened tokens (input_ids/positions: [T] int64).

        `kv_caches[i]` is layer i's (k_cache, v_cache); this step's K/V are written into
        the slots `meta.slot_mapping` names before attention reads them.
        """
        if self.native is not None:
            return self.native.forward(input_ids, positions, kv_caches, meta)
        return self.model(input_ids, positions, kv_caches, meta, self.cos_sin_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, V] of the N rows that will be sampled (never all prefill tokens).

        The matmul runs in the model dtype (as transformers does) and is upcast after.
        """
        if self.native is not None:
            return self.native.compute_logits(hidden)
        return F.linear(hidden, self.lm_head).float()  # [N, V]

    # -- weights ------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the fused parameters.

        `q_proj/k_proj/v_proj` land in row slices of `qkv_proj` (and `*_bias`),
        `gate_proj/up_proj` in `gate_up_proj`; everything else maps one to one. Copies
        cast to the model dtype and move to its device. Raises on an unknown tensor or
        on any parameter slice left unwritten, so a wrong checkpoint never serves garbage.
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
            "model.embed_tokens.weight": (self.model.embed_tokens, None, 0),
            "model.norm.weight": (self.model.norm, None, 0),
        }
        if not self.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head, None, 0)
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            q, kv = attn.q_size, attn.kv_size
            shards = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
            for proj, (start, rows) in shards.items():
                targets[f"{p}self_attn.{proj}.weight"] = (attn.qkv_proj, start, rows)
                if attn.qkv_bias is not None:
                    targets[f"{p}self_attn.{proj}.bias"] = (attn.qkv_bias, start, rows)
            targets[f"{p}self_attn.o_proj.weight"] = (attn.o_proj, None, 0)
            if attn.o_bias is not None:
                targets[f"{p}self_attn.o_proj.bias"] = (attn.o_bias, None, 0)
            inter = mlp.intermediate_size
            for proj, start in (("gate_proj", 0), ("up_proj", inter)):
                targets[f"{p}mlp.{proj}.weight"] = (mlp.gate_up_proj, start, inter)
                if mlp.gate_up_bias is not None:
                    targets[f"{p}mlp.{proj}.bias"] = (mlp.gate_up_bias, start, inter)
            targets[f"{p}mlp.down_proj.weight"] = (mlp.down_proj, None, 0)
            if mlp.down_bias is not None:
                targets[f"{p}mlp.down_proj.bias"] = (mlp.down_bias, None, 0)
            targets[f"{p}input_layernorm.weight"] = (layer.input_layernorm, None, 0)
            targets[f"{p}post_attention_layernorm.weight"] = (
                layer.post_attention_layernorm,
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
