"""The AMX-BF16 GEMM (kernels/cpu/hearth_bf16.c) against its stated arithmetic.

Contract: each weight and each activation is rounded once to bfloat16 (nearest-even),
products are exact and sums float32, so the result is within float32 accumulation error
of the float64 product of the rounded operands; a row's result is bitwise the same
whatever other rows share the call and whatever the thread count; below `min_t` tokens
`linear_tiles` is exactly the float32 block kernel.
"""

from __future__ import annotations

import pytest
import torch

ops = pytest.importorskip("kernels.cpu.ops")
if not ops.available():
    pytest.skip("host has no AVX2: the CPU kernels do not run here", allow_module_level=True)

from kernels.cpu import bf16_ops  # noqa: E402
from kernels.cpu.build import host_isa  # noqa: E402

BF16_VARIANTS = [v for v in host_isa().supported if bf16_ops.available(v)]
"""Variants with a bfloat16 kernel this host runs: ``amx`` (tiles), ``avx512_vnni``
(AVX512-BF16 dot products, the Zen 4 path, forced down on an AMX host)."""
if not BF16_VARIANTS:
    pytest.skip(
        f"no bfloat16 kernel runs here: {bf16_ops.tile_path()} ({host_isa().describe()})",
        allow_module_level=True,
    )


@pytest.fixture(params=BF16_VARIANTS)
def variant(request) -> str:
    return request.param


def _tiles(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    lib = bf16_ops.library()
    data = torch.empty(lib.hearth_bf16_packed_bytes(n, k) // 2, dtype=torch.int16)
    lib.hearth_pack_bf16(w.contiguous().data_ptr(), n, k, data.data_ptr())
    return data


def _gemm(x: torch.Tensor, tiles: torch.Tensor, n: int, bias=None, ldo_pad=0, variant=None):
    t, k = x.shape
    out = torch.full((t, n + ldo_pad), float("nan"))
    done = bf16_ops.library(variant).hearth_bf16_gemm(
        x.data_ptr(), t, x.stride(0), k, tiles.data_ptr(), n,
        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
    )  # fmt: skip
    assert done == 1
    return out


def _reference(x: torch.Tensor, w: torch.Tensor, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 product of the bfloat16-rounded operands, and the sum of |products| (the
    scale of float32 accumulation error)."""
    xr, wr = x.bfloat16().double(), w.bfloat16().double()
    ref = xr @ wr.T
    if bias is not None:
        ref = ref + bias.double()
    return ref, xr.abs() @ wr.abs().T


SHAPES = [
    (1, 576, 576, False),
    (5, 40, 20, True),  # K and N not multiples of the tile: zero padding
    (16, 64, 48, False),
    (17, 576, 1536, False),  # one full token tile and one of a single row
    (33, 1536, 576, True),
    (64, 576, 192, False),
]


@pytest.mark.parametrize(("t", "k", "n", "bias"), SHAPES)
def test_tiles_compute_the_rounded_operands_product_in_float32(t, k, n, bias, variant) -> None:
    gen = torch.Generator().manual_seed(t * 131 + k + n)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(t, k + 7, generator=gen)[:, :k]  # strided rows
    b = torch.randn(n, generator=gen) if bias else None
    out = _gemm(x, _tiles(w), n, b, ldo_pad=3, variant=variant)
    ref, scale = _reference(x, w, b)
    err = (out[:, :n].double() - ref).abs()
    # float32 sums of k exact products: at most ~k * 2^-24 relative to the sum of |products|
    assert bool((err <= scale * k * 2.0**-24 + 1e-30).all()), float((err / scale).max())
    assert bool(out[:, n:].isnan().all()), "wrote past n into the output's padding"


def test_rounding_is_once_per_operand_to_nearest_even(variant) -> None:
    """An activation that is not a bfloat16 value is rounded (not truncated) before the
    product: 1 + 2^-8 + 2^-10 rounds up to 1 + 2^-7 (truncation would give 1)."""
    k, n = 32, 16
    x = torch.zeros(1, k)
    x[0, 0] = 1 + 2.0**-8 + 2.0**-10
    w = torch.zeros(n, k)
    w[:, 0] = 1.0
    out = _gemm(x, _tiles(w), n, variant=variant)
    assert torch.equal(out[0], torch.full((n,), 1 + 2.0**-7))


def test_a_rows_result_does_not_depend_on_the_batch_or_threads(variant) -> None:
    gen = torch.Generator().manual_seed(7)
    k, n = 576, 1536
    w = torch.randn(n, k, generator=gen)
    tiles = _tiles(w)
    x = torch.randn(100, k, generator=gen)
    full = _gemm(x, tiles, n, variant=variant)
    for t in (1, 15, 16, 17, 33, 64):
        assert torch.equal(_gemm(x[:t].contiguous(), tiles, n, variant=variant), full[:t]), t
    assert torch.equal(_gemm(x[40:41].contiguous(), tiles, n, variant=variant), full[40:41])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _gemm(x, tiles, n, variant=variant)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, full)


def _blocks_and_dense(n: int, k: int):
    """A random Q4_1 GGUF weight: its packed blocks and its dequantized float32 values."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    gen = torch.Generator().manual_seed(n + k)
    dense = torch.randn(n, k, generator=gen).numpy()
    raw = quantize(dense, GGMLQuantizationType.Q4_1)
    deq = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1).astype(np.float32))
    return ops.pack("q4_1", raw), deq


def test_linear_tiles_is_the_block_kernel_below_min_t_and_the_tiles_from_it() -> None:
    n, k = 192, 576
    blocks, dense = _blocks_and_dense(n, k)
    weight = bf16_ops.pack_tiles(dense, blocks, min_t=16)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, k, generator=gen)
    for t in (1, 15):
        assert torch.equal(bf16_ops.linear_tiles(x[:t], weight), ops.linear(x[:t], blocks))
    tiles = _gemm(x, weight.data, n)
    for t in (16, 40):
        got = bf16_ops.linear_tiles(x[:t], weight)
        assert torch.equal(got, tiles[:t])
        assert not torch.equal(got, ops.linear(x[:t], blocks))  # really the other kernel


def test_the_default_threshold_follows_the_tile_path() -> None:
    """16 tokens where AMX tiles run, 6 on AVX512-BF16 (measured there, `VDPBF16_MIN_T`), and
    a weight packed without `min_t` takes it: one token under it the block kernel, from it
    the tiles."""
    expected = {"amx-bf16": bf16_ops.AMX_MIN_T, "avx512-bf16": bf16_ops.VDPBF16_MIN_T}
    for variant in host_isa().supported:
        path = bf16_ops.tile_path(variant).split(" ")[0]
        if path in expected:
            assert bf16_ops.default_min_t(variant) == expected[path], variant
    assert (bf16_ops.AMX_MIN_T, bf16_ops.VDPBF16_MIN_T) == (16, 6)
    n, k = 192, 576
    blocks, dense = _blocks_and_dense(n, k)
    weight = bf16_ops.pack_tiles(dense, blocks)
    min_t = bf16_ops.default_min_t()
    assert weight.min_t == min_t
    x = torch.randn(min_t, k, generator=torch.Generator().manual_seed(2))
    below = x[: min_t - 1]
    assert torch.equal(bf16_ops.linear_tiles(below, weight), ops.linear(below, blocks))
    assert torch.equal(bf16_ops.linear_tiles(x, weight), _gemm(x, weight.data, n))
    assert not torch.equal(bf16_ops.linear_tiles(x, weight), ops.linear(x, blocks))


def test_pack_tiles_refuses_a_dense_weight_of_another_shape() -> None:
    blocks, dense = _blocks_and_dense(64, 64)
    with pytest.raises(ValueError, match="does not match"):
        bf16_ops.pack_tiles(dense[:32], blocks)


def test_each_variant_reports_its_bfloat16_path() -> None:
    """``avx2`` and ``avx512`` builds have no bfloat16 kernel (callers run the float32
    kernels), ``avx512_vnni`` has the AVX512-BF16 one, ``amx`` the tiles."""
    expected = {"avx2": "none", "avx512": "none", "avx512_vnni": "avx512-bf16", "amx": "amx-bf16"}
    for variant in host_isa().supported:
        assert bf16_ops.tile_path(variant).startswith(expected[variant]), variant
        assert bf16_ops.available(variant) == (expected[variant] != "none")


def test_the_amx_and_avx512_paths_agree_to_float32_rounding() -> None:
    if not {"amx", "avx512_vnni"} <= set(BF16_VARIANTS):
        pytest.skip(f"needs both the amx and avx512_vnni variants ({host_isa().describe()})")
    gen = torch.Generator().manual_seed(11)
    k, n = 576, 192
    w, x = torch.randn(n, k, generator=gen), torch.randn(37, k, generator=gen)
    tiles = _tiles(w)
    amx = _gemm(x, tiles, n, variant="amx").double()
    vec = _gemm(x, tiles, n, variant="avx512_vnni").double()
    _, scale = _reference(x, w)
    assert bool(((amx - vec).abs() <= 2 * scale * k * 2.0**-24).all())


def _gguf_weight(kind: str, n: int, k: int, bias: torch.Tensor | None = None):
    """Random GGUF rows of `kind` (gguf-py's quantizer): the rows, their packed blocks and
    their dequantized float32 values."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}[kind]
    gen = torch.Generator().manual_seed(n * 7 + k)
    raw = quantize(torch.randn(n, k, generator=gen).numpy(), qtype)
    deq = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    return raw, ops.pack(kind, raw, bias), deq


needs_qtiles = pytest.mark.skipif(
    not bf16_ops.qtiles_path(),
    reason=f"tiles are built from the blocks only where AMX tiles run ({bf16_ops.tile_path()})",
)


@needs_qtiles
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tiles_built_from_the_blocks_are_the_stored_tiles_bit_for_bit(kind, with_bias) -> None:
    """The Q-tiles path (calls of QTILES_MIN_T tokens up) gives exactly the bits of the
    stored bfloat16 tiles: n not a multiple of 16 (a padded group), strided rows, a
    partial last token pair, one token pair, 300 tokens (one band of 10 token pairs), 400
    (two bands of 6 and 7) and 1032 (four bands, the last of 9: a 1024-token prompt chunk
    and its step's decodes)."""
    n, k = 200, 576
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)) if with_bias else None
    raw, blocks, dense = _gguf_weight(kind, n, k, bias)
    stored = bf16_ops.pack_tiles(dense, blocks, min_t=16)
    built = bf16_ops.pack_tiles(dense, blocks, min_t=16, raw=raw)
    assert (stored.q_min_t, built.q_min_t) == (0, bf16_ops.QTILES_MIN_T)
    x = torch.randn(1032, k + 5, generator=torch.Generator().manual_seed(4))[:, :k]
    for t in (16, 31, 32, 33, 64, 97, 300, 400, 1032):
        assert torch.equal(
            bf16_ops.linear_tiles(x[:t], built), bf16_ops.linear_tiles(x[:t], stored)
        ), t


@needs_qtiles
def test_calls_from_qtiles_min_t_up_read_the_qtiles() -> None:
    """With the Q-tiles zeroed (every weight they stand for is 0), calls of QTILES_MIN_T
    tokens and more give zeros and shorter ones still the stored tiles' result: the
    dispatch really reads the records it packed."""
    n, k = 64, 576
    raw, blocks, dense = _gguf_weight("q4_1", n, k)
    stored = bf16_ops.pack_tiles(dense, blocks, min_t=16)
    built = bf16_ops.pack_tiles(dense, blocks, min_t=16, raw=raw)
    tile_halfwords = bf16_ops.library().hearth_bf16_packed_bytes(n, k) // 2
    built.data[tile_halfwords:] = 0
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(5))
    short = bf16_ops.QTILES_MIN_T - 1
    assert torch.equal(
        bf16_ops.linear_tiles(x[:short], built), bf16_ops.linear_tiles(x[:short], stored)
    )
    assert torch.equal(bf16_ops.linear_tiles(x, built), torch.zeros(64, n))
