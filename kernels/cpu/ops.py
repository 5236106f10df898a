"""torch-facing wrappers of the C kernels (`hearth_cpu.c`): the CPU fast path.

Each wrapper checks what the C code cannot (dtype, contiguity, shapes) and passes raw
pointers through ctypes. torch is imported before the library is loaded, so the
library's `libgomp.so.1` is torch's own and both share one OpenMP thread pool.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu import capture
from kernels.cpu.build import build, host_isa
from kernels.reference import kv_head_elems

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p

_SIGNATURES: dict[str, list[type]] = {
    "hearth_q4_1_packed_bytes": [_i64, _i64],
    "hearth_q8_0_packed_bytes": [_i64, _i64],
    "hearth_pack_q4_1": [_ptr, _i64, _i64, _ptr],
    "hearth_pack_q8_0": [_ptr, _i64, _i64, _ptr],
    "hearth_w16_packed_bytes": [_i64, _i64],
    "hearth_pack_w16": [_ptr, _i64, _i64, _ptr],
    "hearth_relay_q4_1": [_i64, _ptr, _i64, _ptr],
    "hearth_q4_1_overflows": [_i64, _ptr, _i64],
    "hearth_pack_q4_1_from": [_i64, _ptr, _i64, _i64, _ptr],
    "hearth_pack_q8_0_from": [_i64, _ptr, _i64, _i64, _ptr],
    "hearth_requant_k_q8_0": [_i64, _ptr, _i64, _ptr],
    "hearth_quantize_q8_0": [_ptr, _i64, _ptr],
    "hearth_dequantize_gguf": [_i64, _ptr, _i64, _ptr],
    "hearth_q4_1_gemm": [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64],
    "hearth_q8_0_gemm": [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64],
    "hearth_f16_gemm": [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64],
    "hearth_bf16w_gemm": [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64],
    "hearth_rms_norm": [_ptr, _ptr, _ptr, _i64, _i64, _f32],
    "hearth_top_p": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64],
    "hearth_argmax": [_ptr, _i64, _i64, _ptr],
    "hearth_min_p": [_ptr, _i64, _i64, _ptr, _ptr],
    "hearth_add_rms_norm": [_ptr, _ptr, _ptr, _i64, _i64, _f32],
    "hearth_head_rms_norm": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32],
    "hearth_silu_mul": [_ptr, _ptr, _i64, _i64],
    "hearth_gelu_tanh_mul": [_ptr, _ptr, _i64, _i64],
    "hearth_rope": [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr],
    "hearth_kv_write": [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr],
    "hearth_paged_attention": [
        *[_ptr, _i64, _i64, _i64, _i64, _i64],
        *[_ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _f32, _ptr, _ptr, _i64, _i64, _i64],
    ],
    "hearth_num_threads": [],
    "hearth_embedding": [_ptr, _i64, _ptr, _i64, _i64, _ptr],
    "hearth_run_program": [_ptr, _i64, _ptr],
    "hearth_moe_block": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr],
    "hearth_moe_experts": [
        *[_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64],
        *[_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr],
    ],
    "hearth_attention_scratch_floats": [_i64],
    "hearth_attention_f32_path": [],
    "hearth_lora": [
        *[_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr],
        *[_i64, _i64, _i64, _ptr, _i64, _ptr],
    ],
}

GROUP = 8
"""Output rows per packed group: N must be a multiple of it."""
QBLOCK = 32
"""Weights per GGUF quant block: K must be a multiple of it."""


class NativeKernelsUnavailable(RuntimeError):
    """The host has no AVX2, or the library could not be built."""


def library(variant: str | None = None) -> ctypes.CDLL:
    """The C library of `variant` (default: this host's, see `host_isa`, chosen once per
    process), built on first use if not cached. A variant the host cannot run raises
    NativeKernelsUnavailable."""
    return _default_library() if variant is None else _library(variant)


@functools.cache
def _default_library() -> ctypes.CDLL:
    return _library(None)


def _library(variant: str | None) -> ctypes.CDLL:
    try:
        isa = host_isa(variant)
    except ValueError as exc:
        raise NativeKernelsUnavailable(str(exc)) from exc
    if isa.variant is None:
        raise NativeKernelsUnavailable(f"no fast CPU kernels for this host: {isa.describe()}")
    return _load(isa.variant)


@functools.cache
def _load(variant: str) -> ctypes.CDLL:
    try:
        path = build(variant)
    except (RuntimeError, OSError) as exc:
        raise NativeKernelsUnavailable(str(exc)) from exc
    lib = ctypes.CDLL(str(path))
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = (
            _i64
            if name.endswith(("_bytes", "_floats", "_overflows"))
            or name in ("hearth_relay_q4_1", "hearth_pack_q4_1_from")
            else ctypes.c_int
            if "threads" in name or name.endswith("_path")
            else None
        )
    return lib


def available() -> bool:
    try:
        library()
    except NativeKernelsUnavailable:
        return False
    return True


def _p(t: torch.Tensor | np.ndarray | None) -> int | None:
    if t is None:
        return None
    if isinstance(t, np.ndarray):
        return t.ctypes.data
    return t.data_ptr()


def _check(t: torch.Tensor, name: str, dtype: torch.dtype = torch.float32) -> None:
    if t.dtype != dtype or t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")


# ----------------------------------------------------------------------------- weights


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """An [n, k] linear weight in the kernels' packed layout (see hearth_cpu.c): GGUF blocks,
    or 16-bit weights."""

    kind: str
    """``q4_1`` | ``q8_0`` | ``f16`` | ``bf16``"""
    n: int
    k: int
    data: torch.Tensor
    """uint8, packed."""
    bias: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.data.numel()


_RAW_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34, "f16": 64, "bf16": 64}
"""Bytes of 32 columns of one row as stored: GGUF blocks, or 32 16-bit weights."""
WIDE_KINDS = ("f16", "bf16")
"""Kinds of 16-bit weights (IEEE half, bfloat16), one packed layout for both."""


PACKED_FROM = {
    "q4_1": ("q4_1", "q4_0", "q4_k"),
    "q8_0": ("q8_0", "q4_k", "q5_k", "q6_k"),
    "f16": ("f16",),
    "bf16": ("bf16",),
}
"""Stored formats `pack_parts` packs as each kernel kind, re-laying them block by block as
it goes (`hearth_pack_q4_1_from`, `hearth_pack_q8_0_from`): Q4_0 and Q4_K as Q4_1, the
K-quants requantized to Q8_0, each bitwise what `engine/layers/gguf_relayout.py` re-lays."""
_FROM_CODES = {"q4_0": 0, "q4_1": 1, "q4_k": 4, "q5_k": 5, "q6_k": 6, "q8_0": 8}


def pack(kind: str, raw_rows: np.ndarray, bias: torch.Tensor | None = None) -> PackedWeight:
    """Pack rows as stored (``[n, k/32 * block_bytes]`` uint8, row-major: GGUF blocks, or
    little-endian 16-bit weights) for the GEMM kernel."""
    return pack_parts(kind, [(kind, raw_rows)], bias)


def pack_parts(
    kind: str, parts: list[tuple[str, np.ndarray]], bias: torch.Tensor | None = None
) -> PackedWeight:
    """One weight from its parts' rows as stored (each ``(format, uint8 rows)``, in row
    order, the format one of ``PACKED_FROM[kind]``: a fused layer's q, k and v as the file
    has them), packed for `kind`'s kernel. Each part is re-laid block by block into its own
    groups of the packed weight, so no re-laid or joined copy of the rows is ever made (a
    7.4 B Q4_K_M model's start wrote every weight twice before packing it). Every part must
    be whole groups of rows; raises ValueError on a Q4_1 scale past float16's range (the
    caller checks `q4_1_overflows` first)."""
    if kind not in _RAW_BLOCK_BYTES or not parts:
        raise ValueError(f"unsupported packed weight kind {kind!r}, or no rows")
    shaped = []
    for stored, rows in parts:
        if stored not in PACKED_FROM[kind]:
            raise ValueError(f"{stored} rows are not packed as {kind}")
        raw = np.ascontiguousarray(rows, dtype=np.uint8)
        if raw.ndim != 2:
            raise ValueError(f"{stored} rows must be [rows, bytes], got {raw.shape}")
        size, values = _block_shape(stored)
        n, k = raw.shape[0], raw.shape[1] // size * values
        if raw.shape[1] % size or n % GROUP or k % QBLOCK:
            raise ValueError(f"{kind} weight [{n}, {k}] needs rows % {GROUP} == 0 and whole blocks")
        shaped.append((stored, raw, n, k))
    if len({k for *_, k in shaped}) != 1:
        raise ValueError(
            f"the parts of one weight have different widths: {[k for *_, k in shaped]}"
        )
    lib = library()
    layout = "w16" if kind in WIDE_KINDS else kind
    packed_bytes = getattr(lib, f"hearth_{layout}_packed_bytes")
    k = shaped[0][3]
    out = torch.empty(sum(packed_bytes(n, k) for *_, n, _ in shaped), dtype=torch.uint8)
    at = out.data_ptr()
    for stored, raw, n, _ in shaped:
        if stored == kind:
            getattr(lib, f"hearth_pack_{layout}")(_p(raw), n, k, at)
        elif kind == "q4_1":
            if lib.hearth_pack_q4_1_from(_FROM_CODES[stored], _p(raw), n, k, at):
                raise ValueError(f"{stored} scales past float16's range cannot be packed as q4_1")
        else:
            lib.hearth_pack_q8_0_from(_FROM_CODES[stored], _p(raw), n, k, at)
        at += packed_bytes(n, k)
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
    return PackedWeight(kind, sum(n for *_, n, _ in shaped), k, out, bias)


def _block_shape(stored: str) -> tuple[int, int]:
    """Bytes and values of one block of a stored format (32 values of a 16-bit weight)."""
    if stored in WIDE_KINDS:
        return _RAW_BLOCK_BYTES[stored], QBLOCK
    return _DEQUANTIZED[stored][1], _DEQUANTIZED[stored][2]


def q4_1_overflows(stored: str, raw: np.ndarray) -> bool:
    """Whether Q4_0 or Q4_K rows re-laid as Q4_1 would have a scale past float16's range
    (such a tensor is requantized to Q8_0 instead), without re-laying them."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    code, size, _ = _DEQUANTIZED[stored]
    return bool(library().hearth_q4_1_overflows(code, _p(raw), raw.size // size))


_DEQUANTIZED = {
    "q4_0": (0, 18, 32),
    "q4_1": (1, 20, 32),
    "q5_0": (2, 22, 32),
    "q5_1": (3, 24, 32),
    "q8_0": (8, 34, 32),
    "q4_k": (4, 144, 256),
    "q5_k": (5, 176, 256),
    "q6_k": (6, 210, 256),
}
"""GGUF formats the C library reads (`dequantize`; Q4_0 and Q4_K also `relay_as_q4_1`, the
K-quants `requantize_k`): its kind code, bytes and values per block."""


def relay_as_q4_1(stored: str, raw: np.ndarray) -> np.ndarray | None:
    """Q4_0 or Q4_K rows (uint8 ``[rows, blocks * bytes]``) as the Q4_1 rows of the same
    nibbles (``[rows, k / 32 * 20]``): Q4_0's d with offset ``-8·d``, Q4_K's scale ``d·sc``
    and offset ``-dmin·m``, each rounded to float16; None when one of those is past
    float16's range (or NaN, for Q4_0)."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    code, size, values = _DEQUANTIZED[stored]
    out = np.empty((raw.shape[0], raw.shape[1] // size * values // QBLOCK * 20), np.uint8)
    overflowed = library().hearth_relay_q4_1(code, _p(raw), raw.size // size, _p(out))
    return None if overflowed else out


def requantize_k(kind: str, raw: np.ndarray) -> np.ndarray:
    """Q4_K, Q5_K or Q6_K rows as Q8_0 rows: bit for bit gguf-py's dequantization then
    Q8_0 quantization, without the float32 tensor in between."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    code, size, _ = _DEQUANTIZED[kind]
    out = np.empty((raw.shape[0], raw.shape[1] // size * 8 * _RAW_BLOCK_BYTES["q8_0"]), np.uint8)
    library().hearth_requant_k_q8_0(code, _p(raw), raw.size // size, _p(out))
    return out


def dequantizes(kind: str) -> bool:
    """Whether `dequantize` reads GGUF format `kind` (gguf-py's lower-case name) on this
    host."""
    return kind in _DEQUANTIZED and available()


def dequantize(kind: str, raw: np.ndarray) -> np.ndarray:
    """GGUF rows of format `kind` (uint8 ``[rows, blocks * bytes]``) as float32
    ``[rows, blocks * values]``, bit for bit gguf-py's `dequantize`, on the OpenMP threads."""
    code, size, values = _DEQUANTIZED[kind]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"{kind} rows must be [rows, n * {size}] bytes, got {raw.shape}")
    out = np.empty((raw.shape[0], raw.shape[1] // size * values), np.float32)
    library().hearth_dequantize_gguf(code, _p(raw), raw.size // size, _p(out))
    return out


def quantize_q8_0(values: np.ndarray) -> np.ndarray:
    """float32 ``[rows, k]`` as Q8_0 rows, bit for bit gguf-py's (ggml's reference) quantizer."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    out = np.empty(
        (values.shape[0], values.shape[1] // QBLOCK * _RAW_BLOCK_BYTES["q8_0"]), np.uint8
    )
    library().hearth_quantize_q8_0(_p(values), values.size // QBLOCK, _p(out))
    return out


KIND_CODES = {"q4_1": 0, "q8_0": 1, "f16": 2, "bf16": 3}
"""Packed kinds and their codes in the C API (the step program's `linear_f32`)."""
_GEMMS = {
    "q4_1": "hearth_q4_1_gemm",
    "q8_0": "hearth_q8_0_gemm",
    "f16": "hearth_f16_gemm",
    "bf16": "hearth_bf16w_gemm",
}


def check_rows(x: torch.Tensor, k: int) -> int:
    """A linear kernel's input: CPU float32 ``[T, k]``, unit column stride (rows may be
    strided, e.g. a column range of a fused output). Returns T."""
    _check(x, "x")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be [T, {k}] with unit column stride, got {tuple(x.shape)}")
    return x.shape[0]


def linear(
    x: torch.Tensor,
    weight: PackedWeight,
    out: torch.Tensor | None = None,
    variant: str | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)``: ``[T, k]`` float32 (rows may be strided) -> ``[T, n]``.

    ``variant``: the kernel build to run (default: this host's), so the kernels of a lower
    build (their own single-token tiles) are testable on a higher host."""
    t = check_rows(x, weight.k)
    rec = capture.active()
    if rec is not None:
        rec.rows(t)
        out = rec.new(weight.n) if out is None else out
        rec.emit(
            capture.OP_LINEAR_F32, [x, weight.data, out, weight.bias], (weight.k, weight.n),
            kind=KIND_CODES[weight.kind],
        )  # fmt: skip
        return out
    if out is None:
        out = torch.empty((t, weight.n), dtype=torch.float32)
    getattr(library(variant), _GEMMS[weight.kind])(*gemm_args(x, weight, out))
    return out


def gemm_args(x: torch.Tensor, weight, out: torch.Tensor) -> tuple:
    """The arguments every GEMM entry point of the C library starts with, for a packed
    weight (any layout with ``k``, ``n``, ``data``, ``bias``): ``x, t, ldx, k, w, n, bias,
    out, ldo``."""
    return (
        _p(x), x.shape[0], x.stride(0), weight.k, _p(weight.data), weight.n, _p(weight.bias),
        _p(out), out.stride(0),
    )  # fmt: skip


@dataclass(frozen=True)
class PackedExperts:
    """A MoE layer's experts as `moe_experts` reads them: per expert, the kind code, address
    and bias address of its packed gate/up (``[2 * inter, h]``) and down (``[h, inter]``)
    weights. Holds the `PackedWeight`s, so the addresses stay valid."""

    h: int
    inter: int
    kind13: torch.Tensor
    w13: torch.Tensor
    b13: torch.Tensor
    kind2: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    weights: tuple[PackedWeight, ...]
    table: torch.Tensor | None = None
    """int64: experts, h, inter and the addresses of the six tables above, as
    `hearth_moe_block` (and the step program's MoE op) reads them."""

    def __post_init__(self) -> None:
        tables = (self.kind13, self.w13, self.b13, self.kind2, self.w2, self.b2)
        header = [self.kind13.numel(), self.h, self.inter]
        table = torch.tensor(header + [_p(t) for t in tables], dtype=torch.int64)
        object.__setattr__(self, "table", table)

    @classmethod
    def of(cls, gate_up: list[PackedWeight], down: list[PackedWeight]) -> PackedExperts:
        """Raises ValueError unless every expert has the same shapes in kinds the C call
        runs."""
        h, inter = gate_up[0].k, gate_up[0].n // 2
        if len(gate_up) != len(down) or any(
            (g.k, g.n, d.k, d.n) != (h, 2 * inter, inter, h) or g.kind not in KIND_CODES
            or d.kind not in KIND_CODES
            for g, d in zip(gate_up, down, strict=True)
        ):  # fmt: skip
            raise ValueError("experts of other shapes or kinds than one packed MoE layer has")

        def table(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype)

        return cls(
            h, inter,
            table([KIND_CODES[g.kind] for g in gate_up], torch.int32),
            table([g.data.data_ptr() for g in gate_up], torch.int64),
            table([_p(g.bias) or 0 for g in gate_up], torch.int64),
            table([KIND_CODES[d.kind] for d in down], torch.int32),
            table([d.data.data_ptr() for d in down], torch.int64),
            table([_p(d.bias) or 0 for d in down], torch.int64),
            (*gate_up, *down),
        )  # fmt: skip


def moe_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: PackedExperts
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e) * up_e)(x[t])``, ``e = topk_ids[t,
    j]``, for every token: a MoE layer's SwiGLU experts in one C call (`hearth_moe_experts`).
    x: float32 ``[T, h]``; topk_*: ``[T, k]``. Returns ``[T, h]``."""
    _check(x, "x")
    t, top_k = topk_ids.shape
    if x.dim() != 2 or x.shape != (t, experts.h):
        raise ValueError(f"x must be [{t}, {experts.h}], got {tuple(x.shape)}")
    x = x.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty((t, experts.h), dtype=torch.float32)
    slots = t * top_k
    scratch = torch.empty(slots * (2 * experts.h + 3 * experts.inter), dtype=torch.float32)
    order = torch.empty(slots, dtype=torch.int64)
    library().hearth_moe_experts(
        _p(x), t, experts.h, experts.inter, top_k, _p(ids), _p(weights), experts.kind13.numel(),
        _p(experts.kind13), _p(experts.w13), _p(experts.b13), _p(experts.kind2),
        _p(experts.w2), _p(experts.b2), _p(out), _p(scratch), _p(order),
    )  # fmt: skip
    return out


MOE_MAX_EXPERTS = 1024
"""Experts of a router `moe_block` takes (hearth_cpu.c `MOE_MAX_EXPERTS`)."""


def moe_block(
    x: torch.Tensor, logits: torch.Tensor, experts: PackedExperts, top_k: int, renorm: bool
) -> torch.Tensor:
    """A MoE block from its router's logits ``[T, E]`` (float32, rows may be strided): each
    token's top-k experts by softmax (renormalised over the k when `renorm`), then
    `moe_experts`, in one C call (`hearth_moe_block`); under capture one op of the step
    program (`OP_MOE`). x: ``[T, h]``. Returns ``[T, h]``."""
    t = check_rows(x, experts.h)
    n_experts = experts.kind13.numel()
    _check(logits, "logits")
    shaped = logits.dim() == 2 and logits.shape == (t, n_experts) and logits.stride(1) == 1
    if not shaped or not 0 < top_k <= n_experts <= MOE_MAX_EXPERTS:
        raise ValueError(f"logits must be [{t}, {n_experts}] and 0 < top_k <= {n_experts}")
    floats = top_k * (2 * experts.h + 3 * experts.inter + 1)  # per token
    rec = capture.active()
    if rec is not None:
        rec.rows(t)
        out = rec.new(experts.h)
        rec.emit(
            capture.OP_MOE, [x, logits, out, None], (top_k, int(renorm), floats), aux=experts.table
        )
        return out
    out = torch.empty((t, experts.h), dtype=torch.float32)
    scratch = torch.empty(t * floats, dtype=torch.float32)
    order = torch.empty(2 * t * top_k, dtype=torch.int64)
    library().hearth_moe_block(
        _p(x), x.stride(0), _p(logits), logits.stride(0), t, top_k, int(renorm),
        _p(experts.table), _p(out), experts.h, _p(scratch), _p(order),
    )  # fmt: skip
    return out


def add_lora(y: torch.Tensor, x: torch.Tensor, stack, step) -> torch.Tensor:
    """`kernels.add_lora` by the C kernel (`hearth_lora`): ``y[t] += scale * B(A(x[t]))``
    with the A/B of token t's slot, in place, for a linear of the fast path. `stack` is the
    layer's `kernels.LoRAStack`, `step` the step's `kernels.LoRAStep`. Under capture (the
    LoRA step program) it records the op, reading the step's ``lora_slots`` input."""
    if not step.groups:
        return y
    t = check_rows(x, stack.lora_a.shape[-1])
    _, shards, max_rank, k = stack.lora_a.shape
    out = stack.lora_b.shape[1]
    _check(y, "y")
    if y.shape != (t, out) or y.stride(1) != 1:
        raise ValueError(f"y must be [{t}, {out}] with unit column stride, got {tuple(y.shape)}")
    rec = capture.active()
    if rec is not None:
        rec.rows(t)
        rec.step_input("lora_slots", step.token_slots)
        rec.emit(
            capture.OP_LORA, [x, stack.lora_a, y, stack.lora_b], (k, out, max_rank, shards),
            aux=stack.scales, aux2=stack.row_shard,
        )  # fmt: skip
        return y
    h = torch.empty(t * shards * max_rank, dtype=torch.float32)
    library().hearth_lora(
        _p(x), t, x.stride(0), k, _p(step.token_slots), _p(stack.lora_a), _p(stack.lora_b),
        _p(stack.scales), _p(stack.row_shard), shards, max_rank, out, _p(y), y.stride(0), _p(h),
    )  # fmt: skip
    return y


# ----------------------------------------------------------------------------- elementwise


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, "x")
    x = x.contiguous()
    rec = capture.active()
    if rec is not None:
        rec.rows(x.shape[0])
        out = rec.new(x.shape[1])
        rec.emit(capture.OP_RMS_NORM, [x, weight, out, None], (x.shape[1],), (eps,))
        return out
    out = torch.empty_like(x)
    library().hearth_rms_norm(_p(x), _p(weight), _p(out), x.shape[0], x.shape[1], eps)
    return out


def top_p(probs: torch.Tensor, top_ps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-p set (``hearth_sampling.c``): (`probs` with 0 on every token outside
    it, each row's cut). The set is the plain method's (sort descending, keep a token while
    the ones before it sum to less than top_p, at least one): a token is in it iff its
    probability is >= the cut. `probs` [rows, vocab >= 1] float32, `top_ps` [rows]."""
    _check(probs, "probs")
    probs = probs.contiguous()
    top_ps = top_ps.to(torch.float32).contiguous()
    if probs.dim() != 2 or probs.shape[1] == 0 or top_ps.shape != (probs.shape[0],):
        raise ValueError(f"top_p: probs {tuple(probs.shape)}, top_ps {tuple(top_ps.shape)}")
    rows, vocab = probs.shape
    # Each thread's candidates and their radix-sort copy: allocated here, so running out of
    # memory is torch's error, not a row the kernel would have to leave unmasked.
    threads = max(1, min(library().hearth_num_threads(), rows))
    scratch = torch.empty(threads, 2 * vocab, dtype=torch.int32)
    cuts = torch.empty(rows, dtype=torch.float32)
    out = torch.empty_like(probs)
    library().hearth_top_p(
        _p(probs), rows, vocab, _p(top_ps), _p(cuts), _p(out), _p(scratch), threads
    )
    return out, cuts


def min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """`probs` with 0 on every token below its row's min_p times the row's largest
    probability (``hearth_sampling.c``), to the bit what torch's ``probs.masked_fill(probs
    < probs.max(-1, keepdim=True).values * min_ps[:, None], 0)`` gives, NaN rows included.
    `probs` [rows, vocab >= 1] float32, `min_ps` [rows]."""
    _check(probs, "probs")
    probs = probs.contiguous()
    min_ps = min_ps.to(torch.float32).contiguous()
    if probs.dim() != 2 or probs.shape[1] == 0 or min_ps.shape != (probs.shape[0],):
        raise ValueError(f"min_p: probs {tuple(probs.shape)}, min_ps {tuple(min_ps.shape)}")
    out = torch.empty_like(probs)
    library().hearth_min_p(_p(probs), probs.shape[0], probs.shape[1], _p(min_ps), _p(out))
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (``hearth_sampling.c``): the first on ties, the
    first NaN where a row holds one, as torch's ``max(dim=-1).indices``. `x` [rows, n >= 1]
    float32."""
    _check(x, "x")
    x = x.contiguous()
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax: x {tuple(x.shape)}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    library().hearth_argmax(_p(x), x.shape[0], x.shape[1], _p(out))
    return out


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int) -> torch.Tensor:
    """RMSNorm over each head of ``x`` (``[T, heads * hd]``, rows may be strided: q or k in
    the fused qkv output) with the head-wide `weight`: ``[T, heads * hd]``, each head
    bitwise `rms_norm` of it alone."""
    _check(x, "x")
    t, width = check_rows(x, x.shape[-1]), x.shape[-1]
    hd = width // heads
    if hd * heads != width or weight.shape != (hd,):
        raise ValueError(f"{heads} heads of [{width}] need a weight of [{width // heads}]")
    rec = capture.active()
    if rec is not None:
        rec.rows(t)
        out = rec.new(width)
        rec.emit(capture.OP_HEAD_NORM, [x, weight, out, None], (heads, hd), (eps,))
        return out
    out = torch.empty((t, width), dtype=torch.float32)
    library().hearth_head_rms_norm(_p(x), x.stride(0), _p(weight), _p(out), t, heads, hd, eps)
    return out


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight``."""
    _check(x, "x")
    _check(residual, "residual")
    if not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("add_rms_norm_ needs contiguous x and residual")
    rec = capture.active()
    if rec is not None:
        rec.rows(x.shape[0])
        rec.emit(capture.OP_ADD_RMS_NORM, [x, residual, weight, None], (x.shape[1],), (eps,))
        return
    library().hearth_add_rms_norm(_p(x), _p(residual), _p(weight), x.shape[0], x.shape[1], eps)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _gated(gate_up, capture.OP_SILU_MUL, "hearth_silu_mul", out)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma's ``gelu_pytorch_tanh``): ``gelu_tanh(gate) * up`` of ``[T, 2 * I]``
    (`hearth_gelu_tanh_mul`: the reference's function within float32 rounding)."""
    return _gated(gate_up, capture.OP_GELU_MUL, "hearth_gelu_tanh_mul")


def _gated(
    gate_up: torch.Tensor, code: int, kernel: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A gated activation's C kernel (or, under capture, its op) on ``[T, 2 * I]``."""
    _check(gate_up, "gate_up")
    gate_up = gate_up.contiguous()
    t, two_i = gate_up.shape
    rec = capture.active()
    if rec is not None:
        rec.rows(t)
        out = rec.new(two_i // 2) if out is None else out
        rec.emit(code, [gate_up, None, out, None], (two_i // 2,))
        return out
    if out is None:
        out = torch.empty((t, two_i // 2), dtype=torch.float32)
    getattr(library(), kernel)(_p(gate_up), _p(out), t, two_i // 2)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.reference.fused_add_rms_norm` in place: ``residual += x``, then ``x =
    rms_norm(residual) * weight``; returns ``(x, residual)``."""
    add_rms_norm_(x, residual, weight, eps)
    return x, residual


def _rope_(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    # x: [T, heads, head_dim] with heads packed in each row (a view of the fused qkv works)
    _check(x, "q/k")
    t, heads, hd = x.shape
    if x.stride(2) != 1 or (heads > 1 and x.stride(1) != hd) or cos_sin_cache.shape[-1] != hd:
        raise ValueError("rotary needs [T, heads, head_dim] rows with packed heads, full rotary")
    rec = capture.active()
    if rec is not None:
        rec.rows(t)
        rec.step_input("positions", positions)
        rec.emit(capture.OP_ROPE, [x, cos_sin_cache, None, None], (heads, hd))
        return
    library().hearth_rope(_p(x), t, x.stride(0), heads, hd, _p(positions), _p(cos_sin_cache))


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.reference.rotary_embedding` in place on `query` and `key` (views of the
    fused qkv rows stay views); returns them."""
    if positions.dtype != torch.int64:
        raise ValueError("positions must be int64")
    if cos_sin_cache.shape[-1] != query.shape[-1]:
        # Partial rotary (Phi-4-mini): the C kernel rotates whole heads, so the torch
        # reference runs it; a step program cannot replay a torch op, so none is captured.
        if capture.active() is not None:
            raise capture.CaptureError("partial rotary runs the torch reference")
        from kernels import reference

        return reference.rotary_embedding(positions, query, key, cos_sin_cache)
    _rope_(query, positions, cos_sin_cache)
    _rope_(key, positions, cos_sin_cache)
    return query, key


_KV_KINDS = {
    (torch.float32, torch.float32): 0,
    (torch.float16, torch.float16): 1,
    (torch.int8, torch.int8): 2,
    (torch.float16, torch.int8): 3,
}
"""Element types of the paged KV caches (keys, values) the C kernels read (their KV_F32 /
KV_F16 / KV_I8 / KV_F16_I8): float32; float16 (half the bytes per step); int8 rows, each
(slot, kv head) row of ``head_dim`` values followed by its float32 scale (0.53x float16's
bytes); float16 keys with int8 values (0.77x float16's bytes). Scores, softmax and value
sums are float32 for every kind."""

_KV_FN_NAMES = (
    ("hearth_kv_write", "hearth_paged_attention"),
    ("hearth_kv_write_f16", "hearth_paged_attention_f16"),
    ("hearth_kv_write_i8", "hearth_paged_attention_i8"),
    ("hearth_kv_write_f16_i8", "hearth_paged_attention_f16_i8"),
)
_KV_SIGNATURES: dict[str, list[type]] = {
    "hearth_kv_write_f16": [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr],
    "hearth_kv_write_i8": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr],
    "hearth_kv_write_f16_i8": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr],
    "hearth_paged_attention_f16": _SIGNATURES["hearth_paged_attention"],
    "hearth_paged_attention_i8": _SIGNATURES["hearth_paged_attention"],
    "hearth_paged_attention_f16_i8": _SIGNATURES["hearth_paged_attention"],
}


@functools.cache
def _kv_fn(name: str, lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    if name not in _KV_SIGNATURES:
        return getattr(lib, name)  # typed with the library
    fn = getattr(lib, name)
    fn.argtypes = _KV_SIGNATURES[name]
    fn.restype = None
    return fn


def _kv_kind(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> int:
    """The kernels' code of the caches' element types, checked (a pair the kernels read,
    CPU, rows of `kv_head_elems`)."""
    kind = _KV_KINDS.get((k_cache.dtype, v_cache.dtype))
    if kind is None:
        raise ValueError(
            "the KV caches must be both float32, both float16, both int8, or float16 keys "
            f"with int8 values, got {k_cache.dtype} and {v_cache.dtype}"
        )
    if k_cache.device.type != "cpu" or v_cache.device.type != "cpu":
        raise ValueError("the KV caches must be CPU tensors")
    for name, cache in (("key", k_cache), ("value", v_cache)):
        row = kv_head_elems(head_dim, cache.dtype)
        if cache.shape[-1] != row:
            raise ValueError(
                f"a {cache.dtype} {name} cache needs rows of {row} elements for head_dim "
                f"{head_dim}, got {cache.shape[-1]}"
            )
    return kind


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`kernels.reference.write_kv_cache` for float32 rows of packed heads (strided rows,
    e.g. views of the fused qkv, are read in place); slots < 0 are skipped.

    The caches (keys, values) are a pair `_KV_KINDS` names, each cache one of: float32
    (copied as is), float16 (each value stored as ``value.half()`` stores it, except that
    values beyond float16's range, and +-inf, saturate to +-65504 instead of becoming inf;
    NaN stays NaN), int8 (`kernels.reference.quantize_kv_int8`: per (slot, kv head) row
    q = round(x * 127 / amax), nearest-even, then the float32 scale amax / 127; values
    clamped to +-65504 first)."""
    _check(key, "key")
    _check(value, "value")
    t, nkv, hd = key.shape
    if key.stride(2) != 1 or value.stride(2) != 1 or (nkv > 1 and key.stride(1) != hd):
        raise ValueError("write_kv_cache needs [T, kv_heads, head_dim] rows with packed heads")
    if (
        slot_mapping.dtype != torch.int64
        or not k_cache.is_contiguous()
        or not v_cache.is_contiguous()
    ):
        raise ValueError("slots must be int64 and the caches contiguous")
    kind = _kv_kind(k_cache, v_cache, hd)
    rec = capture.active()
    if rec is not None:
        rec.rows(t)
        rec.step_input("slot_mapping", slot_mapping)
        rec.emit(capture.OP_KV_WRITE, [key, value, k_cache, v_cache], (nkv * hd, hd), kind=kind)
        return
    fn = _kv_fn(_KV_FN_NAMES[kind][0], library())
    width = (nkv, hd) if kind >= 2 else (nkv * hd,)
    fn(
        _p(key), key.stride(0), _p(value), value.stride(0), t, *width,
        _p(k_cache), _p(v_cache), _p(slot_mapping),
    )  # fmt: skip


class AttentionScratch:
    """Per-thread score rows of the attention kernel (one per query vector of a work item,
    see ``hearth_attention_scratch_floats``), grown on demand and reused."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float32)
        self.per_thread = 0

    def get(self, max_ctx: int) -> torch.Tensor:
        threads = library().hearth_num_threads()
        need = library().hearth_attention_scratch_floats(max(max_ctx, 1))
        if need > self.per_thread:
            self.per_thread = max(need, 2 * self.per_thread)
        # Sized by the threads of the calling thread's OpenMP team: a step run from
        # another Python thread (the engine loop) may have more than the first caller.
        if self._buf.numel() < self.per_thread * threads:
            self._buf = torch.empty(self.per_thread * threads, dtype=torch.float32)
        return self._buf


def f32_prefill_path(variant: str | None = None) -> bool:
    """Whether `variant`'s build (default: the host's) runs prefill runs of the float32
    attention in GEMM-shaped loops (``hearth_attention_f32.c``: the AVX2 build)."""
    return bool(library(variant).hearth_attention_f32_path())


@contextlib.contextmanager
def f32_prefill_min_run(min_run: int, variant: str | None = None) -> Iterator[None]:
    """Within the block, runs of at least `min_run` tokens (0: none) take the float32
    prefill loops of `variant`'s build where it has them. Its results are the same bits as
    the loops every other row takes, so this only moves time: benchmarks and tests use it to
    run both on one call. Process-wide (a C global), restored on exit."""
    knob = ctypes.c_int64.in_dll(library(variant), "hearth_attention_f32_min_run")
    old = knob.value
    knob.value = max(int(min_run), 0)
    try:
        yield
    finally:
        knob.value = old


def f32_prefill_runs_done(variant: str | None = None) -> int:
    """Runs the float32 prefill loops of `variant`'s build have computed in this process (the
    results cannot tell which loops ran: tests read this)."""
    return ctypes.c_int64.in_dll(library(variant), "hearth_attention_f32_runs_done").value


def paged_attention(
    q: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq: torch.Tensor,
    token_ctx: torch.Tensor,
    max_ctx: int,
    scale: float,
    scratch: AttentionScratch,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    min_run: int = 0,
    variant: str | None = None,
) -> torch.Tensor:
    """Causal attention of each query token over its own sequence's paged keys (with a
    ``sliding_window`` W: only the last W of them, its own included; blocks wholly before
    the window of every token of a tile are not read).

    ``min_run`` > 0: runs of at least that many consecutive positions of one sequence
    (prefill chunks) take the bfloat16 kernel (``hearth_attention_bf16.c``: bfloat16
    Q, K, V and softmax weights, float32 sums) where the build has one
    (`kernels.cpu.bf16_ops.attention_path`); every other token, and every token at 0, is
    the float32 kernel's, bitwise. ``variant``: the library of that kernel build (default:
    the host's), so tests and benchmarks can compare builds in one process.

    ``q``: ``[T, >= nh*hd]`` rows (unit column stride; the fused qkv works as is);
    ``block_tables [S, max_blocks]`` int32; ``token_seq [T]`` (row of block_tables) and
    ``token_ctx [T]`` (keys seen = position + 1) int32. Returns ``[T, nh*hd]``.
    The caches are float32, float16 or int8 (both the same); the result is float32 either way,
    computed in float32 from the cache's values.
    """
    _check(q, "q")
    if head_dim % 32:
        raise ValueError("the CPU attention kernel needs head_dim % 32 == 0")
    t = q.shape[0]
    window = int(sliding_window or 0)
    min_run = max(int(min_run), 0)
    rec = capture.active()
    if rec is not None:
        rec.rows(t)
        for name, tensor in (
            ("block_tables", block_tables),
            ("token_seq", token_seq),
            ("token_ctx", token_ctx),
        ):
            rec.step_input(name, tensor)
        out = rec.new(num_heads * head_dim) if out is None else out
        rec.emit(
            capture.OP_ATTENTION, [q, k_cache, v_cache, out],
            (num_heads, num_kv_heads, head_dim, window), (0.0, scale),
            kind=_kv_kind(k_cache, v_cache, head_dim) | min_run << 2,
        )  # fmt: skip
        return out
    if out is None:
        out = torch.empty((t, num_heads * head_dim), dtype=torch.float32)
    buf = scratch.get(max_ctx)
    lib = library(variant)
    _kv_fn(_KV_FN_NAMES[_kv_kind(k_cache, v_cache, head_dim)][1], lib)(
        _p(q),
        t,
        q.stride(0),
        num_heads,
        num_kv_heads,
        head_dim,
        _p(k_cache),
        _p(v_cache),
        k_cache.shape[1],
        _p(block_tables),
        block_tables.shape[1],
        _p(token_seq),
        _p(token_ctx),
        scale,
        _p(out),
        _p(buf),
        scratch.per_thread,
        window,
        min_run,
    )
    return out


_EMBED_BLOCKS = 16
"""The gather's kind code of a GGUF format `dequantize` reads: this plus its code there."""
_EMBED_KINDS = {
    torch.float32: 0,
    torch.uint8: _EMBED_BLOCKS,
    torch.float16: KIND_CODES["f16"],
    torch.bfloat16: KIND_CODES["bf16"],
}
"""Element types of an embedding table the C gather widens, and its `kind` codes (0: float32
rows; uint8: a GGUF's rows, `_EMBED_BLOCKS` plus their format's code; the 16-bit kinds'
codes)."""


def embedding(
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    blocks: str = "q8_0",
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.embedding`` as float32 rows (the C gather, so a step program can record it) of
    a float32 table, of one held in 16 bits (each value widened exactly), or of a GGUF's
    rows (uint8 ``[vocab, row bytes]``) in format `blocks` (Q8_0, or any other
    `dequantizes` reads), dequantized exactly as gguf-py does; times `scale` (a 0-d
    tensor: Gemma's) in float32, as the reference multiplies float32 rows."""
    kind = _EMBED_KINDS.get(weight.dtype)
    if kind is None or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(
            "weight must be a CPU float32, float16 or bfloat16 table or GGUF rows, got "
            f"{weight.dtype}"
        )
    if input_ids.dtype != torch.int64 or not weight.is_contiguous():
        raise ValueError("embedding needs int64 ids and a contiguous table")
    t, h = input_ids.shape[0], weight.shape[1]
    if weight.dtype == torch.uint8:
        if blocks not in _DEQUANTIZED:
            raise ValueError(f"the gather reads no {blocks} rows")
        code, block, values = _DEQUANTIZED[blocks]
        if h % block:
            raise ValueError(
                f"{blocks.upper()} rows of {h} bytes are not whole {block}-byte blocks"
            )
        h = h // block * values
        kind += code
    rec = capture.active()
    if rec is not None:
        rec.rows(t)
        rec.step_input("input_ids", input_ids)
        out = rec.new(h)
        floats = () if scale is None else (float(scale),)
        rec.emit(capture.OP_EMBED, [weight, None, out, None], (h,), floats, kind=kind)
        return out
    out = torch.empty((t, h), dtype=torch.float32)
    library().hearth_embedding(_p(input_ids), t, _p(weight), h, kind, _p(out))
    return out if scale is None else out.mul_(float(scale))
