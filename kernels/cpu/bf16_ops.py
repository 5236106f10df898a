"""torch-facing wrapper of the AMX-BF16 GEMM (`hearth_bf16.c`).

A `TiledWeight` holds one linear weight twice: rounded to bfloat16 in the AMX B-tile
layout (`data`), and as the GGUF blocks of the float32 kernels (`blocks`). `linear_tiles`
runs the tiles for calls of at least `min_t` tokens, where the matrix unit wins (prefill,
batched decode), and the float32 block kernel below that, where a step streams the
weights once for a few tokens and the 4-bit blocks are a quarter of the bytes. On a host
or build without AMX-BF16 every call takes the float32 kernel.

Usage::

    w = pack_tiles(dense_fp32_weight, ops.pack("q4_1", raw_rows), min_t=16)
    y = linear_tiles(x, w)
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu import capture, ops

logger = logging.getLogger("hearth.engine")

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p

_SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    "hearth_bf16_packed_bytes": ([_i64, _i64], _i64),
    "hearth_pack_bf16": ([_ptr, _i64, _i64, _ptr], None),
    "hearth_bf16_gemm": ([_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64], ctypes.c_int),
    "hearth_bf16_linear": (
        [ctypes.c_int32, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64],
        ctypes.c_int,
    ),
    "hearth_qtiles_bytes": ([ctypes.c_int32, _i64, _i64], _i64),
    "hearth_pack_qtiles": ([ctypes.c_int32, _ptr, _i64, _i64, _ptr], None),
    "hearth_bf16_isa": ([], ctypes.c_int),
    "hearth_bf16_status": ([], ctypes.c_int),
    "hearth_attention_bf16_path": ([_i64], ctypes.c_int),
}

AMX_MIN_T = 16
"""Where AMX tiles run, calls of at least this many tokens use the tiles: one A tile is 16
tokens, so fewer pay for 16 while reading 3.2x the weight bytes of the 4-bit blocks (fewer
tokens on AMX not measured)."""
VDPBF16_MIN_T = 6
"""Where AVX512-BF16 runs the tiles (no AMX), calls of at least this many tokens use them: the
float32 block kernel's conversions cost more than the extra weight bytes from about 6 tokens.
Zen 4, `python -m tools.bench_step --batch 4 6 8 12 --prompt-len 128 --decode-steps 96`, two
alternating rounds, decode step ms at 16 against 6 (4 at batch 4): batch 4 11.7 / 11.2 against
11.8 / 13.5, batch 6 19.2 / 16.9 against 16.5 / 15.0, batch 8 20.0 / 20.9 against 16.4 / 15.8,
batch 12 30.7 / 31.2 against 18.2 / 20.0 (under 16 the step had been slower than at 16). The
server (`hearth bench --spawn-server --sweeps concurrency --concurrency 4 8 12`, two rounds):
c=8 264 / 280 -> 347 / 324 tok/s, c=12 278 / 271 -> 431 / 405, c=4 228 / 224 -> 208 / 218."""


def default_min_t(variant: str | None = None) -> int:
    """The fewest tokens a call needs to take the tiles in `variant`'s build on this host."""
    return AMX_MIN_T if tile_path(variant) == "amx-bf16" else VDPBF16_MIN_T


QTILES_MIN_T = 32
"""Calls of at least this many tokens build their bfloat16 B tiles on the fly from the 4- or
8-bit blocks (Q-tiles, `hearth_pack_qtiles`) instead of reading the stored bfloat16 tiles: a
step of 32-256 tokens waits on the weights' bytes, which the blocks cut 3.2x (Q4_1) or 1.9x
(Q8_0), and the building overlaps the tile products. Below 32 the building is not amortized
(16 tokens: 0.8-1.0x of the stored tiles). Same bits either way (tests/kernels/test_kernels_bf16.py).
Measured per shape, AMX host, 2026-12-02 (`tools/bench_q8_gemm.py`, weights from memory):
gate_up 576->3072 at 64 tokens 263 -> 141 us, the LM head 576->49152 at 64 tokens 3.82 -> 2.43 ms."""
ATTENTION_MIN_RUN = 16
"""Under gguf-bf16, runs of at least this many consecutive positions of one sequence (prefill
chunks) take the bfloat16 attention kernel (`ops.paged_attention`'s ``min_run``): one
query tile is 16 tokens. Shorter runs (decodes) keep the float32 kernel."""


@functools.cache
def library(variant: str | None = None) -> ctypes.CDLL:
    """The library of `variant` (default: this host's) with the bf16 entry points typed."""
    lib = ops.library(variant)
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    return lib


def tile_path(variant: str | None = None) -> str:
    """What computes the bfloat16 products in `variant`: ``amx-bf16`` (tiles),
    ``avx512-bf16`` (VDPBF16PS; also where the kernel refuses AMX, with the errno), or
    ``none (...)``: the float32 kernels run."""
    lib = library(variant)
    isa = lib.hearth_bf16_isa()
    if isa == 0:
        return "none (no AVX512-BF16 / AMX-BF16 in this kernel build)"
    if isa == 1:
        return "avx512-bf16"
    status = lib.hearth_bf16_status()
    return "amx-bf16" if status == 1 else f"avx512-bf16 (amx refused: errno {-status})"


def attention_path(head_dim: int, variant: str | None = None) -> str:
    """What computes the prefill attention products (``min_run`` runs, see
    `ATTENTION_MIN_RUN`) in `variant` for `head_dim`: ``amx-bf16``, ``avx512-bf16`` (also
    where AMX is refused, or head_dim > 64, which the tiles' registers do not hold) or
    ``none`` (the float32 kernel runs)."""
    path = library(variant).hearth_attention_bf16_path(head_dim)
    return {2: "amx-bf16", 1: "avx512-bf16"}.get(path, "none")


def available(variant: str | None = None) -> bool:
    """Whether `linear_tiles` runs a bfloat16 kernel (not the float32 fallback) here."""
    return library(variant).hearth_bf16_isa() > 0


def qtiles_path(variant: str | None = None) -> bool:
    """Whether `variant`'s build builds tiles from the blocks here (AMX tiles granted)."""
    return tile_path(variant) == "amx-bf16"


@dataclass(frozen=True, slots=True)
class TiledWeight:
    """An [n, k] weight as bfloat16 AMX tiles (and, where AMX runs, its Q-tiles after them)
    plus its float32-kernel blocks."""

    n: int
    k: int
    data: torch.Tensor
    """int16 storage of the bfloat16 tiles (hearth_bf16.c's layout), followed by the Q-tiles
    when `q_min_t` > 0."""
    blocks: ops.PackedWeight
    """The same weight for the float32 kernels (calls below `min_t`)."""
    min_t: int
    bias: torch.Tensor | None = None
    q_min_t: int = 0
    """Calls of at least this many tokens read the Q-tiles (0: `data` holds none)."""

    @property
    def nbytes(self) -> int:
        return self.data.numel() * 2 + self.blocks.nbytes

    @property
    def kind(self) -> str:
        return self.blocks.kind


def pack_tiles(
    dense: torch.Tensor,
    blocks: ops.PackedWeight,
    min_t: int | None = None,
    raw: np.ndarray | None = None,
    q_min_t: int = QTILES_MIN_T,
) -> TiledWeight:
    """`dense` (``[n, k]`` float32, the dequantized weight `blocks` holds) as tiles, taken by
    calls of `min_t` tokens and more (None: `default_min_t()`); with `raw` (the GGUF rows
    `blocks` was packed from) and AMX here, its Q-tiles too, read from `q_min_t` tokens up
    (0: none)."""
    if min_t is None:
        min_t = default_min_t()
    if dense.dtype != torch.float32 or dense.dim() != 2:
        raise ValueError(f"dense must be a 2-D float32 weight, got {dense.dtype} {dense.dim()}-D")
    n, k = dense.shape
    if (n, k) != (blocks.n, blocks.k):
        raise ValueError(f"dense [{n}, {k}] does not match blocks [{blocks.n}, {blocks.k}]")
    lib = library()
    tile_bytes = lib.hearth_bf16_packed_bytes(n, k)
    kind = ops.KIND_CODES[blocks.kind]
    with_q = (
        raw is not None
        and blocks.kind not in ops.WIDE_KINDS
        and q_min_t > 0
        and k % 32 == 0
        and qtiles_path()
    )
    q_bytes = lib.hearth_qtiles_bytes(kind, n, k) if with_q else 0
    data = torch.empty((tile_bytes + q_bytes + 1) // 2, dtype=torch.int16)
    lib.hearth_pack_bf16(dense.contiguous().data_ptr(), n, k, data.data_ptr())
    if with_q:
        rows = np.ascontiguousarray(raw, dtype=np.uint8)
        lib.hearth_pack_qtiles(kind, rows.ctypes.data, n, k, data.data_ptr() + tile_bytes)
    return TiledWeight(
        n, k, data, blocks, max(int(min_t), 1), blocks.bias, int(q_min_t) if with_q else 0
    )


def linear_tiles(
    x: torch.Tensor, weight: TiledWeight, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T (+ bias)``: ``[T, k]`` float32 (rows may be strided) -> ``[T, n]``."""
    t = ops.check_rows(x, weight.k)
    rec = capture.active()
    if rec is not None:
        rec.rows(t)
        out = rec.new(weight.n) if out is None else out
        rec.emit(
            capture.OP_LINEAR_BF16, [x, weight.data, out, weight.bias],
            (weight.k, weight.n, weight.min_t, weight.q_min_t), kind=ops.KIND_CODES[weight.blocks.kind],
            aux=weight.blocks.data,
        )  # fmt: skip
        return out
    if out is None:
        out = torch.empty((t, weight.n), dtype=torch.float32)
    if t >= weight.min_t and library().hearth_bf16_linear(
        ops.KIND_CODES[weight.blocks.kind], *ops.gemm_args(x, weight, out), weight.q_min_t
    ):
        return out
    return ops.linear(x, weight.blocks, out)
