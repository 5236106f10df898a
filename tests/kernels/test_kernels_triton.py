"""Every Triton kernel against the torch reference.

On CPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, set by this
directory's conftest), so shapes are kept small; on a CUDA machine the same tests run the
compiled kernels. The reference itself is checked against independent oracles in
``test_kernels_reference.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import kernels
from kernels import reference
from tests.kernels.cases import make_step, naive_attention, scatter_dense_kv

DTYPES = [torch.float32, torch.bfloat16]

# ------------------------------------------------------------------------- bf16 oracle
#
# A 16-bit kernel must round where transformers rounds (the reference's docstrings say
# where); dropping one of those roundings moves results by about one bf16 step, so a
# tolerance of several steps cannot see it. The 16-bit checks below are therefore exact
# up to one rounding step: against an oracle that repeats the reference's arithmetic in
# float32 with its rounding points explicit, rounding the way the Triton build on this
# device does (the GPU: to nearest-even, as torch; triton's interpreter: toward zero).
# Each oracle is first checked to be the reference, bit for bit, when it rounds as torch.


Round = Callable[[torch.Tensor, torch.dtype], torch.Tensor]
"""How float32 values are rounded to a 16-bit dtype."""


def _nearest(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


def _toward_zero(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> bf16 by truncation, as triton's interpreter casts."""
    if dtype == torch.float32:
        return x
    assert dtype == torch.bfloat16
    bits = x.contiguous().view(torch.int32) & -65536  # sign, exponent, 7 mantissa bits
    return bits.view(torch.float32).to(dtype)  # exact: the dropped bits are zero


@pytest.fixture
def device_round(triton_device: str) -> Round:
    """The rounding of the Triton build under test (the interpreter runs on CPU)."""
    return _toward_zero if triton_device == "cpu" else _nearest


def _rms_norm_oracle(x: torch.Tensor, w: torch.Tensor, eps: float, rnd: Round) -> torch.Tensor:
    xf = x.float()
    normed = rnd(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps), x.dtype)
    return rnd(w.float() * normed.float(), x.dtype)


def _rotate_oracle(x: torch.Tensor, cs: torch.Tensor, rnd: Round) -> torch.Tensor:
    half = cs.shape[-1] // 2
    cos = rnd(cs[:, None, :half].float(), x.dtype).float()  # [T, 1, half]
    sin = rnd(cs[:, None, half:].float(), x.dtype).float()
    x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    out = x.clone()
    out[..., :half] = rnd(rnd(x1 * cos, x.dtype).float() - rnd(x2 * sin, x.dtype).float(), x.dtype)
    out[..., half : 2 * half] = rnd(
        rnd(x2 * cos, x.dtype).float() + rnd(x1 * sin, x.dtype).float(), x.dtype
    )
    return out


def _silu_and_mul_oracle(x: torch.Tensor, rnd: Round) -> torch.Tensor:
    d = x.shape[-1] // 2
    gate, up = x[..., :d].float(), x[..., d:].float()
    return rnd(rnd(torch.nn.functional.silu(gate), x.dtype).float() * up, x.dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance of two bf16 tensors in bf16 steps (units in the last place)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)  # sign-magnitude -> a monotone integer

    return (ordered(a) - ordered(b)).abs()


def assert_one_rounding_step(got: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 ``got`` equals ``expected`` up to one rounding step, and bit for bit almost
    everywhere. float32 sums and ``exp``/``rsqrt`` may round differently in the last float32
    bit, which moves a bf16 result by one step only when it sits on a rounding boundary
    (rare); a missing or extra rounding moves a large share of the elements."""
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == expected.shape
    ulps = _ulps(got, expected)
    worst = int(ulps.max()) if ulps.numel() else 0
    off = int((ulps > 0).sum())
    assert worst <= 1 and off <= max(1, ulps.numel() // 100), (
        f"bf16: {off} of {ulps.numel()} elements differ (at most 1% may, by one step), "
        f"by up to {worst} steps; first: got {got.flatten()[ulps.flatten().argmax()].item()} "
        f"vs {expected.flatten()[ulps.flatten().argmax()].item()}"
    )


def _close(
    got: torch.Tensor,
    expected: torch.Tensor,
    oracle: Callable[[Round], torch.Tensor],
    device_round: Round,
) -> None:
    """float32: the reference within 1e-5. bf16: the oracle, rounding as this device's
    Triton build, within one rounding step; and the oracle rounding as torch is the
    reference bit for bit (so it cannot drift from what it stands in for)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        return
    assert torch.equal(oracle(_nearest), expected), "the oracle is not the reference"
    assert_one_rounding_step(got, oracle(device_round))


# ------------------------------------------------------------------------- rms norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100])
def test_rms_norm(triton_device: str, device_round: Round, dtype: torch.dtype, hidden: int) -> None:
    from kernels.triton.rms_norm import rms_norm_triton

    torch.manual_seed(0)
    x = (torch.randn(5, hidden) * 4).to(dtype=dtype, device=triton_device)
    w = (torch.rand(hidden) + 0.5).to(dtype=dtype, device=triton_device)
    got = rms_norm_triton(x, w, 1e-6)
    expected = reference.rms_norm(x, w, 1e-6)
    _close(got, expected, lambda rnd: _rms_norm_oracle(x, w, 1e-6, rnd), device_round)


def test_rms_norm_strided_rows(triton_device: str) -> None:
    from kernels.triton.rms_norm import rms_norm_triton

    big = torch.randn(4, 96, device=triton_device)
    x = big[:, 16:80]  # row stride 96
    w = torch.rand(64, device=triton_device)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(triton_device: str, device_round: Round, dtype: torch.dtype) -> None:
    from kernels.triton.rms_norm import fused_add_rms_norm_triton

    torch.manual_seed(1)
    x = torch.randn(6, 80).to(dtype=dtype, device=triton_device)
    r = torch.randn(6, 80).to(dtype=dtype, device=triton_device)
    w = torch.rand(80).to(dtype=dtype, device=triton_device)
    x0, r0 = x.clone(), r.clone()
    normed, new_res = fused_add_rms_norm_triton(x, r, w, 1e-6)
    ref_normed, ref_res = reference.fused_add_rms_norm(x, r, w, 1e-6)
    # One rounding of the sum, bit for bit.
    total = x.float() + r.float()
    assert torch.equal(_nearest(total, dtype), ref_res), "the oracle is not the reference"
    assert torch.equal(new_res, device_round(total, dtype))
    oracle = lambda rnd: _rms_norm_oracle(rnd(total, dtype), w, 1e-6, rnd)  # noqa: E731
    _close(normed, ref_normed, oracle, device_round)
    assert torch.equal(x, x0) and torch.equal(r, r0)


# ------------------------------------------------------------------------- rotary


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv", "rot_dim"), [(9, 3, 64), (4, 4, 32), (6, 1, 48)])
def test_rotary_embedding(
    triton_device: str,
    device_round: Round,
    dtype: torch.dtype,
    num_heads: int,
    num_kv: int,
    rot_dim: int,
) -> None:
    from kernels.triton.rotary import rotary_embedding_triton

    torch.manual_seed(2)
    head_dim = 64
    t = 7
    qkv = torch.randn(t, (num_heads + 2 * num_kv) * head_dim).to(dtype=dtype, device=triton_device)
    q = qkv[:, : num_heads * head_dim].view(t, num_heads, head_dim)  # strided views
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv) * head_dim].view(t, num_kv, head_dim)
    positions = torch.tensor([0, 5, 3, 99, 1, 64, 17], device=triton_device)
    cache = reference.build_cos_sin_cache(rot_dim, 128, 10000.0, torch.float32, triton_device, None)
    q_out, k_out = rotary_embedding_triton(positions, q, k, cache)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, cache)
    cs = cache[positions]
    _close(q_out, q_ref, lambda rnd: _rotate_oracle(q, cs, rnd), device_round)
    _close(k_out, k_ref, lambda rnd: _rotate_oracle(k, cs, rnd), device_round)


# ------------------------------------------------------------------------- activation


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [24, 1536])
def test_silu_and_mul(
    triton_device: str, device_round: Round, dtype: torch.dtype, width: int
) -> None:
    from kernels.triton.activation import silu_and_mul_triton

    torch.manual_seed(3)
    x = (torch.randn(4, 2 * width) * 3).to(dtype=dtype, device=triton_device)
    _close(
        silu_and_mul_triton(x),
        reference.silu_and_mul(x),
        lambda rnd: _silu_and_mul_oracle(x, rnd),
        device_round,
    )


# ------------------------------------------------------------------------- kv cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache(triton_device: str, dtype: torch.dtype) -> None:
    from kernels.triton.kv_cache import write_kv_cache_triton

    torch.manual_seed(4)
    nb, bs, kv, d = 8, 4, 3, 24
    qkv = torch.randn(6, (6 + 2 * kv) * d).to(dtype=dtype, device=triton_device)
    key = qkv[:, 6 * d : (6 + kv) * d].view(6, kv, d)
    value = qkv[:, (6 + kv) * d :].view(6, kv, d)
    slots = torch.tensor([5, -1, 31, 0, -1, 17], device=triton_device)
    caches = [torch.randn(nb, bs, kv, d).to(dtype=dtype, device=triton_device) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    write_kv_cache_triton(key, value, caches[0], caches[1], slots)
    reference.write_kv_cache(key, value, ref_caches[0], ref_caches[1], slots)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


# ------------------------------------------------------------------------- paged attention

CASES = {
    "decode_only": ([(1, 1), (17, 1), (40, 1), (5, 1)], None),
    "single_prefill_no_prefix": ([(37, 37)], None),
    "chunk_with_cached_prefix": ([(50, 21)], None),
    "mixed": ([(12, 1), (45, 1), (29, 29), (40, 17), (3, 3)], None),
    "one_token_prefill": ([(21, 1), (9, 1)], 1),
}


def _case(
    name: str,
    num_heads: int,
    num_kv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    garbage: float = 30.0,
) -> tuple:
    seqs, num_decodes = CASES[name]
    gen = torch.Generator().manual_seed(11)
    num_blocks = sum(-(-s // block_size) for s, _ in seqs) + 5
    step = make_step(
        seqs, block_size, num_blocks, generator=gen, table_pad=1, num_decodes=num_decodes
    )
    shape = (num_blocks, block_size, num_kv, head_dim)
    kc = torch.full(shape, garbage) if garbage != garbage else torch.randn(shape) * garbage
    vc = torch.full(shape, garbage) if garbage != garbage else torch.randn(shape) * garbage
    keys = [torch.randn(s, num_kv, head_dim, generator=gen).to(dtype) for s, _ in seqs]
    values = [torch.randn(s, num_kv, head_dim, generator=gen).to(dtype) for s, _ in seqs]
    kc, vc = kc.to(dtype), vc.to(dtype)
    scatter_dense_kv(step, keys, values, kc, vc)
    meta = step.meta
    for f in (
        "slot_mapping",
        "decode_block_tables",
        "decode_seq_lens",
        "prefill_query_start_loc",
        "prefill_block_tables",
        "prefill_seq_lens",
    ):
        setattr(meta, f, getattr(meta, f).to(device))
    q = torch.randn(step.positions.shape[0], num_heads, head_dim, generator=gen).to(dtype)
    return step, q.to(device), kc.to(device), vc.to(device), keys, values


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    ("num_heads", "num_kv", "head_dim", "block_size"),
    [(6, 2, 32, 16), (4, 4, 16, 8), (3, 1, 24, 5)],
    ids=["gqa3_bs16", "mha_bs8", "mqa_hd24_bs5"],
)
def test_paged_attention_fp32(
    triton_device: str, case: str, num_heads: int, num_kv: int, head_dim: int, block_size: int
) -> None:
    from kernels.triton.paged_attention import paged_attention_triton

    step, q, kc, vc, _, _ = _case(
        case, num_heads, num_kv, head_dim, block_size, torch.float32, triton_device
    )
    scale = head_dim**-0.5
    # Small tiles so several K/V tiles, several query blocks and tiles spanning cache
    # blocks are all exercised.
    got = paged_attention_triton(q, kc, vc, step.meta, scale, block_m=16, block_n=16)
    expected = reference.paged_attention(q, kc, vc, step.meta, scale)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", ["mixed", "decode_only"])
def test_paged_attention_bf16_default_tiles(triton_device: str, case: str) -> None:
    from kernels.triton.paged_attention import paged_attention_triton

    step, q, kc, vc, _, _ = _case(case, 9, 3, 64, 16, torch.bfloat16, triton_device)
    got = paged_attention_triton(q, kc, vc, step.meta, 0.125)  # production tile sizes
    expected = reference.paged_attention(q, kc, vc, step.meta, 0.125)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_paged_attention_never_reads_unused_slots(triton_device: str) -> None:
    """NaN in every slot no sequence owns (unwritten cache, block-table padding) must not
    reach the output: the kernels mask their loads by seq_len."""
    from kernels.triton.paged_attention import paged_attention_triton

    step, q, kc, vc, keys, values = _case(
        "mixed", 4, 2, 16, 8, torch.float32, triton_device, garbage=float("nan")
    )
    got = paged_attention_triton(q, kc, vc, step.meta, 0.25, block_m=16, block_n=16)
    assert torch.isfinite(got).all()
    expected = naive_attention(step, q.cpu(), keys, values, 0.25)
    torch.testing.assert_close(got.double().cpu(), expected, atol=2e-5, rtol=2e-5)


def _on_cpu(meta: kernels.AttentionMetadata) -> kernels.AttentionMetadata:
    import dataclasses

    return dataclasses.replace(
        meta,
        **{
            f.name: getattr(meta, f.name).cpu()
            for f in dataclasses.fields(meta)
            if isinstance(getattr(meta, f.name), torch.Tensor)
        },
        reference_plan=None,
        reference_window_plans=None,
    )


@pytest.mark.parametrize("case", ["decode_only", "single_prefill_no_prefix", "mixed"])
@pytest.mark.parametrize("window", [1, 7, 20])
def test_paged_attention_sliding_window(triton_device: str, case: str, window: int) -> None:
    """A sliding window in the decode, split-KV decode and prefill kernels: equal to the
    float64 oracle, and keys before each query's window are never read (NaN there, as in
    a freed block that another sequence reuses, would reach the output otherwise)."""
    from kernels.triton.paged_attention import paged_attention_triton

    step, q, kc, vc, keys, values = _case(
        case, 4, 2, 16, 4, torch.float32, triton_device, garbage=float("nan")
    )
    poisoned = 0
    for table, seq_len, q_len in zip(
        step.block_tables, step.seq_lens, step.query_lens, strict=True
    ):
        # The earliest key any of this sequence's queries sees; whole blocks that end
        # before it get NaN: the kernels must skip them, not just mask them.
        first_seen = seq_len - q_len - window + 1
        for i, block in enumerate(table):
            if (i + 1) * 4 <= first_seen:
                kc[block] = float("nan")
                vc[block] = float("nan")
                poisoned += 1
    assert poisoned or window == 20 or case == "single_prefill_no_prefix"  # starts at key 0
    expected = naive_attention(step, q.cpu(), keys, values, 0.25, sliding_window=window)
    got = paged_attention_triton(q, kc, vc, step.meta, 0.25, window, block_m=16, block_n=16)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double().cpu(), expected, atol=2e-5, rtol=2e-5)
    # The torch reference masks (it reads whole blocks, so they must hold finite values).
    ref = reference.paged_attention(
        q.cpu(), kc.cpu().nan_to_num(7.0), vc.cpu().nan_to_num(7.0), _on_cpu(step.meta), 0.25,
        window,
    )  # fmt: skip
    torch.testing.assert_close(ref.double(), expected, atol=2e-5, rtol=2e-5)
    if step.meta.num_decode_tokens:
        split = paged_attention_triton(
            q, kc, vc, step.meta, 0.25, window, block_m=16, block_n=16, num_splits=3
        )
        nd = step.meta.num_decode_tokens
        torch.testing.assert_close(split[:nd].double().cpu(), expected[:nd], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", ["decode_only", "single_prefill_no_prefix", "mixed"])
@pytest.mark.parametrize("window", [None, 7])
def test_paged_attention_sinks(triton_device: str, case: str, window: int | None) -> None:
    """gpt-oss's attention sinks in the decode, split-KV decode and prefill kernels:
    equal to the torch reference and to the float64 oracle (GQA, several K/V tiles, with
    and without a window); without the sinks the output is far from it."""
    from kernels.triton.paged_attention import paged_attention_triton

    step, q, kc, vc, keys, values = _case(case, 6, 2, 16, 4, torch.float32, triton_device)
    sinks = (3.0 * torch.randn(6, generator=torch.Generator().manual_seed(4))).to(triton_device)
    expected = naive_attention(step, q.cpu(), keys, values, 0.25, window, sinks.cpu())
    got = paged_attention_triton(q, kc, vc, step.meta, 0.25, window, sinks, block_m=16, block_n=16)
    torch.testing.assert_close(got.double().cpu(), expected, atol=2e-5, rtol=2e-5)
    ref = reference.paged_attention(
        q.cpu(), kc.cpu(), vc.cpu(), _on_cpu(step.meta), 0.25, window, sinks.cpu()
    )
    torch.testing.assert_close(got.cpu(), ref, atol=2e-5, rtol=2e-5)
    plain = paged_attention_triton(q, kc, vc, step.meta, 0.25, window, block_m=16, block_n=16)
    assert (got - plain).abs().max() > 1e-2
    if step.meta.num_decode_tokens:
        nd = step.meta.num_decode_tokens
        split = paged_attention_triton(
            q, kc, vc, step.meta, 0.25, window, sinks, block_m=16, block_n=16, num_splits=3
        )
        torch.testing.assert_close(split[:nd].double().cpu(), expected[:nd], atol=2e-5, rtol=2e-5)


def test_empty_step_and_padding_only_slots(triton_device: str) -> None:
    from kernels.triton.kv_cache import write_kv_cache_triton
    from kernels.triton.paged_attention import paged_attention_triton

    step = make_step([], 4, 4)
    kc = torch.zeros(4, 4, 1, 16, device=triton_device)
    q = torch.randn(0, 2, 16, device=triton_device)
    assert paged_attention_triton(q, kc, kc, step.meta, 0.25).shape == (0, 2, 16)
    key = torch.randn(3, 1, 16, device=triton_device)
    write_kv_cache_triton(key, key, kc, kc, torch.full((3,), -1, device=triton_device))
    assert not kc.any()


# ------------------------------------------------------------------------- public API


def test_public_api_routes_to_triton(force_triton: str) -> None:
    """``HEARTH_KERNELS=triton``: one layer's worth of calls through ``kernels.*``."""
    dev = force_triton
    torch.manual_seed(5)
    step, q, kc, vc, _, _ = _case("mixed", 6, 2, 32, 16, torch.float32, dev)
    assert kernels.kernel_backend(q) == "triton"
    x = torch.randn(q.shape[0], 48, device=dev)
    w = torch.rand(48, device=dev)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    a, b = kernels.fused_add_rms_norm(x, x, w, 1e-6)
    ra, rb = reference.fused_add_rms_norm(x, x, w, 1e-6)
    torch.testing.assert_close(a, ra)
    assert torch.equal(b, rb)
    g = torch.randn(3, 64, device=dev)
    torch.testing.assert_close(kernels.silu_and_mul(g), reference.silu_and_mul(g))
    cache = kernels.build_cos_sin_cache(32, 64, 10000.0, torch.float32, dev)
    k = torch.randn(q.shape[0], 2, 32, device=dev)
    qr, kr = kernels.rotary_embedding(step.positions.to(dev), q, k, cache)
    qe, ke = reference.rotary_embedding(step.positions.to(dev), q, k, cache)
    torch.testing.assert_close(qr, qe)
    torch.testing.assert_close(kr, ke)
    kc2, vc2 = kc.clone(), vc.clone()
    kernels.write_kv_cache(kr, kr, kc, vc, step.meta.slot_mapping)
    reference.write_kv_cache(kr, kr, kc2, vc2, step.meta.slot_mapping)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    torch.testing.assert_close(
        kernels.paged_attention(q, kc, vc, step.meta, 0.2),
        reference.paged_attention(q, kc, vc, step.meta, 0.2),
        atol=2e-5,
        rtol=2e-5,
    )
