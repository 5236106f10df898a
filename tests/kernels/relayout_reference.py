"""numpy references of the C GGUF re-layout (kernels/cpu/hearth_cpu.c, "GGUF re-layout"):
what engine/layers/gguf_relayout.py computed in numpy before it moved to C, checked
against gguf-py's dequantizer in tests/engine/test_gguf_relayout.py."""

from __future__ import annotations

import numpy as np

__all__ = ["q4_k_as_q4_1", "q4_k_scales"]

_Q4_K_BYTES = 144
_Q4_1_BYTES = 20


def _f16(values: np.ndarray) -> np.ndarray:
    """float32 → the little-endian bytes of float16, round to nearest even."""
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins packed in a Q4_K / Q5_K block's 12 bytes
    (ggml's `get_scale_min_k4`), as `[..., 8]` uint8 each."""
    s = scales.astype(np.uint8)
    sc = np.empty((*s.shape[:-1], 8), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def q4_k_as_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_K rows → Q4_1 rows: one Q4_1 block per 32-column sub-block, its nibbles as the
    file's, scale `d·sc` and offset `-dmin·m` (computed in float32, exact there) rounded
    once to float16."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _Q4_K_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, nb, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = q4_k_scales(blocks[..., 4:16])
    scale = d * sc.astype(np.float32)  # [rows, nb, 8]
    offset = -(dmin * mn.astype(np.float32))
    qs = blocks[..., 16:].reshape(rows, -1, 4, 32)  # 4 chunks of 32 bytes: 2 sub-blocks each
    nib = np.empty((rows, qs.shape[1], 4, 2, 32), np.uint8)
    nib[..., 0, :] = qs & 0xF  # sub-block 2c: the low nibbles of chunk c
    nib[..., 1, :] = qs >> 4  # sub-block 2c + 1: the high ones
    nib = nib.reshape(rows, -1, 8, 32)
    out = np.empty((rows, nib.shape[1], 8, _Q4_1_BYTES), np.uint8)
    with np.errstate(over="ignore"):
        out[..., 0:2] = _f16(scale)
        out[..., 2:4] = _f16(offset)
    out[..., 4:] = nib[..., :16] | (nib[..., 16:] << 4)  # Q4_1: element j low, j + 16 high
    return out.reshape(rows, -1)
