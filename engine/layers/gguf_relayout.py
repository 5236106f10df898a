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
the layer is one packed weight (`LaidRows.of`).

What each tensor became is counted (`Relayout.summary`) and said in the engine's log.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.layers.gguf_dequantize import dequantize
from kernels.cpu import ops

__all__ = ["KERNEL_KINDS", "LaidRows", "Relayout", "as_q8_0", "laid_kind", "relaid_rows"]

KERNEL_KINDS = ("q4_1", "q8_0", "f16", "bf16")
"""Stored formats the kernels read as they are (`kernels/cpu/ops.py` `KIND_CODES`)."""

_Q8_0_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][1]


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


def laid_kind(stored: str, raw: np.ndarray) -> str:
    """The kernel kind rows stored as `stored` (a GGML type name, lower case) are read as:
    their own for the kernels' kinds, Q4_1 for Q4_0 and Q4_K (unless a scale would pass
    float16's range), else Q8_0 (module docstring)."""
    if stored in KERNEL_KINDS:
        return stored
    if stored in ("q4_0", "q4_k") and not ops.q4_1_overflows(stored, raw):
        return "q4_1"
    return "q8_0"


def _relaid(kind: str, stored: str, raw: np.ndarray) -> np.ndarray:
    """`raw` rows stored as `stored` re-laid as rows of `kind` (one `laid_kind` allows)."""
    if stored == kind:
        return raw
    if kind == "q8_0":
        return as_q8_0(stored, raw)
    out = ops.relay_as_q4_1(stored, raw)
    if out is None:
        raise ValueError(f"{stored} scales past float16's range cannot be re-laid as Q4_1")
    return out


def relaid_rows(kind: str, raw: np.ndarray) -> tuple[str, np.ndarray]:
    """`raw` rows stored as `kind` in a format a kernel reads: as they are for the kernels'
    own kinds, else re-laid (module docstring)."""
    laid = laid_kind(kind, raw)
    return laid, _relaid(laid, kind, raw)


@dataclass(frozen=True, slots=True)
class LaidRows:
    """A linear's rows as its source stores them (`parts`, each ``(format, uint8 rows)`` in
    the layer's row order: a fused layer's q, k and v as the file has them) and the one
    kernel kind all of them are read as (`kind`). Nothing is re-laid until it is packed:
    `pack` re-lays each part block by block straight into the packed weight
    (`ops.pack_parts`), `joined` gives the rows whole for the packers that read them so."""

    kind: str
    parts: tuple[tuple[str, np.ndarray], ...]

    @classmethod
    def of(cls, stored: list[tuple[str, np.ndarray]]) -> LaidRows | None:
        """The parts of one layer read in one kind: each part's `laid_kind`, and where that
        gives Q4_1 beside Q8_0 (Q4_K_M's Q4_K `attn_q` beside its Q6_K `attn_v`), every part
        as Q8_0 from its stored rows. None for parts left in different kinds (16-bit beside
        blocks: the layer stays dense)."""
        kinds = {laid_kind(kind, rows) for kind, rows in stored}
        if kinds == {"q4_1", "q8_0"}:
            kinds = {"q8_0"}
        return cls(kinds.pop(), tuple(stored)) if len(kinds) == 1 else None

    def joined(self) -> np.ndarray:
        """Every part's rows re-laid as `kind`, one array."""
        laid = [_relaid(self.kind, stored, rows) for stored, rows in self.parts]
        return laid[0] if len(laid) == 1 else np.concatenate(laid, axis=0)

    def pack(self, bias: torch.Tensor | None = None) -> ops.PackedWeight:
        """The rows packed for `kind`'s kernel: parts of a format the C packer re-lays go as
        stored, the rest re-laid here first; whole when a part is not whole row groups."""
        if any(rows.shape[0] % ops.GROUP for _, rows in self.parts):
            return ops.pack(self.kind, self.joined(), bias)
        parts = [
            (stored, rows)
            if stored in ops.PACKED_FROM[self.kind]
            else (self.kind, _relaid(self.kind, stored, rows))
            for stored, rows in self.parts
        ]
        return ops.pack_parts(self.kind, parts, bias)

    def describe_into(self, relayout: Relayout) -> None:
        """Count each part's format and the kind it is read as."""
        for stored, _ in self.parts:
            relayout.record(stored, self.kind)


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
