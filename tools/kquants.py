"""K-quant blocks (Q4_K, Q5_K, Q6_K) written as llama.cpp lays them out, and its Q4_K_M
recipe, for GGUF files made here (`tests/engine/gguf_writer.py`, `tools/requantize_gguf.py`).

gguf-py dequantizes every K-quant but quantizes none, and llama.cpp's `llama-quantize` is
not here, so a Q4_K_M file is made with these: plain min / max scales (llama.cpp searches
for better ones; the layout, not the rounding, is what a reader of the file depends on).
`tests/engine/test_gguf_relayout.py` checks them against gguf-py's dequantizers.
"""

from __future__ import annotations

import re

import numpy as np

__all__ = ["quantize", "quantize_q4_k", "quantize_q5_k", "quantize_q6_k", "tensor_type"]

_SUPER = 256


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(values.shape[0], 2)


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.divide(
        num, den, out=np.zeros(np.broadcast(num, den).shape, np.float32), where=den > 0
    )


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block → the 12 bytes ggml's `get_scale_min_k4` reads."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return out


def _affine(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Sub-blocks of 32 as `d·sc·q - dmin·m`, q in [0, levels]: (d, dmin, sc, m, q)."""
    xb = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(xb.min(-1), 0.0)
    scale = (xb.max(-1) - lo) / levels
    mins = -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(_safe_div(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_safe_div(mins, dmin.astype(np.float32)[:, None])), 0, 63).astype(
        np.uint8
    )
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.round(_safe_div(xb + offset[..., None], step[..., None])), 0, levels).astype(
        np.uint8
    )
    return d, dmin, sc, mn, q


def _rows(blocks: np.ndarray, x: np.ndarray) -> np.ndarray:
    return blocks.reshape(x.shape[0], -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """`[rows, k]` float32 (k a multiple of 256) → Q4_K rows (144 bytes per 256 columns)."""
    d, dmin, sc, mn, q = _affine(x, 15)
    pairs = q.reshape(-1, 4, 2, 32)  # chunk c holds sub-blocks 2c (low nibbles), 2c + 1 (high)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, mn), qs], axis=1)
    return _rows(blocks, x)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """`[rows, k]` float32 → Q5_K rows (176 bytes per 256 columns): Q4_K's low nibbles plus
    bit j of `qh[l]` = bit 4 of sub-block j's element l."""
    d, dmin, sc, mn, q = _affine(x, 31)
    pairs = (q & 0xF).reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).astype(np.uint8)  # [blocks, 8, 32]
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, mn), qh, qs], axis=1)
    return _rows(blocks, x)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """`[rows, k]` float32 → Q6_K rows (210 bytes per 256 columns: ql[128], qh[64], 16 int8
    scales of 16-column sub-blocks, d): `d·sc·(q - 32)`."""
    xb = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(xb).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.round(_safe_div(scale, d.astype(np.float32)[:, None])), 0, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.round(_safe_div(xb, step[..., None])), -32, 31) + 32).astype(np.uint8)
    v = q.reshape(-1, 2, 4, 32)  # half n, quarter k: element 128n + 32k + l
    ql = np.concatenate(
        [
            (v[:, :, 0] & 0xF) | ((v[:, :, 2] & 0xF) << 4),
            (v[:, :, 1] & 0xF) | ((v[:, :, 3] & 0xF) << 4),
        ],
        axis=2,
    ).reshape(-1, 128)
    qh = (
        (v[:, :, 0] >> 4)
        | ((v[:, :, 1] >> 4) << 2)
        | ((v[:, :, 2] >> 4) << 4)
        | ((v[:, :, 3] >> 4) << 6)
    )
    blocks = np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)
    return _rows(blocks, x)


_K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
"""llama.cpp's type for a tensor whose rows are not whole 256-column super-blocks."""


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down a `_M` mix keeps in Q6_K."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(qtype: str, name: str, shape: tuple[int, ...], n_layers: int) -> str | None:
    """The GGML type llama.cpp writes tensor `name` of `shape` in for file type `qtype` (a
    GGML type name, or "Q4_K_M": Q6_K for the head and some attn_v / ffn_down, Q4_K for
    the rest); None: F32 (1-D tensors, rows that are not whole 32-column blocks)."""
    if len(shape) < 2 or shape[-1] % 32:
        return None
    kind = qtype
    if qtype == "Q4_K_M":
        m = re.fullmatch(r"blk\.(\d+)\.(attn_v|ffn_down)\.weight", name)
        more = m is not None and _use_more_bits(int(m.group(1)), n_layers)
        kind = "Q6_K" if name == "output.weight" or more else "Q4_K"
    if kind in _K_FALLBACK and shape[-1] % 256:
        kind = _K_FALLBACK[kind]
    return kind


def quantize(data: np.ndarray, kind: str) -> np.ndarray:
    """`data` (float32, rows last) as GGML type `kind`'s raw rows: the K-quants here, any
    other type by gguf-py's own quantizer."""
    import gguf

    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        flat = data.reshape(-1, data.shape[-1])
        return globals()[f"quantize_{kind.lower()}"](flat).reshape(*data.shape[:-1], -1)
    return np.asarray(gguf.quants.quantize(data, gguf.GGMLQuantizationType[kind]))
