"""A GGUF tensor's blocks as float32 values: the C library's dequantizer where it reads the
format, gguf-py's otherwise — the same values bit for bit (tests/kernels/test_relayout.py).

Why not gguf-py alone: its numpy dequantizers run at ~117 M values/s on one thread, and an
exact (`--quantization none`) start from a GGUF dequantizes every weight at every start
(~7 s of a 0.8 B model's 11.5 s), as does any tensor a kernel cannot read as stored.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType

from kernels.cpu import ops

__all__ = ["dequantize"]


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`raw` (a tensor's bytes shaped `[*outer, row bytes]`, as `GGUFSource.stored` gives
    them; float arrays for F32 / F16 / BF16) as float32 `[*outer, columns]`. Raises
    NotImplementedError for a type gguf-py cannot dequantize either."""
    kind = qtype.name.lower()
    if raw.ndim >= 1 and raw.dtype == np.uint8 and ops.dequantizes(kind):
        rows = raw.reshape(-1, raw.shape[-1])
        values = ops.dequantize(kind, rows)
        return values.reshape(*raw.shape[:-1], values.shape[-1])
    from gguf.quants import dequantize as gguf_dequantize

    return np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32)
