"""torch-facing wrappers of the quantized-activation GEMMs (`hearth_q8.c`).

``x`` is quantized per token and 32-column block to int8 inside the call (llama.cpp's
Q8_1 scheme, see the C file's header for the exact arithmetic), then multiplied with the
weight's own GGUF Q4_1 / Q8_0 blocks by integer dot products: AVX2 ``maddubs``, AVX512
VNNI ``dpbusd`` or AMX ``tdpbsud``/``tdpbssd`` tiles, by the library variant. Every
variant, token count and thread count gives bitwise the same result.

Usage::

    w = pack_q8act("q4_1", raw_gguf_rows, bias)
    y = linear_q8act(x, w)                 # this host's variant
    y2 = linear_q8act(x, w, variant="avx2")  # any variant the host supports
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

import numpy as np
import torch

from kernels.cpu import capture, ops
from kernels.cpu.build import host_isa

logger = logging.getLogger("hearth.engine")

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p

_SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    "hearth_q8a_packed_bytes": ([_i32, _i64, _i64], _i64),
    "hearth_q8a_pack": ([_i32, _ptr, _i64, _i64, _ptr], None),
    "hearth_q8a_scratch_bytes": ([_i64, _i64], _i64),
    "hearth_quantize_q8": ([_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr], None),
    "hearth_q8a_gemm": (
        [_i32, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64],
        None,
    ),
    "hearth_q8a_isa": ([], ctypes.c_int),
    "hearth_q8a_amx_status": ([], ctypes.c_int),
}

KINDS = {"q4_1": 0, "q8_0": 1}
"""Block kinds and their codes in the C API."""
_RAW_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
QBLOCK = 32
"""Columns per quant block: K must be a multiple of it."""
ROW_MULTIPLE = 8
"""N must be a multiple of it (groups are 16 rows; an N % 16 == 8 tail is zero-padded)."""

AMX_AUTO = 0
"""``amx_min_t`` value that means: the library's built-in threshold."""
AMX_NEVER = 1 << 62
"""``amx_min_t`` value that keeps every call on the vector (VNNI / AVX2) kernels."""


@functools.cache
def library(variant: str | None = None) -> ctypes.CDLL:
    """The library of `variant` (default: this host's) with the q8 entry points typed."""
    lib = ops.library(variant)
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    if lib.hearth_q8a_isa() == 2 and (status := lib.hearth_q8a_amx_status()) != 1:
        logger.warning(
            "AMX tiles refused by the kernel (arch_prctl errno %d): the q8 GEMMs run on AVX512-VNNI",
            -status,
        )
    return lib


def supported_variants() -> tuple[str, ...]:
    """Every variant this host can run, lowest first."""
    return host_isa().supported


def integer_path(variant: str | None = None) -> str:
    """What computes the dot products in `variant`: ``avx2-maddubs`` | ``avx512-vnni`` |
    ``amx`` (AMX usable) | ``avx512-vnni (amx refused: errno N)``."""
    lib = library(variant)
    isa = lib.hearth_q8a_isa()
    if isa == 0:
        return "avx2-maddubs"
    if isa == 1:
        return "avx512-vnni"
    status = lib.hearth_q8a_amx_status()
    return "amx" if status == 1 else f"avx512-vnni (amx refused: errno {-status})"


class Q8ActWeight(ops.PackedWeight):
    """An [n, k] weight in the q8-activation kernels' packed layout (see hearth_q8.c).

    The layout is the same for every variant, so one packed weight serves them all.
    """

    __slots__ = ()


def pack_q8act(kind: str, raw_rows: np.ndarray, bias: torch.Tensor | None = None) -> Q8ActWeight:
    """Pack GGUF rows (``[n, k/32 * block_bytes]`` uint8, row-major) for `linear_q8act`."""
    if kind not in KINDS:
        raise ValueError(f"unsupported packed weight kind {kind!r}")
    raw = np.ascontiguousarray(raw_rows, dtype=np.uint8)
    n = raw.shape[0]
    k = raw.shape[1] // _RAW_BLOCK_BYTES[kind] * QBLOCK
    if raw.shape[1] % _RAW_BLOCK_BYTES[kind] or n % ROW_MULTIPLE or n == 0 or k == 0:
        raise ValueError(
            f"{kind} weight [{n}, {k}] needs rows % {ROW_MULTIPLE} == 0 and whole blocks"
        )
    lib = library()
    out = torch.empty(lib.hearth_q8a_packed_bytes(KINDS[kind], n, k), dtype=torch.uint8)
    lib.hearth_q8a_pack(KINDS[kind], raw.ctypes.data, n, k, out.data_ptr())
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
        if bias.shape != (n,):
            raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    return Q8ActWeight(kind, n, k, out, bias)


def scratch_bytes(t: int, k: int) -> int:
    """``hearth_q8a_scratch_bytes(t, k)`` without a trip through ctypes."""
    tp = (t + 15) & ~15
    return ((tp * k + 63) & ~63) + 8 * tp * (k // QBLOCK) + 64


@functools.cache
def _gemm(variant: str | None) -> ctypes._CFuncPtr:
    return library(variant).hearth_q8a_gemm


class _Scratch(threading.local):
    """Per-thread scratch for the quantized activations, grown on demand and reused."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buf.numel() < nbytes + 64:
            self.buf = torch.empty(max(nbytes, 2 * self.buf.numel()) + 64, dtype=torch.uint8)
        return self.buf


_SCRATCH = _Scratch()


def _aligned(buf: torch.Tensor) -> int:
    return (buf.data_ptr() + 63) & ~63


def linear_q8act(
    x: torch.Tensor,
    weight: Q8ActWeight,
    out: torch.Tensor | None = None,
    variant: str | None = None,
    amx_min_t: int = AMX_AUTO,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` with `x` quantized to int8 per token and 32-column block.

    `x`: ``[T, k]`` float32 (rows may be strided, columns contiguous); returns ``[T, n]``
    float32 (or fills `out`, whose rows may be strided too). `variant` picks the library
    (default: this host's). `amx_min_t`: calls of at least that many tokens use AMX tiles
    where the variant and host have them (`AMX_AUTO`: the built-in threshold,
    `AMX_NEVER`: never); the result is the same bits either way.
    """
    t = ops.check_rows(x, weight.k)
    rec = capture.active()
    if rec is not None and variant is None and amx_min_t == AMX_AUTO:
        rec.rows(t)
        out = rec.new(weight.n) if out is None else out
        rec.emit(
            capture.OP_LINEAR_Q8A, [x, weight.data, out, weight.bias], (weight.k, weight.n),
            kind=KINDS[weight.kind],
        )  # fmt: skip
        return out
    if out is None:
        out = torch.empty((t, weight.n), dtype=torch.float32)
    elif out.dtype != torch.float32 or out.shape != (t, weight.n) or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [{t}, {weight.n}] with unit column stride")
    if t == 0:
        return out
    gemm = _gemm(variant)
    scratch = _SCRATCH.get(scratch_bytes(t, weight.k))
    gemm(KINDS[weight.kind], *ops.gemm_args(x, weight, out), _aligned(scratch), amx_min_t)
    return out


def quantize_q8(
    x: torch.Tensor, variant: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The activation quantizer alone: ``(q [T, k] int8, d [T, k/32], s [T, k/32])``."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] % QBLOCK:
        raise ValueError("x must be float32 [T, k] (k % 32 == 0) with unit column stride")
    t, k = x.shape
    q = torch.empty((t, k), dtype=torch.int8)
    d = torch.empty((t, k // QBLOCK), dtype=torch.float32)
    s = torch.empty((t, k // QBLOCK), dtype=torch.float32)
    library(variant).hearth_quantize_q8(
        x.data_ptr(), t, x.stride(0), k, q.data_ptr(), d.data_ptr(), s.data_ptr()
    )
    return q, d, s
