"""A checkpoint's own weights in 16 bits for the C kernels: the fast path of a model that
ships no GGUF.

Most checkpoints are stored in bfloat16 (Llama 3, Qwen3, Gemma 3, SmolLM3...). On CPU the
engine loads them in float32, which widens every weight exactly, and the exact mode then
streams 4 bytes per weight through torch's float32 GEMM on every step. The same numbers fit
in 2 bytes: `HalfWeights` hands each linear's weight to the C kernels as bfloat16 when every
value of it is one (the weights are then exactly the checkpoint's, and only the order of the
float32 sums differs from the exact mode, as for a GGUF's blocks), or as IEEE float16 when
every value is one of those. The kernels widen each weight exactly and accumulate in
float32 (``hearth_f16_gemm`` / ``hearth_bf16w_gemm`` in ``kernels/cpu/hearth_cpu.c``).

A weight neither holds exactly (a float32 checkpoint) is rounded once to float16 (nearest
even, relative error at most 2^-11; bfloat16 only where a value is past float16's range,
which no linear weight seen is) when `rounding` allows it, and the loaded weight is then
overwritten by the rounded values, so that everything else that reads it (a token embedding
tied to the LM head, gguf-bf16's tiles) computes with the same model. Measured on a float32
SmolLM2 (docs/performance.md, "A model without a GGUF"), that rounding passes the quality
bar by a wide margin, unlike Q8_0 at load (`engine/layers/q8_0_weights.py`).

Layers the kernels can't take (columns not whole 32-column blocks, rows not whole groups: a
two-label classifier head) keep their dense method.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.layers.gguf_linear import fits_kernels
from engine.layers.gguf_relayout import LaidRows
from engine.layers.linear import Linear

__all__ = ["HalfWeights", "half_rows"]

F16_MAX = 65504.0
_HELD = {torch.bfloat16: "bf16", torch.float16: "f16"}


def half_rows(weight: torch.Tensor, rounding: bool) -> tuple[str, torch.Tensor, bool] | None:
    """`weight` (``[rows, k]``) as 16-bit values: ``("bf16" | "f16", int16 tensor, exact)``,
    the kind that holds every value exactly (bfloat16 first), else, with `rounding`, float16
    rounded to nearest even (bfloat16 where a value is past float16's range); None without
    `rounding` when no kind is exact."""
    if weight.dtype in _HELD:  # held in its checkpoint's own 16 bits (weight_storage.py)
        return _HELD[weight.dtype], weight.detach().view(torch.int16), True
    w = weight.detach().to(torch.float32)
    bits = w.view(torch.int32)
    if not bool((bits & 0xFFFF).any()):  # every value is a bfloat16: its top 16 bits
        return "bf16", (bits >> 16).to(torch.int16), True
    half = w.to(torch.float16)
    exact = torch.equal(half.to(torch.float32), w)
    if exact or (rounding and not bool(half.isinf().any())):
        return "f16", half.view(torch.int16), exact
    if rounding:  # past float16's range (inf there): bfloat16 keeps the range
        return "bf16", w.to(torch.bfloat16).view(torch.int16), False
    return None


class HalfWeights:
    """The block source of a model without a GGUF: each linear's own weight in 16 bits."""

    def __init__(self, rounding: bool) -> None:
        self.rounding = rounding
        self.rounded = 0
        """Weights that no 16-bit kind held exactly and were rounded to float16."""

    def describe(self) -> str:
        what = "the checkpoint's own weights"
        return what + (f", {self.rounded} rounded to float16" if self.rounded else "")

    def rows(self, layer: Linear, row_multiple: int) -> LaidRows | None:
        """`layer`'s weight as 16-bit rows (uint8 ``[rows, 2k]``, little-endian), or None
        when the kernels can't take its shape, or no 16-bit kind holds it and rounding is
        off. A rounded weight replaces the loaded one."""
        weight = layer.weight
        if not fits_kernels(weight, row_multiple):
            return None
        found = half_rows(weight, self.rounding)
        if found is None:
            return None
        kind, half, exact = found
        if not exact:
            self.rounded += 1
            with torch.no_grad():
                weight.copy_(half.view(torch.float16 if kind == "f16" else torch.bfloat16))
        return LaidRows(kind, ((kind, half.numpy().view(np.uint8)),))
