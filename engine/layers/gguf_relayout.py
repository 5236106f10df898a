"""GGUF block formats without a kernel of their own, re-laid as blocks the kernels read.

The C kernels read Q4_1 and Q8_0 blocks (and 16-bit weights). Most GGUF files people
download are K-quants (`Q4_K_M`: Q4_K for most matrices, Q6_K for the output and half of
`attn_v` / `ffn_down`), or Q4_0 / Q5_0 / Q5_1. Without this, every tensor in such a format
kept its dense float32 weight: 4 bytes a weight streamed per step instead of ~0.6.

- **Q4_0 → Q4_1, exactly**: `d·(q - 8)` is the Q4_1 block `d·q + m` with `m = -8·d`, the
  same nibbles; -8·d is exact in float16 (a power-of-two multiple), so every value is the
  file's.
- **Q4_K → Q4_1, the same nibbles**: a Q4_K super-block of 256 is 8 sub-blocks of 32, each
  `d·sc·q - dmin·m` with 6-bit `sc`, `m`; that is a Q4_1 block with scale `d·sc` and offset
  `-dmin·m`, each rounded once to float16 (Q4_1 stores them so): at most 2⁻¹¹ of a weight's
  magnitude, against a quantization step of ~1/15 of the block's range.
- **Q5_0 → Q8_0, exactly**: `d·(q - 16)` with q < 32 is a Q8_0 block with the same `d`
  and int8 `q - 16` (so is Q4_0's, where a layer's other parts need Q8_0).
- **Everything else gguf-py dequantizes** (Q5_1, Q2_K, Q3_K, Q5_K, Q6_K, the IQ formats):
  requantized to Q8_0 from the file's own dequantized values by gguf-py's Q8_0 quantizer
  (llama.cpp's reference: one float16 scale per 32, `round(x / (amax / 127))`). The added
  error is at most half a Q8_0 step (amax / 254) plus the float16 rounding of its scale
  (amax · 2⁻¹¹): about an eighth of a Q6_K step.

Where one fused layer's checkpoint tensors come out in different kinds (Q4_K_M stores a
layer's `attn_v` as Q6_K beside Q4_K `attn_q` / `attn_k`), every part is brought to Q8_0 so
the layer is one packed weight (`relaid_parts`).

What each tensor became is counted (`Relayout.summary`) and said in the engine's log.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.layers.gguf_dequantize import dequantize
from kernels.cpu import ops

__all__ = ["KERNEL_KINDS", "Relayout", "as_q8_0", "relaid_parts", "relaid_rows"]

KERNEL_KINDS = ("q4_1", "q8_0", "f16", "bf16")
"""Stored formats the kernels read as they are (`kernels/cpu/ops.py` `KIND_CODES`)."""

_Q4_0_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_0][1]
_Q4_1_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_1][1]
_Q8_0_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][1]


def _q4_0_as_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_0 rows → Q4_1 rows with the same values: d stays, m = -8·d, nibbles as stored."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _Q4_0_BYTES)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    with np.errstate(over="ignore"):
        m = (d * np.float16(-8)).astype(np.float16)
    out = np.empty((rows, blocks.shape[1], _Q4_1_BYTES), np.uint8)
    out[..., 0:2] = blocks[..., 0:2]
    out[..., 2:4] = m.view(np.uint8).reshape(*m.shape, 2)
    out[..., 4:] = blocks[..., 2:]
    return out.reshape(rows, -1)


_C_REQUANT = ("q4_k", "q5_k", "q6_k")
"""K-quants the C library requantizes to Q8_0 itself (gguf-py's result bit for bit, in a
tenth of the time and without a float32 copy of the tensor)."""
_EXACT_Q8_0 = ("q4_0", "q5_0", "q8_0")
"""Formats whose value is `d·x` with one float16 `d` per 32 (first in the block) and an
integer `x` within int8: a Q8_0 block with the same `d` holds them exactly."""


def as_q8_0(kind: str, raw: np.ndarray) -> np.ndarray:
    """Rows of any format gguf-py dequantizes → Q8_0 rows: exactly for `_EXACT_Q8_0`
    (x = value / d, exact in float32), else by gguf-py's own Q8_0 quantizer."""
    if kind in _C_REQUANT:
        return ops.requantize_k(kind, raw)
    qtype = GGMLQuantizationType[kind.upper()]
    values = dequantize(raw, qtype)
    if kind not in _EXACT_Q8_0:
        return ops.quantize_q8_0(values)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, nb, 1]
    x = np.divide(
        values.reshape(rows, -1, 32),
        d,
        out=np.zeros((rows, blocks.shape[1], 32), np.float32),
        where=d != 0,
    )
    out = np.empty((rows, blocks.shape[1], _Q8_0_BYTES), np.uint8)
    out[..., 0:2] = blocks[..., 0:2]
    out[..., 2:] = np.rint(x).astype(np.int8).view(np.uint8)
    return out.reshape(rows, -1)


def relaid_rows(kind: str, raw: np.ndarray) -> tuple[str, np.ndarray]:
    """`raw` rows stored as `kind` (a GGML type name, lower case) in a format a kernel
    reads: as they are for the kernels' own kinds, else re-laid (module docstring)."""
    if kind in KERNEL_KINDS:
        return kind, raw
    if kind == "q4_k":
        out = ops.relay_q4_k(raw)
    elif kind == "q4_0":
        out = _q4_0_as_q4_1(raw)
        if not np.isfinite(_q4_1_scales(out)).all():  # -8·d past float16's range
            out = None
    else:
        return "q8_0", as_q8_0(kind, raw)
    return ("q8_0", as_q8_0(kind, raw)) if out is None else ("q4_1", out)


def _q4_1_scales(rows: np.ndarray) -> np.ndarray:
    blocks = rows.reshape(rows.shape[0], -1, _Q4_1_BYTES)
    return blocks[..., 0:4].copy().view(np.float16)


def relaid_parts(stored: list[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]]:
    """The parts of one layer (each `(kind, rows)` as stored) re-laid in one kind where
    they can be: each by `relaid_rows`, and where that gives Q4_1 beside Q8_0 (Q4_K_M's
    Q4_K `attn_q` beside its Q6_K `attn_v`), every part as Q8_0 from its stored rows
    (`as_q8_0`). Parts left in different kinds (16-bit beside blocks) keep the layer dense."""
    laid = [relaid_rows(kind, rows) for kind, rows in stored]
    if {kind for kind, _ in laid} != {"q4_1", "q8_0"}:
        return laid
    return [
        (kind, rows) if kind == "q8_0" else ("q8_0", as_q8_0(*part))
        for (kind, rows), part in zip(laid, stored, strict=True)
    ]


class Relayout:
    """Counts what a model's tensors were re-laid as, for the engine's log line."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def record(self, stored: str, used: str) -> None:
        if stored != used:
            self.counts[(stored, used)] += 1

    def summary(self) -> str:
        """E.g. "Q4_K as Q4_1: 60 tensors, Q6_K as Q8_0: 17 tensors", or ""."""
        return ", ".join(
            f"{stored.upper()} as {used.upper()}: {n} tensor{'s' * (n != 1)}"
            for (stored, used), n in sorted(self.counts.items())
        )
