"""The C GGUF re-layout (kernels/cpu/hearth_cpu.c) bit for bit against its references:
gguf-py's dequantizers and Q8_0 quantizer (llama.cpp's own, in Python), and the numpy Q4_K
re-layout it replaced (tests/kernels/relayout_reference.py). Blocks are random bytes with
finite float16 scales, from subnormal to past float16's range in the products."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize, quantize

from kernels.cpu import ops
from tests.kernels.relayout_reference import q4_k_as_q4_1

pytestmark = pytest.mark.skipif(not ops.available(), reason="host has no AVX2: no C kernels here")

_SCALES = np.array(
    [0.0, -0.0, 6e-8, 1e-5, 0.0013, -0.02, 0.5, 3.0, 1000.0, 60000.0, -65504.0], np.float16
)
"""Scale values the blocks draw from: zeros, a subnormal, the usual, the largest."""


def _blocks(
    rows: int, per_row: int, size: int, scale_at: list[int], seed: int, scales=_SCALES
) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, per_row, size), dtype=np.uint8)
    for at in scale_at:
        picks = rng.choice(scales, (rows, per_row))
        picks[0, 0] = np.float16(0.01)  # one block of each kind ordinary
        raw[..., at : at + 2] = picks.view(np.uint8).reshape(rows, per_row, 2)
    return raw.reshape(rows, -1)


def test_q4_k_re_layout_is_the_numpy_one_bit_for_bit() -> None:
    raw = _blocks(7, 3, 144, [0, 2], seed=1, scales=_SCALES[np.abs(_SCALES) < 1000])
    want = q4_k_as_q4_1(raw)
    got = ops.relay_as_q4_1("q4_k", raw)
    assert got is not None and got.shape == want.shape == (7, 3 * 8 * 20)
    assert np.array_equal(got, want)


def test_a_q4_k_scale_past_float16s_range_is_reported() -> None:
    """d·sc up to 1039·63 fits float16; 1040·63 rounds to inf: no Q4_1 for that tensor
    (engine/layers/gguf_relayout.py falls back to Q8_0)."""
    raw = _blocks(2, 2, 144, [0, 2], seed=4, scales=np.array([0.01], np.float16))
    raw.reshape(2, 2, 144)[..., 4:16] = 63  # every sub-block's scale and min: 63
    for d, fits in ((1039.0, True), (1040.0, False)):
        raw.reshape(2, 2, 144)[1, 1, 0:2] = np.array([d], np.float16).view(np.uint8)
        assert (ops.relay_as_q4_1("q4_k", raw) is not None) == fits
        assert ops.q4_1_overflows("q4_k", raw) == (not fits)
        if not fits:
            with pytest.raises(ValueError, match="past float16's range"):
                ops.pack_parts("q4_1", [("q4_k", np.tile(raw, (4, 1)))])  # 8 rows


def test_a_q4_0_scale_past_float16s_range_is_reported() -> None:
    """Q4_0 as Q4_1 takes m = -8·d: 8188·8 fits float16, 8192·8 does not (nor a NaN d)."""
    raw = _blocks(8, 2, 18, [0], seed=5, scales=np.array([0.01], np.float16))
    assert not ops.q4_1_overflows("q4_0", raw)
    for d, fits in ((8188.0, True), (8192.0, False), (np.nan, False)):
        raw.reshape(8, 2, 18)[7, 1, 0:2] = np.array([d], np.float16).view(np.uint8)
        assert ops.q4_1_overflows("q4_0", raw) == (not fits)
        assert (ops.relay_as_q4_1("q4_0", raw) is None) == (not fits)


_STORED = {"q4_0": (18, [0]), "q4_1": (20, [0, 2]), "q4_k": (144, [0, 2]), "q5_k": (176, [0, 2]),
           "q6_k": (210, [208]), "q8_0": (34, [0])}  # fmt: skip
"""Bytes of a block of each format `pack_parts` reads and where its float16 scales are."""


@pytest.mark.parametrize(
    ("kind", "stored"),
    [("q4_1", s) for s in ops.PACKED_FROM["q4_1"]] + [("q8_0", s) for s in ops.PACKED_FROM["q8_0"]],
)
def test_packing_from_a_stored_format_is_re_laying_then_packing_bit_for_bit(
    kind: str, stored: str
) -> None:
    """`pack_parts` re-lays block by block as it packs: the same bytes as the re-layout
    (`relay_as_q4_1` for Q4_K, Q4_0's d and -8·d, `requantize_k`) packed by `pack`, for 16 rows of 2
    super-blocks (Q4_1 scales kept within float16's range)."""
    size, scale_at = _STORED[stored]
    per_row = 512 // (256 if size > 34 else 32)
    scales = _SCALES[np.abs(_SCALES) < 1000] if kind == "q4_1" else _SCALES
    raw = _blocks(16, per_row, size, scale_at, seed=6, scales=scales)
    if stored == "q4_k" and kind == "q4_1":
        relaid = ops.relay_as_q4_1("q4_k", raw)
    elif stored == "q4_0":
        blocks = raw.reshape(16, -1, 18)
        d = blocks[..., :2].copy().view(np.float16)
        m = (d * np.float16(-8)).astype(np.float16)
        relaid = np.concatenate([blocks[..., :2], m.view(np.uint8), blocks[..., 2:]], -1)
    elif stored != kind:
        relaid = ops.requantize_k(stored, raw)
    else:
        relaid = raw
    got = ops.pack_parts(kind, [(stored, raw)])
    want = ops.pack(kind, relaid.reshape(16, -1))
    assert (got.n, got.k) == (want.n, want.k) == (16, 512)
    assert np.array_equal(got.data.numpy(), want.data.numpy())


def test_a_weight_packs_from_parts_of_different_formats_in_row_order() -> None:
    """q, k and v stored in different formats: each part's groups in order, the same bytes
    as the joined re-laid rows packed whole; parts must be whole groups of rows, of one
    width, in a format the kind is packed from."""
    q = _blocks(16, 2, 144, [0, 2], seed=7)
    k = _blocks(8, 2, 210, [208], seed=8)
    v = _blocks(8, 16, 34, [0], seed=9)
    got = ops.pack_parts("q8_0", [("q4_k", q), ("q6_k", k), ("q8_0", v)])
    joined = np.concatenate([ops.requantize_k("q4_k", q), ops.requantize_k("q6_k", k), v])
    assert np.array_equal(got.data.numpy(), ops.pack("q8_0", joined).data.numpy())
    assert got.n == 32
    with pytest.raises(ValueError, match="rows % 8"):
        ops.pack_parts("q8_0", [("q4_k", q[:12]), ("q6_k", k)])
    with pytest.raises(ValueError, match="different widths"):
        ops.pack_parts("q8_0", [("q4_k", q), ("q8_0", v[:, : 8 * 34])])
    with pytest.raises(ValueError, match="q6_k rows are not packed as q4_1"):
        ops.pack_parts("q4_1", [("q6_k", k)])


@pytest.mark.parametrize(
    ("kind", "size", "scale_at"),
    [("q4_k", 144, [0, 2]), ("q5_k", 176, [0, 2]), ("q6_k", 210, [208])],
)
def test_k_quants_requantize_as_gguf_py_would_bit_for_bit(
    kind: str, size: int, scale_at: list[int]
) -> None:
    """gguf-py's dequantization of the file's blocks, then its Q8_0 quantization (blocks
    whose values overflow float32 left out: gguf-py's inf / nan arithmetic is not ggml's)."""
    raw = _blocks(5, 4, size, scale_at, seed=2)
    got = ops.requantize_k(kind, raw)
    with np.errstate(over="ignore", invalid="ignore"):
        values = dequantize(raw, GT[kind.upper()]).astype(np.float32)
        want = np.asarray(quantize(values, GT.Q8_0))
    assert got.shape == want.shape == (5, 4 * 8 * 34)
    finite = np.isfinite(values.reshape(5, -1, 32)).all(-1)  # [rows, 32-column blocks]
    assert finite.sum() > finite.size // 2
    assert np.array_equal(got.reshape(5, -1, 34)[finite], want.reshape(5, -1, 34)[finite])


def test_q8_0_quantization_is_gguf_pys_bit_for_bit() -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 256)) * 0.05).astype(np.float32)
    x[1] = 0.0  # d = 0
    x[2, :32] = np.arange(32, dtype=np.float32) - 15.5  # halves after scaling
    x[3] *= 1e4
    x[4, ::7] = -x[4, ::7] * 30  # outliers
    got = ops.quantize_q8_0(x)
    want = np.asarray(quantize(x, GT.Q8_0))
    assert got.shape == want.shape == (6, 8 * 34)
    assert np.array_equal(got, want)


@pytest.mark.parametrize(
    ("kind", "size", "scale_at"),
    [
        ("q4_0", 18, [0]),
        ("q4_1", 20, [0, 2]),
        ("q5_0", 22, [0]),
        ("q5_1", 24, [0, 2]),
        ("q8_0", 34, [0]),
        ("q4_k", 144, [0, 2]),
        ("q5_k", 176, [0, 2]),
        ("q6_k", 210, [208]),
    ],
)
def test_dequantization_is_gguf_pys_bit_for_bit(kind: str, size: int, scale_at: list[int]) -> None:
    """Every bit of every value, signed zeros and infinities included (gguf-py's products
    overflow float32 for the largest scales of the K-quants as the C ones do)."""
    raw = _blocks(6, 5, size, scale_at, seed=5)
    got = ops.dequantize(kind, raw)
    with np.errstate(over="ignore", invalid="ignore"):
        want = np.asarray(dequantize(raw, GT[kind.upper()]), np.float32)
    assert got.shape == want.shape and got.dtype == np.float32
    finite = np.isfinite(want)
    assert finite.mean() > 0.5
    assert np.array_equal(got.view(np.uint32)[finite], want.view(np.uint32)[finite])
    assert np.array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.parametrize(
    ("kind", "size", "scale_at"),
    [("q4_1", 20, [0, 2]), ("q5_0", 22, [0]), ("q4_k", 144, [0, 2]), ("q6_k", 210, [208])],
)
def test_the_gather_reads_a_token_table_in_its_own_format(
    kind: str, size: int, scale_at: list[int]
) -> None:
    """A GGUF's token table gathered from its own rows (engine/layers/gguf_linear.py
    `gather_table_from_blocks`): each row gguf-py's dequantization, bit for bit."""
    import torch

    raw = _blocks(12, 2, size, scale_at, seed=6, scales=_SCALES[np.abs(_SCALES) < 1000])
    ids = torch.tensor([11, 0, 5, 5, 7])
    got = ops.embedding(ids, torch.from_numpy(raw.copy()), blocks=kind)
    want = np.asarray(dequantize(raw, GT[kind.upper()]), np.float32)[ids.numpy()]
    assert got.shape == want.shape and np.array_equal(
        got.numpy().view(np.uint32), want.view(np.uint32)
    )
    with pytest.raises(ValueError, match=f"{kind.upper()} rows of {size + 1} bytes"):
        ops.embedding(ids, torch.zeros(12, size + 1, dtype=torch.uint8), blocks=kind)


def test_dequantization_rejects_rows_of_partial_blocks() -> None:
    with pytest.raises(ValueError, match=r"q4_1 rows must be \[rows, n \* 20\]"):
        ops.dequantize("q4_1", np.zeros((2, 30), np.uint8))
