"""The GGUF file's own quantized blocks as the linear weights of a native Llama model.

The default model ships as a Q4_1 GGUF (token embedding Q8_0). The float32 model the
engine loads is that file dequantized, so computing straight from the blocks is the same
function with ~1/6 of the bytes per weight: a decode step streams ~95 MB instead of
540 MB. This module reads the blocks with gguf-py, puts each tensor's rows in the order
of the Hugging Face layout the native model uses, and packs them for the C kernels.

Row order is not assumed: llama.cpp's converter permutes the rows of Q and K for some
architectures, and transformers undoes it on load. For every tensor, sample rows are
dequantized with gguf-py and compared bit for bit with the float32 weights already
loaded, under the identity and under transformers' reverse permutation; a tensor that
matches neither (or has a block type without a kernel) stays a dense float32 weight.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels.cpu import ops

logger = logging.getLogger("hearth.engine")

CONVERSION_MARKER = "hearth-conversion.json"
"""Written by the model loader next to a converted GGUF; names the source file."""

_KINDS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted model directory came from, if it still exists."""
    marker = Path(model_dir) / CONVERSION_MARKER
    try:
        source = Path(json.loads(marker.read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return source if source.is_file() else None


@dataclass
class PackedLayer:
    qkv: ops.PackedWeight | None = None
    o_proj: ops.PackedWeight | None = None
    gate_up: ops.PackedWeight | None = None
    down: ops.PackedWeight | None = None


@dataclass
class PackedModel:
    """Packed weights by role; None where the dense float32 weight is used instead."""

    layers: list[PackedLayer]
    lm_head: ops.PackedWeight | None = None
    kinds: dict[str, int] = field(default_factory=dict)
    """How many tensors of each block kind were packed (for the start-up log)."""

    @property
    def nbytes(self) -> int:
        weights = [self.lm_head] + [
            w for layer in self.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        ]
        return sum(w.nbytes for w in weights if w is not None)


def _reverse_permute_rows(n: int, heads: int) -> np.ndarray:
    """Row order transformers' GGUF loader applies to Q/K (undoing llama.cpp's permute)."""
    dim = n // heads // 2
    return np.arange(n).reshape(heads, dim, 2).swapaxes(2, 1).reshape(n)


def _sample_rows(n: int) -> list[int]:
    return sorted({0, 1, 2, 3, n // 3, n // 2 + 1, n - 2, n - 1})


class _Source:
    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.reader = GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}

    def raw(self, name: str) -> tuple[str, np.ndarray] | None:
        tensor = self.tensors.get(name)
        if tensor is None:
            return None
        kind = _KINDS.get(tensor.tensor_type.name)
        if kind is None:
            return None
        data = np.asarray(tensor.data)
        return kind, data.reshape(data.shape[0], -1) if data.ndim != 2 else data


def _rows_match(kind: str, raw: np.ndarray, dense: torch.Tensor) -> bool:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType.Q4_1 if kind == "q4_1" else GGMLQuantizationType.Q8_0
    rows = _sample_rows(raw.shape[0])
    got = torch.from_numpy(dequantize(raw[rows], qtype).astype(np.float32))
    return bool(got.shape == dense[rows].shape and torch.equal(got, dense[rows].float()))


def _ordered(
    src: _Source, name: str, dense: torch.Tensor, heads: int | None
) -> tuple[str, np.ndarray] | None:
    """`name`'s raw rows in the dense weight's order, or None when they can't be matched."""
    found = src.raw(name)
    if found is None:
        return None
    kind, raw = found
    if raw.shape[0] != dense.shape[0]:
        return None
    candidates = [raw]
    if heads:
        candidates.append(raw[_reverse_permute_rows(raw.shape[0], heads)])
    for rows in candidates:
        if _rows_match(kind, rows, dense):
            return kind, np.ascontiguousarray(rows)
    logger.warning("GGUF tensor %s does not match the loaded weights; using float32", name)
    return None


def _fused(
    parts: list[tuple[str, np.ndarray] | None], bias: torch.Tensor | None
) -> ops.PackedWeight | None:
    if any(p is None for p in parts):
        return None
    kinds = {p[0] for p in parts if p is not None}
    if len(kinds) != 1:
        return None
    rows = np.concatenate([p[1] for p in parts if p is not None], axis=0)
    try:
        return ops.pack(kinds.pop(), rows, bias)
    except ValueError:
        return None


def pack_gguf_weights(model: Any, gguf_path: Path) -> PackedModel:
    """Pack every linear of `model` (a loaded native Llama) that the GGUF holds in a
    supported block format and whose rows match the loaded float32 weights."""
    src = _Source(gguf_path)
    layers: list[PackedLayer] = []
    kinds: dict[str, int] = {}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        p = f"blk.{i}."
        q, kv = attn.q_size, attn.kv_size
        qkv_w = attn.qkv_proj
        qkv = _fused(
            [
                _ordered(src, p + "attn_q.weight", qkv_w[:q], attn.num_heads),
                _ordered(src, p + "attn_k.weight", qkv_w[q : q + kv], attn.num_kv_heads),
                _ordered(src, p + "attn_v.weight", qkv_w[q + kv :], None),
            ],
            attn.qkv_bias,
        )
        o = _fused([_ordered(src, p + "attn_output.weight", attn.o_proj, None)], attn.o_bias)
        inter = mlp.intermediate_size
        gate_up = _fused(
            [
                _ordered(src, p + "ffn_gate.weight", mlp.gate_up_proj[:inter], None),
                _ordered(src, p + "ffn_up.weight", mlp.gate_up_proj[inter:], None),
            ],
            mlp.gate_up_bias,
        )
        down = _fused([_ordered(src, p + "ffn_down.weight", mlp.down_proj, None)], mlp.down_bias)
        packed = PackedLayer(qkv, o, gate_up, down)
        for w in (qkv, o, gate_up, down):
            if w is not None:
                kinds[w.kind] = kinds.get(w.kind, 0) + 1
        layers.append(packed)
    head_name = "token_embd.weight" if model.tie_word_embeddings else "output.weight"
    if not model.tie_word_embeddings and "output.weight" not in src.tensors:
        head_name = "token_embd.weight"  # GGUFs may drop a duplicate head
    lm_head = _fused([_ordered(src, head_name, model.lm_head, None)], None)
    if lm_head is not None:
        kinds[lm_head.kind] = kinds.get(lm_head.kind, 0) + 1
    return PackedModel(layers, lm_head, kinds)
