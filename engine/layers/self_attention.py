"""The self-attention block of every decoder here: fused QKV, optional per-head q/k norm,
optional rotary, paged attention (optionally windowed), output projection.

One class for Llama, Mistral, Qwen2/3, Gemma 3, Phi-3 and SmolLM3 (and the MoE models,
whose attention is the dense one): what differs between them is data (biases, a q/k
norm, the scale, the window, a layer without rotary, whether the checkpoint already
fuses qkv), not code, so each model file passes its values and writes no forward.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.attention import Attention
from engine.layers.linear import Linear, Shard
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from kernels.metadata import AttentionMetadata


class SelfAttention(nn.Module):
    """``o_proj(attn(rope(norm(q)), rope(norm(k)), v))`` over the paged cache (GQA).

    - `rotary`: the (shared) rotary table, or None for a NoPE layer (SmolLM3);
    - `qk_norm_eps`: RMSNorm over each head's q and k before rotary (Qwen3, Gemma 3),
      with `norm_weight_offset` for Gemma's ``(1 + w)``; None: no q/k norm;
    - `scale`: the softmax scale (default ``head_dim ** -0.5``; Gemma:
      ``query_pre_attn_scalar ** -0.5``);
    - `sliding_window`: this layer's window (None: global);
    - `sinks`: per-head attention sinks (gpt-oss), a parameter of `attn`;
    - `fused_checkpoint`: the checkpoint stores one ``qkv_proj`` tensor (Phi-3) instead
      of ``q_proj``/``k_proj``/``v_proj``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        prefix: str,
        *,
        rotary: RotaryEmbedding | None,
        dtype: torch.dtype,
        device: torch.device,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        norm_weight_offset: float = 0.0,
        scale: float | None = None,
        sliding_window: int | None = None,
        fused_checkpoint: bool = False,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        total = self.q_size + 2 * self.kv_size
        if fused_checkpoint:
            shards = [Shard(f"{prefix}.qkv_proj", total)]
        else:
            shards = [
                Shard(f"{prefix}.q_proj", self.q_size, rotary_heads=num_heads),
                Shard(f"{prefix}.k_proj", self.kv_size, rotary_heads=num_kv_heads),
                Shard(f"{prefix}.v_proj", self.kv_size),
            ]
        # Rows: [q (num_heads*head_dim) | k (num_kv_heads*head_dim) | v (same)].
        self.qkv_proj = Linear(
            hidden_size, total, shards, bias=qkv_bias, dtype=dtype, device=device
        )
        self.o_proj = Linear(
            self.q_size, hidden_size, [Shard(f"{prefix}.o_proj", hidden_size)], bias=o_bias,
            dtype=dtype, device=device,
        )  # fmt: skip
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype, device, norm_weight_offset)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype, device, norm_weight_offset)
        self.rotary_emb = rotary  # shared by the layers of one rope kind (one cos/sin table)
        self.attn = Attention(
            num_heads, num_kv_heads, head_dim, head_dim**-0.5 if scale is None else scale,
            sliding_window=sliding_window, sinks=sinks, dtype=dtype, device=device,
        )  # fmt: skip

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2*kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm.per_head(q, self.num_heads)
            k = self.k_norm.per_head(k, self.num_kv_heads)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, nh, hd]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, nkv, hd]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, nkv, hd]
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, meta)  # [T, nh*hd]
        return self.o_proj(out)  # [T, H]
