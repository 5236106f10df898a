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

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.model_resolver import gguf_source
from kernels.cpu import ops

__all__ = ["PackedLayer", "PackedModel", "gguf_source", "pack_gguf_weights"]

logger = logging.getLogger("hearth.engine")


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


_GGML_KINDS = {3: "q4_1", 8: "q8_0"}
"""GGML type ids of the block formats the kernels read (Q4_1, Q8_0)."""
_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF metadata value types of fixed size (8 = string and 9 = array are variable)."""


class _Source:
    """Tensor index of a GGUF file, read straight from its header.

    gguf-py's reader also decodes every metadata field into numpy views (the 49k-token
    vocabulary alone is ~100k of them), which took seconds; only the tensor table is
    needed here, so the metadata is skipped with plain `struct` reads.
    """

    def __init__(self, path: Path) -> None:
        import struct

        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        buf = self.data
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        pos = 24
        alignment = 32

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, at)
            return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

        def skip_value(kind: int, at: int) -> int:
            if kind in _SCALAR_BYTES:
                return at + _SCALAR_BYTES[kind]
            if kind == 8:
                (n,) = struct.unpack_from("<Q", buf, at)
                return at + 8 + n
            if kind == 9:
                elem, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if elem in _SCALAR_BYTES:
                    return at + count * _SCALAR_BYTES[elem]
                for _ in range(count):
                    at = skip_value(elem, at)
                return at
            raise ValueError(f"unknown GGUF metadata type {kind}")

        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if key == "general.alignment" and kind == 4:
                (alignment,) = struct.unpack_from("<I", buf, pos)
            pos = skip_value(kind, pos)
        infos: list[tuple[str, list[int], int, int]] = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = list(struct.unpack_from(f"<{n_dims}Q", buf, pos + 4))
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, kind, offset))
        start = -(-pos // alignment) * alignment
        self.tensors = {name: (dims, kind, start + offset) for name, dims, kind, offset in infos}

    def raw(self, name: str) -> tuple[str, np.ndarray] | None:
        """`name`'s rows as stored (uint8, [rows, row bytes]) when its blocks have a kernel."""
        info = self.tensors.get(name)
        if info is None:
            return None
        dims, kind_id, offset = info
        kind = _GGML_KINDS.get(kind_id)
        if kind is None or len(dims) != 2 or dims[0] % 32:
            return None
        cols, rows = dims
        row_bytes = cols // 32 * _BLOCK_BYTES[kind]
        return kind, self.data[offset : offset + rows * row_bytes].reshape(rows, row_bytes)


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
