"""The quantized-activation GEMMs (`kernels/cpu/hearth_q8.c`) against a torch reference.

The reference quantizes x the way the C file's header states (per token and 32-column
block: d = amax / 127, q = round-half-even(x / d) clamped to +-127, s = d * sum(q)) and
must match the kernel's quantizer bit for bit. The GEMM reference computes the stated
formula ``sum_b d_w d_x isum (+ m_w s_x) (+ bias)`` in float64 from the raw GGUF blocks;
the kernel accumulates the same terms in float32 with three roundings per block, so the
bound is ``(3 * blocks + 1) * eps32 * sum |terms|``.

The contract that matters most is bitwise: every variant the host supports (AVX2
maddubs, AVX512, AVX512-VNNI, AMX tiles), every token count, tiling and thread count and
strided inputs give the same bits. Weights are random raw GGUF blocks, so every nibble
and every int8 (including -128, which GGUF's quantizer never writes) occurs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.cpu import build, ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="host has no AVX2 (torch path only)")

from kernels.cpu import q8_ops  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
ISA_CODE = {"avx2": 0, "avx512": 0, "avx512_vnni": 1, "amx": 2}
"""What `hearth_q8a_isa` must say for each variant: proves each really is its own build."""


def _raw_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random GGUF rows [n, k/32 * block bytes]: f16 scales of varied magnitude, all
    quant values (Q4_1 nibbles 0..15, Q8_0 bytes -128..127)."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    d = (rng.uniform(0.5, 2.0, (n, nb)) * 10.0 ** rng.integers(-4, -1, (n, nb))).astype(np.float16)
    if kind == "q4_1":
        m = (-8 * d.astype(np.float32) * rng.uniform(0.5, 1.5, (n, nb))).astype(np.float16)
        qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
        blocks = np.concatenate(
            [d.view(np.uint8).reshape(n, nb, 2), m.view(np.uint8).reshape(n, nb, 2), qs], axis=2
        )
    else:
        qs = rng.integers(-128, 128, (n, nb, 32), dtype=np.int8).view(np.uint8)
        blocks = np.concatenate([d.view(np.uint8).reshape(n, nb, 2), qs], axis=2)
    return np.ascontiguousarray(blocks.reshape(n, -1))


def _weight_parts(kind: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q_w [n, nb, 32] ints, d_w [n, nb], m_w [n, nb]) as float64, from raw GGUF rows."""
    n = raw.shape[0]
    size = 20 if kind == "q4_1" else 34
    blocks = raw.reshape(n, -1, size)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if kind == "q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        qs = blocks[:, :, 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.float64)  # columns j, j + 16
    else:
        m = np.zeros_like(d)
        q = blocks[:, :, 2:34].view(np.int8).astype(np.float64)
    return q, d, m


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stated activation quantizer in torch float32: (q int8, d, s)."""
    t, k = x.shape
    xb = x.reshape(t, k // 32, 32)
    d = xb.abs().amax(dim=2) / 127.0
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(xb / safe[..., None]).clamp(-127, 127)
    q = torch.where((d == 0)[..., None], torch.zeros_like(q), q)
    s = d * q.sum(dim=2)  # the integer sum is exact in float32
    return q.to(torch.int8).reshape(t, k), d, s


def reference_gemm(
    kind: str, x: torch.Tensor, raw: np.ndarray, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the stated formula in float64, sum of |terms|) for every (token, row)."""
    qx, dx, sx = reference_quantize(x.contiguous())
    t, k = x.shape
    qw, dw, mw = _weight_parts(kind, raw)
    qx64 = qx.double().reshape(t, k // 32, 32)
    isum = torch.einsum("tbc,nbc->tnb", qx64, torch.from_numpy(qw))  # exact integers
    scale = torch.from_numpy(dw)[None] * dx.double()[:, None, :]
    main = scale * isum
    minterm = torch.from_numpy(mw)[None] * sx.double()[:, None, :]
    exact = (main + minterm).sum(dim=2)
    size = (main.abs() + minterm.abs()).sum(dim=2)
    if bias is not None:
        exact = exact + bias.double()
        size = size + bias.double().abs()
    return exact, size


def _x(t: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian rows with per-block magnitudes that vary, one all-zero block, and one
    block of exact ties (amax 127 -> d = 1; x.5 values round half to even)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen) * torch.exp(
        torch.randn(t, k // 32, 1, generator=gen)
    ).repeat(1, 1, 32).reshape(t, k)
    if t > 1 and k >= 64:
        x[1, 32:64] = 0.0
        x[0, :32] = torch.tensor([127.0] + [(i - 15) + 0.5 for i in range(31)])
    return x


def _skip_unless_supported(variant: str) -> None:
    isa = build.host_isa()
    if variant not in isa.supported:
        missing = sorted(build._NEEDS[variant] - set(isa.flags))
        pytest.skip(f"host lacks {' '.join(missing)} for the {variant} variant ({isa.cpu})")


VARIANT_MODES = [
    ("avx2", q8_ops.AMX_NEVER),
    ("avx512", q8_ops.AMX_NEVER),
    ("avx512_vnni", q8_ops.AMX_NEVER),
    ("amx", q8_ops.AMX_NEVER),  # the amx build below its threshold: its VNNI kernels
    ("amx", 1),  # AMX tiles at every token count
]
MODE_IDS = ["avx2", "avx512", "avx512_vnni", "amx-vnni", "amx-tiles"]


@pytest.mark.parametrize("variant", build.VARIANTS)
def test_each_variant_is_its_own_build(variant: str) -> None:
    _skip_unless_supported(variant)
    lib = q8_ops.library(variant)
    assert lib.hearth_q8a_isa() == ISA_CODE[variant]
    if variant == "amx":
        # otherwise every "amx" test below would silently run the VNNI kernels
        assert q8_ops.integer_path("amx") == "amx", "the kernel refused AMX tile state"


@pytest.mark.parametrize("variant", build.VARIANTS)
def test_quantizer_matches_reference_bitwise(variant: str) -> None:
    _skip_unless_supported(variant)
    wide = _x(9, 160, seed=1)
    x = wide[:, :128]  # strided rows
    q, d, s = q8_ops.quantize_q8(x, variant)
    rq, rd, rs = reference_quantize(x.contiguous())
    assert torch.equal(d, rd)
    assert torch.equal(q, rq)
    assert torch.equal(s, rs)
    assert q[0, 1:6].tolist() == [-14, -14, -12, -12, -10]  # -14.5, -13.5, ... half to even
    assert bool((q[1, 32:64] == 0).all()) and d[1, 1] == 0 and s[1, 1] == 0


@pytest.mark.parametrize("kind", sorted(q8_ops.KINDS))
@pytest.mark.parametrize(("n", "k"), [(8, 32), (40, 96), (48, 64), (24, 160), (64, 128)])
@pytest.mark.parametrize(("variant", "amx_min_t"), VARIANT_MODES, ids=MODE_IDS)
def test_gemm_matches_float64_reference(
    kind: str, n: int, k: int, variant: str, amx_min_t: int
) -> None:
    """N = 8, 24, 40 leave a half-padded last 16-row group (and 40 an odd pair)."""
    _skip_unless_supported(variant)
    raw = _raw_blocks(kind, n, k, seed=n + k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(k))
    packed = q8_ops.pack_q8act(kind, raw, bias if n % 16 else None)
    x = _x(37, k, seed=n)
    got = q8_ops.linear_q8act(x, packed, variant=variant, amx_min_t=amx_min_t)
    exact, size = reference_gemm(kind, x, raw, packed.bias)
    bound = (3 * (k // 32) + 1) * EPS32 * size + 1e-30
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("kind", sorted(q8_ops.KINDS))
def test_every_variant_gives_the_same_bits(kind: str) -> None:
    n, k = 72, 192
    raw = _raw_blocks(kind, n, k, seed=11)
    packed = q8_ops.pack_q8act(kind, raw, torch.randn(n))
    x = _x(45, k, seed=12)
    results = {}
    for (variant, amx_min_t), name in zip(VARIANT_MODES, MODE_IDS, strict=True):
        if variant in build.host_isa().supported:
            results[name] = q8_ops.linear_q8act(x, packed, variant=variant, amx_min_t=amx_min_t)
    assert "avx2" in results
    for name, got in results.items():
        assert torch.equal(got, results["avx2"]), name
    missing = [v for v in build.VARIANTS if v not in build.host_isa().supported]
    if missing:
        pytest.skip(
            f"compared {', '.join(results)}; host lacks the {', '.join(missing)} variant(s)"
        )


@pytest.mark.parametrize("kind", sorted(q8_ops.KINDS))
@pytest.mark.parametrize(("variant", "amx_min_t"), [*VARIANT_MODES, ("amx", q8_ops.AMX_AUTO)],
                         ids=[*MODE_IDS, "amx-auto"])  # fmt: skip
def test_rows_do_not_depend_on_the_token_count(kind: str, variant: str, amx_min_t: int) -> None:
    """Each of T = 1..70 tokens gives bitwise its T = 1 result (every token tile, AMX
    32-token item, tail and, with amx-auto, both sides of the AMX threshold)."""
    _skip_unless_supported(variant)
    n, k = 40, 64
    packed = q8_ops.pack_q8act(kind, _raw_blocks(kind, n, k, seed=3), torch.randn(n))
    x = _x(70, k, seed=4)
    alone = torch.cat([q8_ops.linear_q8act(x[i : i + 1], packed, variant=variant, amx_min_t=amx_min_t)
                       for i in range(70)])  # fmt: skip
    for t in range(1, 71):
        got = q8_ops.linear_q8act(x[:t], packed, variant=variant, amx_min_t=amx_min_t)
        assert torch.equal(got, alone[:t]), t


@pytest.mark.parametrize("kind", sorted(q8_ops.KINDS))
def test_thread_count_and_strides_do_not_change_the_bits(kind: str) -> None:
    n, k = 200, 256  # 13 groups of 16: an odd group pair at the end
    packed = q8_ops.pack_q8act(kind, _raw_blocks(kind, n, k, seed=5))
    wide = _x(70, k + 64, seed=6)
    x = wide[:, 16 : 16 + k]
    saved = torch.get_num_threads()
    try:
        for amx_min_t in (q8_ops.AMX_NEVER, q8_ops.AMX_AUTO):
            torch.set_num_threads(1)
            one = q8_ops.linear_q8act(x.contiguous(), packed, amx_min_t=amx_min_t)
            torch.set_num_threads(2)
            big = torch.full((70, n + 24), float("nan"))
            two = q8_ops.linear_q8act(x, packed, out=big[:, 8 : 8 + n], amx_min_t=amx_min_t)
            assert torch.equal(one, two)
            # nothing written outside the [70, n] window of the strided output
            assert bool(big[:, :8].isnan().all()) and bool(big[:, 8 + n :].isnan().all())
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("n", [8, 24, 40])
def test_padded_last_group_writes_only_real_rows(n: int) -> None:
    """N % 16 == 8: the last group's 8 zero rows are computed, never stored."""
    packed = q8_ops.pack_q8act("q4_1", _raw_blocks("q4_1", n, 64, seed=n), torch.randn(n))
    for amx_min_t in (q8_ops.AMX_NEVER, 1):
        big = torch.full((20, n + 16), float("nan"))
        q8_ops.linear_q8act(_x(20, 64, seed=1), packed, out=big[:, :n], amx_min_t=amx_min_t)
        assert not bool(big[:, :n].isnan().any())
        assert bool(big[:, n:].isnan().all())


def test_scratch_size_agrees_with_the_library() -> None:
    lib = q8_ops.library()
    for t, k in [(1, 32), (15, 576), (16, 576), (17, 1536), (300, 64)]:
        assert q8_ops.scratch_bytes(t, k) == lib.hearth_q8a_scratch_bytes(t, k)


def test_pack_refuses_bad_shapes() -> None:
    raw = _raw_blocks("q4_1", 12, 64, seed=1)  # 12 rows: not a multiple of 8
    with pytest.raises(ValueError, match="rows"):
        q8_ops.pack_q8act("q4_1", raw)
    with pytest.raises(ValueError, match="unsupported"):
        q8_ops.pack_q8act("q5_0", raw)
    with pytest.raises(ValueError, match="x must be"):
        q8_ops.linear_q8act(
            torch.randn(2, 32), q8_ops.pack_q8act("q4_1", _raw_blocks("q4_1", 8, 64, 1))
        )


def test_close_to_the_fp32_kernel_on_gaussian_inputs() -> None:
    """8-bit activations change the result by well under a percent of its size."""
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    w = np.random.default_rng(0).standard_normal((64, 576)).astype(np.float32) * 0.05
    raw = gguf_quants.quantize(w, GGMLQuantizationType.Q4_1)
    x = torch.randn(16, 576)
    fp32 = ops.linear(x, ops.pack("q4_1", raw))
    q8 = q8_ops.linear_q8act(x, q8_ops.pack_q8act("q4_1", raw))
    rel = float((q8 - fp32).norm() / fp32.norm())
    assert 0 < rel < 0.02, rel
