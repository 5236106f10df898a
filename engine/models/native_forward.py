"""The CPU fast path of a native Llama model: one pass over the layers through C kernels.

Where `LlamaForCausalLM.forward` composes torch ops (the exact float32 mode, bit-faithful
to transformers), this walks the same parameters with the kernels of `kernels.cpu`:

- linears from the GGUF blocks (`gguf_weights`), dense float32 where a tensor has none;
- RMSNorm fused with the residual add, in place;
- rotary fused with the KV-cache write, in place on the fused qkv rows;
- attention that reads the paged cache in place, one query token at a time, so decodes
  and prefill chunks take the same path (no gather of every sequence's KV per layer);
- SiLU-and-mul in one pass.

About ten C calls per layer and no per-token Python. Every kernel computes a token's
result from that token alone (see kernels/cpu/hearth_cpu.c), so outputs do not change
with batch size, chunking or thread count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.models.gguf_weights import PackedModel
from kernels.cpu import ops
from kernels.metadata import AttentionMetadata


class NativeCpuForward:
    """Forward and logits of a loaded native Llama through the C kernels."""

    def __init__(self, model: Any, packed: PackedModel) -> None:
        self.model = model
        self.packed = packed
        self.eps = model.model.eps
        self.scratch = ops.AttentionScratch()
        first = model.model.layers[0].self_attn if model.model.layers else None
        self.num_heads = first.num_heads if first else 0
        self.num_kv_heads = first.num_kv_heads if first else 0
        self.head_dim = first.head_dim if first else 0
        self.scale = first.scale if first else 1.0
        self._fused: tuple[tuple[int, ...], object] | None = None
        """(cache data pointers, ctypes layer array) for `ops.forward_layers`, built on the
        first step (the runner's KV cache tensors never change)."""

    def _fused_layers(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        """The ctypes layer array when every linear is packed (else None: per-op path)."""
        key = tuple(k.data_ptr() for k, _ in kv_caches)
        if self._fused is not None and self._fused[0] == key:
            return self._fused[1]
        inner = self.model.model
        rows = []
        for layer, p, (k_cache, v_cache) in zip(
            inner.layers, self.packed.layers, kv_caches, strict=True
        ):
            ws = [p.qkv, p.o_proj, p.gate_up, p.down]
            if any(w is None for w in ws):
                self._fused = (key, None)
                return None
            rows.append(
                ops.layer_weights(
                    ws, layer.input_layernorm, layer.post_attention_layernorm, k_cache, v_cache
                )
            )
        array = (ops.LayerWeights * len(rows))(*rows)
        self._fused = (key, array)
        return array

    @staticmethod
    def supported(model: Any, dtype: torch.dtype, device: torch.device) -> str | None:
        """None when the fast path can run this model, else why not."""
        if device.type != "cpu" or dtype != torch.float32:
            return "the fast CPU path computes in float32 on the CPU"
        if model.head_dim % 32:
            return f"head_dim {model.head_dim} is not a multiple of 32"
        if not ops.available():
            return "no AVX2 on this host"
        return None

    @staticmethod
    def _linear(
        x: torch.Tensor,
        packed: ops.PackedWeight | None,
        dense: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        if packed is not None:
            return ops.linear(x, packed)
        return F.linear(x, dense, bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        inner = self.model.model
        eps = self.eps
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        cos_sin = self.model.cos_sin_cache
        tables, token_seq, token_ctx = meta.seq_block_tables, meta.token_seq, meta.token_ctx
        if tables is None or token_seq is None or token_ctx is None:
            raise ValueError("the native CPU path needs the step's per-token attention metadata")
        slots = meta.slot_mapping
        hidden = F.embedding(input_ids, inner.embed_tokens)  # [T, H]
        fused = self._fused_layers(kv_caches) if inner.layers else None
        if fused is not None:
            block_size = kv_caches[0][0].shape[1]
            return ops.forward_layers(
                fused, hidden, nh, nkv, hd, inner.layers[0].mlp.intermediate_size, eps,
                self.scale, positions, cos_sin, slots, block_size, tables, token_seq,
                token_ctx, meta.max_ctx, inner.norm, self.scratch,
            )  # fmt: skip
        residual = hidden
        x = ops.rms_norm(hidden, inner.layers[0].input_layernorm, eps) if inner.layers else hidden
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(inner.layers, kv_caches, strict=True)):
            packed = self.packed.layers[i]
            attn, mlp = layer.self_attn, layer.mlp
            if i > 0:  # residual += x; x = norm(residual)
                ops.add_rms_norm_(x, residual, layer.input_layernorm, eps)
            qkv = self._linear(x, packed.qkv, attn.qkv_proj, attn.qkv_bias)
            ops.rope_and_write_kv_(qkv, nh, nkv, hd, positions, cos_sin, k_cache, v_cache, slots)
            out = ops.paged_attention(
                qkv,
                nh,
                nkv,
                hd,
                k_cache,
                v_cache,
                tables,
                token_seq,
                token_ctx,
                meta.max_ctx,
                self.scale,
                self.scratch,
            )
            x = self._linear(out, packed.o_proj, attn.o_proj, attn.o_bias)
            ops.add_rms_norm_(x, residual, layer.post_attention_layernorm, eps)
            gate_up = self._linear(x, packed.gate_up, mlp.gate_up_proj, mlp.gate_up_bias)
            x = self._linear(ops.silu_and_mul(gate_up), packed.down, mlp.down_proj, mlp.down_bias)
        if not inner.layers:
            return ops.rms_norm(hidden, inner.norm, eps)
        ops.add_rms_norm_(x, residual, inner.norm, eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed.lm_head is not None:
            return ops.linear(hidden.contiguous(), self.packed.lm_head)
        return F.linear(hidden, self.model.lm_head).float()
