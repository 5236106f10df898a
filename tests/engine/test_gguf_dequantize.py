"""engine/layers/gguf_dequantize.py: the C dequantizer where it reads the format, gguf-py's
otherwise, with gguf-py's shapes either way (the bits: tests/kernels/test_relayout.py)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize as gguf_py_dequantize
from gguf.quants import quantize

from engine.layers import gguf_dequantize
from kernels.cpu import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="host has no AVX2: no C kernels here")


def _values(*shape: int) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(shape) * 0.1).astype(np.float32)


def _gguf_py(raw: np.ndarray, qtype: GT) -> np.ndarray:
    return np.asarray(gguf_py_dequantize(raw, qtype), np.float32)


def _k_blocks(rows: int, size: int, scale_at: int) -> np.ndarray:
    """Random K-quant blocks (gguf-py has no K-quant quantizer) with finite scales."""
    raw = np.random.default_rng(1).integers(0, 256, (rows, size), dtype=np.uint8)
    raw[:, scale_at : scale_at + 2] = np.array([0.01], np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("shape", [(256,), (3, 256), (2, 3, 512)])
def test_any_outer_shape_comes_back_as_gguf_py_shapes_it(shape: tuple[int, ...]) -> None:
    raw = quantize(_values(*shape), GT.Q8_0)
    got = gguf_dequantize.dequantize(raw, GT.Q8_0)
    assert got.shape == shape and got.dtype == np.float32
    assert np.array_equal(got, _gguf_py(raw, GT.Q8_0))


def test_the_c_dequantizer_is_the_one_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same values would hide a silent fallback to gguf-py: count the C calls."""
    called: list[str] = []
    real = ops.dequantize

    def counting(kind: str, raw: np.ndarray) -> np.ndarray:
        called.append(kind)
        return real(kind, raw)

    monkeypatch.setattr(ops, "dequantize", counting)
    cases = [
        (GT.Q4_1, quantize(_values(2, 256), GT.Q4_1)),
        (GT.Q8_0, quantize(_values(2, 256), GT.Q8_0)),
        (GT.Q4_K, _k_blocks(2, 144, 0)),
        (GT.Q6_K, _k_blocks(2, 210, 208)),
    ]
    for qtype, raw in cases:
        assert np.array_equal(gguf_dequantize.dequantize(raw, qtype), _gguf_py(raw, qtype))
    assert called == ["q4_1", "q8_0", "q4_k", "q6_k"]


def test_formats_the_c_library_lacks_and_float_tensors_go_to_gguf_py() -> None:
    assert not ops.dequantizes("q2_k") and not ops.dequantizes("f16")
    f16 = _values(3, 64).astype(np.float16)
    assert np.array_equal(gguf_dequantize.dequantize(f16, GT.F16), f16.astype(np.float32))
    raw = _k_blocks(2, 84, 80)  # Q2_K: scales, qs, then d and dmin at 80
    got = gguf_dequantize.dequantize(raw, GT.Q2_K)
    assert got.shape == (2, 256) and np.array_equal(got, _gguf_py(raw, GT.Q2_K))
