"""The C kernels of the CPU fast path against independent oracles.

Quantized GEMMs are checked against gguf-py's own dequantizer followed by a float64
matmul: the kernel rebuilds each weight exactly as gguf-py does, so the only difference
allowed is float32 accumulation error, bounded by ``K * eps * sum|x_k w_k|``. Attention is
checked against the float64 dense oracle of ``tests.kernels.cases``. Batch invariance (a token's
result never depends on what else is in the call) is checked bit for bit.

A float16 KV cache is checked the same way against the oracle computed from the
float16-rounded K/V (so the bound is the float32 accumulation bound, not fp16's rounding),
bit for bit against the float32 path on the same values, and for batch invariance; int8
caches (and float16 keys with int8 values) against the oracle of the values their rows
stand for, and their writes bit for bit against `kernels.reference.quantize_kv_int8`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kernels import reference
from kernels.cpu import ops
from kernels.cpu.build import host_isa
from tests.kernels.cases import (
    as_kv_cache,
    cpu_attention_tables,
    held_by_kv_cache,
    make_step,
    naive_attention,
    scatter_dense_kv,
)

pytestmark = pytest.mark.skipif(not ops.available(), reason="host has no AVX2 (torch path only)")

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

KINDS = {
    "q4_1": GGMLQuantizationType.Q4_1,
    "q8_0": GGMLQuantizationType.Q8_0,
    "f16": GGMLQuantizationType.F16,
    "bf16": GGMLQuantizationType.BF16,
}
"""The packed kinds: GGUF blocks, and 16-bit weights (a checkpoint's own, or a GGUF's F16 /
BF16 tensors), each against gguf-py's own conversion of the same values."""
EPS32 = float(np.finfo(np.float32).eps)
# Every kernel build this host runs: each has its own single-token GEMM tiles (the AVX2
# build's 8-lane multi-group tiles, the AVX-512 builds' 16-lane GEMV), so each is checked.
VARIANTS = host_isa().supported


def _quantized(kind: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    raw = gguf_quants.quantize(w, KINDS[kind]).view(np.uint8)  # [n, k/32 * block bytes]
    dequant = torch.from_numpy(gguf_quants.dequantize(raw, KINDS[kind]).astype(np.float32))
    return raw, dequant


def _assert_within_accumulation_bound(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    bound = x.shape[1] * EPS32 * (x.double().abs() @ w.double().abs().T) + 1e-30
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("tokens", [1, 3, 8, 13, 37])
def test_quantized_gemm_equals_dequantized_weights(kind: str, tokens: int, variant: str) -> None:
    n, k = 48, 96
    raw, dequant = _quantized(kind, n, k, seed=tokens)
    packed = ops.pack(kind, raw)
    x = torch.randn(tokens, k)
    _assert_within_accumulation_bound(ops.linear(x, packed, variant=variant), x, dequant)


def test_quantized_gemm_bias_and_strided_rows() -> None:
    raw, dequant = _quantized("q4_1", 16, 64, seed=3)
    bias = torch.randn(16)
    packed = ops.pack("q4_1", raw, bias)
    wide = torch.randn(5, 100)
    x = wide[:, 10:74]  # rows with a stride of 100
    _assert_within_accumulation_bound(ops.linear(x, packed), x.contiguous(), dequant, bias)


_GEMM_UNDER_A_MEMORY_LIMIT = """
import resource, numpy as np, torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from kernels.cpu import ops
torch.set_num_threads(2)
raw = quantize(np.full((8, 32768), 0.01, np.float32), GGMLQuantizationType.Q4_1).view(np.uint8)
weight = ops.pack("q4_1", raw)
ops.linear(torch.ones(4, 32768), weight)  # the thread team exists
x = torch.empty(16384, 32768)  # never touched: its block sums need 64 MiB
out = torch.full((16384, 8), -7.0)
with open("/proc/self/status") as f:
    size = next(int(l.split()[1]) for l in f if l.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (16 << 20), resource.RLIM_INFINITY))
ops.linear(x, weight, out)
print("answered: out[0, 0] =", float(out[0, 0]))
"""


def test_a_gemm_that_cannot_allocate_stops_the_process_not_the_output() -> None:
    """A Q4_1 GEMM whose per-token block sums cannot be allocated stops its process with a
    message (the server restarts its engine); it once returned with the output untouched,
    so a step went on with whatever the buffer held. Run in a child whose address space is
    capped just above what it holds before the call."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _GEMM_UNDER_A_MEMORY_LIMIT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0, done.stdout
    assert "hearth kernels: out of memory" in done.stderr, done.stderr[-2000:]
    assert "the GEMM's block sums" in done.stderr


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", [64, 40, 56, 120])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_quantized_gemm_is_batch_invariant(kind: str, n: int, variant: str) -> None:
    """Every token's output is bitwise the same alone and in batches of 6, 9, 16 and 40.
    A single token runs tiles of four 8-row groups (Q4_1 and 16-bit; eight in the AVX-512
    builds' 16-lane Q4_1 GEMV), a batch tiles of two (Q4_1, 16-bit) or one (Q8_0) groups by near-equal token counts (6:
    3 + 3, 9: 5 + 4, 16: 4 x 4, 40: 8 x 5): 40 and 56 rows leave a last tile of one and of
    three groups, 120 a full 16-lane tile and a short one of three pairs and a group."""
    raw, _ = _quantized(kind, n, 128, seed=7)
    packed = ops.pack(kind, raw)
    x = torch.randn(40, 128)
    alone = torch.cat([ops.linear(x[i : i + 1], packed, variant=variant) for i in range(40)])
    for size in (6, 9, 16, 40):
        assert torch.equal(ops.linear(x[:size], packed, variant=variant), alone[:size]), size


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("n", [8, 24, 40, 56])
def test_quantized_gemm_odd_group_count(kind: str, n: int, variant: str) -> None:
    """An odd number of 8-row groups: Q4_1 tiles pair groups, so the last one is alone
    (every row checked against the oracle, nothing written past n)."""
    raw, dequant = _quantized(kind, n, 64, seed=n)
    bias = torch.randn(n)
    packed = ops.pack(kind, raw, bias)
    for tokens in (1, 7):
        x = torch.randn(tokens, 64)
        big = torch.full((tokens, n + 8), float("nan"))
        ops.linear(x, packed, out=big[:, :n], variant=variant)
        _assert_within_accumulation_bound(big[:, :n], x, dequant, bias)
        assert bool(big[:, n:].isnan().all())


def test_pack_refuses_bad_shapes() -> None:
    raw, _ = _quantized("q4_1", 12, 64, seed=1)  # 12 rows: not a multiple of 8
    with pytest.raises(ValueError, match="rows"):
        ops.pack("q4_1", raw)
    with pytest.raises(ValueError, match="unsupported"):
        ops.pack("q5_0", raw)


@pytest.mark.parametrize(("kind", "size", "scales"), [("q4_1", 20, 2), ("q8_0", 34, 1)])
def test_packing_lays_blocks_out_as_the_kernels_read_them(
    kind: str, size: int, scales: int
) -> None:
    """The packed layout of hearth_cpu.c, byte by byte: per group of 8 rows and 32-column
    block, the 8 rows' float16 scales (Q4_1: then their mins), then byte j of every row's
    quants side by side (`8 j + r`)."""
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (24, 3 * size), dtype=np.uint8)
    data = ops.pack(kind, raw).data.numpy().reshape(3, 3, -1)  # [group, block, bytes]
    blocks = raw.reshape(3, 8, 3, size).transpose(0, 2, 1, 3)  # [group, block, row, bytes]
    heads = 2 * scales
    for i in range(scales):
        want = blocks[..., 2 * i : 2 * i + 2].reshape(3, 3, 16)
        assert np.array_equal(data[..., 16 * i : 16 * i + 16], want)
    quants = blocks[..., heads:].transpose(0, 1, 3, 2).reshape(3, 3, -1)  # [.., byte j, row]
    assert np.array_equal(data[..., 8 * heads :], quants)


def test_head_rms_norm_is_rms_norm_of_each_head_bitwise() -> None:
    """Qwen3's q / k norms: each head of a strided column range (q or k inside the qkv
    output) normalised as `rms_norm` normalises that head's values copied into a row."""
    gen = torch.Generator().manual_seed(7)
    t, heads, hd = 5, 3, 32
    qkv = torch.randn(t, heads * hd + 40, generator=gen)
    x = qkv[:, 8 : 8 + heads * hd]  # strided rows
    weight = torch.rand(hd, generator=gen) + 0.5
    got = ops.head_rms_norm(x, weight, 1e-6, heads)
    want = ops.rms_norm(x.reshape(-1, hd).contiguous(), weight, 1e-6).view(t, -1)
    assert got.shape == (t, heads * hd) and torch.equal(got, want)
    torch.testing.assert_close(got, reference.rms_norm(x.reshape(-1, hd), weight, 1e-6).view(t, -1))
    with pytest.raises(ValueError, match="need a weight"):
        ops.head_rms_norm(x, weight[:16], 1e-6, heads)


@pytest.mark.parametrize("inter", [8, 64, 13])
def test_gelu_tanh_and_mul_is_the_reference_within_float32_rounding(inter: int) -> None:
    """Gemma's GeGLU by the C kernel (gelu_tanh as g * sigmoid(2y)): the float64 function
    to a few float32 ulps (2e-6 relative), over ordinary, large and tiny gates (the vector
    and the tail loop); torch's float32 tanh form rounds to 0 far in the negative tail,
    where this keeps the tiny value, so against it the bound is absolute there."""
    gen = torch.Generator().manual_seed(9)
    gate_up = torch.randn(7, 2 * inter, generator=gen) * 3
    gate_up[0, :inter] = torch.linspace(-30, 30, inter)
    gate_up[1, :inter] = torch.linspace(-1e-4, 1e-4, inter)
    got = ops.gelu_tanh_and_mul(gate_up)
    exact = reference.gelu_tanh_and_mul(gate_up.double())
    torch.testing.assert_close(got.double(), exact, rtol=2e-6, atol=1e-12)
    torch.testing.assert_close(got, reference.gelu_tanh_and_mul(gate_up), rtol=2e-6, atol=1e-6)


def test_embedding_scales_its_rows_as_the_reference() -> None:
    """Gemma's sqrt(hidden) (a 0-d tensor of the model dtype): float32 rows times it, the
    reference's product bit for bit."""
    gen = torch.Generator().manual_seed(10)
    table = torch.randn(50, 64, generator=gen)
    ids = torch.tensor([3, 0, 49, 3])
    for scale in (torch.tensor(8.0**0.5), torch.tensor(55.4256, dtype=torch.bfloat16)):
        got = ops.embedding(ids, table, scale=scale)
        assert torch.equal(got, reference.embedding(ids, table, scale=scale))
    assert torch.equal(ops.embedding(ids, table), table[ids])


def test_rms_norm_and_add_rms_norm_match_reference() -> None:
    torch.manual_seed(0)
    x, res, w = torch.randn(6, 576) * 3, torch.randn(6, 576), torch.rand(576) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
    expected_norm, expected_res = reference.fused_add_rms_norm(x, res, w, 1e-5)
    x2, res2 = x.clone(), res.clone()
    ops.add_rms_norm_(x2, res2, w, 1e-5)
    torch.testing.assert_close(res2, expected_res, rtol=0, atol=0)
    torch.testing.assert_close(x2, expected_norm)


@pytest.mark.parametrize("inter", [1536, 20])
def test_silu_and_mul_matches_reference(inter: int) -> None:
    gu = torch.randn(4, 2 * inter) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    torch.testing.assert_close(
        ops.silu_and_mul(gu), reference.silu_and_mul(gu), rtol=2e-6, atol=1e-6
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_embedding_gathers_each_tables_rows_widened_exactly(dtype: torch.dtype) -> None:
    """A table held in 16 bits (a checkpoint's own: engine/layers/weight_storage.py) is
    gathered as float32 rows bit for bit, infinities, signed zeros and subnormals included,
    at a width the 8-lane loop covers and one with a tail."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.tensor([3, 0, 49, 3, 17])
    for width in (64, 36):
        table = torch.randn(50, width, generator=gen).to(dtype)
        table[3, :5] = torch.tensor([float("inf"), float("-inf"), -0.0, 3e-7, -6e-8]).to(dtype)
        got = ops.embedding(ids, table)
        assert got.dtype == torch.float32
        assert torch.equal(got, table[ids].float())
        assert torch.equal(torch.signbit(got), torch.signbit(table[ids].float()))
    with pytest.raises(ValueError, match="float16 or bfloat16 table"):
        ops.embedding(ids, table.double())


def test_embedding_gathers_q8_0_rows_as_gguf_py_dequantizes_them() -> None:
    """A GGUF's Q8_0 token table gathered straight from its rows (the default model's:
    engine/layers/gguf_linear.py `gather_table_from_blocks`) equals gguf-py's dequantized
    rows bit for bit; rows that are not whole blocks are refused."""
    raw, dequant = _quantized("q8_0", 40, 96, seed=5)
    ids = torch.tensor([39, 0, 7, 7, 21])
    got = ops.embedding(ids, torch.from_numpy(raw.copy()))
    assert got.shape == (5, 96) and torch.equal(got, dequant[ids])
    with pytest.raises(ValueError, match="34-byte blocks"):
        ops.embedding(ids, torch.zeros(40, 50, dtype=torch.uint8))


def test_rope_and_kv_write_match_reference() -> None:
    torch.manual_seed(1)
    nh, nkv, hd, bs, blocks = 6, 2, 64, 4, 8
    cos_sin = reference.build_cos_sin_cache(hd, 64, 10000.0, torch.float32)
    qkv = torch.randn(5, (nh + 2 * nkv) * hd)
    positions = torch.tensor([0, 3, 9, 17, 40])
    slots = torch.tensor([2, -1, 9, 30, 31])
    q = qkv[:, : nh * hd].view(5, nh, hd)
    k = qkv[:, nh * hd : (nh + nkv) * hd].view(5, nkv, hd)
    v = qkv[:, (nh + nkv) * hd :].view(5, nkv, hd).clone()
    eq, ek = reference.rotary_embedding(positions, q, k, cos_sin)
    kc_ref = torch.zeros(blocks, bs, nkv, hd)
    vc_ref = torch.zeros(blocks, bs, nkv, hd)
    reference.write_kv_cache(ek, v, kc_ref, vc_ref, slots)
    kc, vc = torch.zeros_like(kc_ref), torch.zeros_like(vc_ref)
    # In place on the fused rows' strided q/k views, as the model hands them over.
    got_q, got_k = ops.rotary_embedding(positions, q, k, cos_sin)
    assert got_q.data_ptr() == qkv.data_ptr()
    ops.write_kv_cache(got_k, qkv[:, (nh + nkv) * hd :].view(5, nkv, hd), kc, vc, slots)
    torch.testing.assert_close(qkv[:, : nh * hd].view(5, nh, hd), eq)
    torch.testing.assert_close(kc, kc_ref)
    assert torch.equal(vc, vc_ref)


def test_partial_rotary_runs_the_reference_and_refuses_capture() -> None:
    """A table narrower than the head (Phi-4-mini rotates 3/4 of it) has no C kernel: the
    torch reference computes it, and a step program is not captured around it (a replay
    would skip the torch op)."""
    from kernels.cpu import capture

    torch.manual_seed(2)
    cos_sin = reference.build_cos_sin_cache(16, 64, 10000.0, torch.float32)  # 16 of 32 dims
    q, k = torch.randn(3, 2, 32), torch.randn(3, 1, 32)
    positions = torch.tensor([0, 5, 9])
    want_q, want_k = reference.rotary_embedding(positions, q, k, cos_sin)
    got_q, got_k = ops.rotary_embedding(positions, q, k, cos_sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert not torch.equal(got_q[..., :16], q[..., :16])  # it did rotate
    recorder = capture.Recorder(3, capture.persistent_ranges([]), {})
    with pytest.raises(capture.CaptureError, match="partial rotary"), capture.recording(recorder):
        ops.rotary_embedding(positions, q, k, cos_sin)


def _attention_inputs(seqs: list[tuple[int, int]], nh: int, nkv: int, hd: int, bs: int):
    gen = torch.Generator().manual_seed(5)
    step = make_step(seqs, bs, 64, generator=gen)
    k_cache = torch.zeros(64, bs, nkv, hd)
    v_cache = torch.zeros(64, bs, nkv, hd)
    keys = [torch.randn(s, nkv, hd, generator=gen) for s, _ in seqs]
    values = [torch.randn(s, nkv, hd, generator=gen) for s, _ in seqs]
    scatter_dense_kv(step, keys, values, k_cache, v_cache)
    query = torch.randn(sum(q for _, q in seqs), nh, hd, generator=gen)
    tables, token_seq, token_ctx = cpu_attention_tables(step)
    return step, query, keys, values, k_cache, v_cache, tables, token_seq, token_ctx


@pytest.mark.parametrize(
    ("bs", "nh", "nkv", "hd"),
    [(4, 9, 3, 64), (16, 9, 3, 64), (16, 16, 1, 32), (8, 4, 4, 96)],
    ids=["gqa3-bs4", "gqa3-bs16", "mqa16-hd32", "mha-hd96"],
)
def test_paged_attention_matches_dense_oracle(bs: int, nh: int, nkv: int, hd: int) -> None:
    """Decodes, a whole prompt and a chunk; the group sizes cover one tile of several
    tokens (group 3), more query vectors than one pass holds (16 heads on one kv head),
    and tiles of many tokens (plain multi-head attention)."""
    seqs = [(1, 1), (37, 1), (70, 1), (20, 20), (45, 13)]  # decodes, a prompt, a chunk
    step, query, keys, values, kc, vc, tables, tseq, tctx = _attention_inputs(seqs, nh, nkv, hd, bs)
    scale = 1 / math.sqrt(hd)
    out = ops.paged_attention(
        query.reshape(len(tseq), -1),
        nh,
        nkv,
        hd,
        kc,
        vc,
        tables,
        tseq,
        tctx,
        int(tctx.max()),
        scale,
        ops.AttentionScratch(),
    )
    expected = naive_attention(step, query, keys, values, scale)
    torch.testing.assert_close(out.view_as(query).double(), expected, rtol=1e-5, atol=2e-6)


@pytest.fixture
def threads():
    """``threads(n)`` sets the OpenMP thread count the kernels see; restored after the test."""
    saved = torch.get_num_threads()

    def set_threads(n: int) -> None:
        torch.set_num_threads(n)
        assert ops.library().hearth_num_threads() == n

    yield set_threads
    torch.set_num_threads(saved)


F16_I8 = (torch.float16, torch.int8)
"""float16 keys with int8 values (``--kv-cache-dtype float16-int8``)."""


def _as_kv_dtype(kc: torch.Tensor, vc: torch.Tensor, dtype):
    """Caches of one dtype, or of a (keys, values) pair of them."""
    dk, dv = dtype if isinstance(dtype, tuple) else (dtype, dtype)
    return as_kv_cache(kc, dk), as_kv_cache(vc, dv)


@pytest.mark.parametrize(
    "kv_dtype",
    [torch.float32, torch.float16, torch.int8, F16_I8],
    ids=["f32", "f16", "i8", "f16-i8"],
)
@pytest.mark.parametrize(("nh", "nkv"), [(4, 2), (9, 3)], ids=["gqa2", "smollm2"])
def test_paged_attention_is_batch_invariant(
    kv_dtype: torch.dtype, nh: int, nkv: int, threads
) -> None:
    """A sequence's tokens get bitwise the same output alone and inside a larger step, in
    any tile, with one thread or two; for float32, float16 and int8 caches and float16
    keys with int8 values."""
    hd = 64
    seqs = [(30, 1), (25, 10), (50, 1)]
    _, query, _, _, kc, vc, tables, tseq, tctx = _attention_inputs(seqs, nh, nkv, hd, 16)
    kc, vc = _as_kv_dtype(kc, vc, kv_dtype)
    scratch = ops.AttentionScratch()
    q2 = query.reshape(len(tseq), -1)
    threads(2)
    full = ops.paged_attention(q2, nh, nkv, hd, kc, vc, tables, tseq, tctx, 50, 0.125, scratch)
    for n in (1, 2):
        threads(n)
        again = ops.paged_attention(q2, nh, nkv, hd, kc, vc, tables, tseq, tctx, 50, 0.125, scratch)
        assert torch.equal(again, full)
        # The prefill chunk alone, and cut where the kernel's 4-token tiles would not start.
        for rows in (slice(0, 1), slice(1, 11), slice(11, 12), slice(3, 11), slice(2, 7)):
            alone = ops.paged_attention(
                q2[rows], nh, nkv, hd, kc, vc, tables, tseq[rows], tctx[rows], 50, 0.125, scratch
            )
            assert torch.equal(alone, full[rows])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("window", [1, 6, 19, 200])
def test_paged_attention_sliding_window(kv_dtype: torch.dtype, window: int, threads) -> None:
    """A sliding window: each token sees its last `window` keys, against the float64
    oracle; whole blocks before every window of a sequence hold NaN (a freed block another
    sequence reused) and are never read; and a token's output is bitwise the same alone
    as inside the step, with one thread or two."""
    nh, nkv, hd, bs = 9, 3, 64, 4
    seqs = [(1, 1), (37, 1), (70, 1), (20, 20), (45, 13)]
    step, query, keys, values, kc, vc, tables, tseq, tctx = _attention_inputs(seqs, nh, nkv, hd, bs)
    if kv_dtype == torch.float16:
        keys = [k.half().float() for k in keys]
        values = [v.half().float() for v in values]
    kc, vc = _as_kv_dtype(kc, vc, kv_dtype)
    for table, (seq_len, q_len) in zip(step.block_tables, seqs, strict=True):
        first_seen = seq_len - q_len - window + 1
        for i, block in enumerate(table):
            if (i + 1) * bs <= first_seen:
                kc[block] = float("nan")
                vc[block] = float("nan")
    scratch = ops.AttentionScratch()
    q2 = query.reshape(len(tseq), -1)

    def attend(rows: slice) -> torch.Tensor:
        return ops.paged_attention(
            q2[rows], nh, nkv, hd, kc, vc, tables, tseq[rows], tctx[rows], 70, 0.125, scratch,
            sliding_window=window,
        )  # fmt: skip

    threads(2)
    full = attend(slice(None))
    expected = naive_attention(step, query, keys, values, 0.125, sliding_window=window)
    torch.testing.assert_close(full.view_as(query).double(), expected, rtol=1e-5, atol=2e-6)
    for n in (1, 2):
        threads(n)
        assert torch.equal(attend(slice(None)), full)
        for rows in (slice(2, 3), slice(3, 23), slice(5, 17), slice(23, 36), slice(30, 33)):
            assert torch.equal(attend(rows), full[rows])


# ----------------------------------------------------------------------------- float16 KV

_ATTENTION_SHAPES = pytest.mark.parametrize(
    ("bs", "nh", "nkv", "hd"),
    [(4, 9, 3, 64), (16, 9, 3, 64), (16, 16, 1, 32), (8, 4, 4, 96)],
    ids=["gqa3-bs4", "gqa3-bs16", "mqa16-hd32", "mha-hd96"],
)
_MIXED_STEP = [(1, 1), (37, 1), (70, 1), (20, 20), (45, 13)]  # decodes, a prompt, a chunk


def _attend(query, nh, nkv, hd, kc, vc, tables, tseq, tctx) -> torch.Tensor:
    q2 = query.reshape(len(tseq), -1)
    return ops.paged_attention(
        q2, nh, nkv, hd, kc, vc, tables, tseq, tctx, int(tctx.max()), 1 / math.sqrt(hd),
        ops.AttentionScratch(),
    )  # fmt: skip


@_ATTENTION_SHAPES
def test_paged_attention_f16_matches_dense_oracle(bs: int, nh: int, nkv: int, hd: int) -> None:
    """float16 caches against the float64 oracle of the float16-rounded K/V, within the
    float32 path's own bound: storing K/V in float16 is the only rounding it adds."""
    step, query, keys, values, kc, vc, tables, tseq, tctx = _attention_inputs(
        _MIXED_STEP, nh, nkv, hd, bs
    )
    kc16, vc16 = _as_kv_dtype(kc, vc, torch.float16)
    out = _attend(query, nh, nkv, hd, kc16, vc16, tables, tseq, tctx)
    assert out.dtype == torch.float32
    keys16 = [k.half().float() for k in keys]
    values16 = [v.half().float() for v in values]
    expected = naive_attention(step, query, keys16, values16, 1 / math.sqrt(hd))
    torch.testing.assert_close(out.view_as(query).double(), expected, rtol=1e-5, atol=2e-6)


@_ATTENTION_SHAPES
def test_paged_attention_f16_is_the_f32_path_on_the_same_values(
    bs: int, nh: int, nkv: int, hd: int, threads
) -> None:
    """A float16 cache gives bitwise what a float32 cache holding the same (float16-exact)
    values gives: only the loads differ, the arithmetic is the float32 path's."""
    _, query, _, _, kc, vc, tables, tseq, tctx = _attention_inputs(_MIXED_STEP, nh, nkv, hd, bs)
    kc16, vc16 = _as_kv_dtype(kc, vc, torch.float16)
    for n in (1, 2):
        threads(n)
        got = _attend(query, nh, nkv, hd, kc16, vc16, tables, tseq, tctx)
        same = _attend(query, nh, nkv, hd, kc16.float(), vc16.float(), tables, tseq, tctx)
        assert torch.equal(got, same)


def _fused_kv(t: int, nh: int, nkv: int, hd: int, gen: torch.Generator, scale: float = 1.0):
    """k and v as strided [T, nkv, hd] views of fused qkv rows, as the model hands them over."""
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=gen) * scale
    k = qkv[:, nh * hd : (nh + nkv) * hd].view(t, nkv, hd)
    v = qkv[:, (nh + nkv) * hd :].view(t, nkv, hd)
    return qkv, k, v


_SENTINEL = 0x7C01  # a NaN float16 bit pattern that no write produces


@pytest.mark.parametrize(("nkv", "hd"), [(3, 64), (1, 12)], ids=["smollm2", "scalar-tail"])
def test_kv_write_f16_holds_half(nkv: int, hd: int) -> None:
    """After a write, each written slot holds exactly ``k.half()`` / ``v.half()`` bit for bit
    (round to nearest even, subnormals, -0.0 included); slots < 0 and untouched slots are
    left as they were. Width 12 runs the scalar tail after one 8-wide vector."""
    gen = torch.Generator().manual_seed(11)
    nh, bs, blocks, t = 3, 4, 8, 6
    qkv, k, v = _fused_kv(t, nh, nkv, hd, gen, scale=300.0)
    special = torch.tensor(
        [0.0, -0.0, 1e-5, -3e-7, 6e-8, 2.9e-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 65504.0, -65504.0,
         65519.0, 2049.0, 1 / 3, -2.5e-3, 4097.0, 6.1e-5],
    )  # fmt: skip
    flat_k = qkv[0, nh * hd : (nh + nkv) * hd]
    flat_k[: min(len(special), nkv * hd)] = special[: nkv * hd]
    slots = torch.tensor([5, -1, 0, 31, -7, 12], dtype=torch.int64)
    kc = torch.full((blocks, bs, nkv, hd), 0.0, dtype=torch.float16)
    kc.view(torch.int16).fill_(_SENTINEL)
    vc = kc.clone()
    ops.write_kv_cache(k, v, kc, vc, slots)
    kbits, vbits = kc.view(-1, nkv, hd).view(torch.int16), vc.view(-1, nkv, hd).view(torch.int16)
    written = torch.zeros(blocks * bs, dtype=torch.bool)
    for r, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        written[slot] = True
        assert torch.equal(kbits[slot], k[r].half().view(torch.int16))
        assert torch.equal(vbits[slot], v[r].half().view(torch.int16))
    assert bool((kbits[~written] == _SENTINEL).all() and (vbits[~written] == _SENTINEL).all())


@pytest.mark.parametrize("width", [8, 12], ids=["vector", "scalar-tail"])
def test_kv_write_f16_saturates_beyond_range(width: int) -> None:
    """Out of float16's range, the write saturates to +-65504 (``.half()`` would give inf),
    +-inf too; NaN stays NaN. Values that round to 65504 anyway are ``.half()``'s."""
    big = [65519.0, 65520.0, 7e4, 1e30, math.inf, -65520.0, -1e30, -math.inf, math.nan, 3.0]
    want = [65504.0, 65504.0, 65504.0, 65504.0, 65504.0, -65504.0, -65504.0, -65504.0]
    want += [math.nan, 3.0]
    k = torch.zeros(len(big), 1, width)
    v = torch.zeros(len(big), 1, width)
    k[:, 0, width - 1] = torch.tensor(big)  # the last lane: vector (width 8) or scalar tail
    v[:, 0, 0] = torch.tensor(big)
    kc = torch.zeros(len(big), 1, 1, width, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    ops.write_kv_cache(k, v, kc, vc, torch.arange(len(big)))
    expect = torch.tensor(want, dtype=torch.float16)
    torch.testing.assert_close(kc[:, 0, 0, width - 1], expect, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vc[:, 0, 0, 0], expect, rtol=0, atol=0, equal_nan=True)
    assert bool((kc[:, 0, 0, : width - 1] == 0).all())
    # The saturated cache still attends to finite outputs (an inf key would give NaN).
    kc_all = torch.full((1, 16, 1, 32), 65504.0, dtype=torch.float16)
    kc_all[0, 3] = -65504.0
    vc_all = torch.ones_like(kc_all)
    out = ops.paged_attention(
        torch.ones(1, 32), 1, 1, 32, kc_all, vc_all, torch.zeros(1, 1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32), torch.tensor([16], dtype=torch.int32), 16, 0.125,
        ops.AttentionScratch(),
    )  # fmt: skip
    assert bool(torch.isfinite(out).all())


def test_kv_write_then_f16_attention_matches_oracle() -> None:
    """End to end as the engine runs a step: the kernel's own write into float16 caches,
    then attention over them, against the oracle of the rounded K/V."""
    gen = torch.Generator().manual_seed(3)
    nh, nkv, hd, bs = 9, 3, 64, 16
    seqs = [(40, 1), (23, 23)]
    step = make_step(seqs, bs, 16, generator=gen)
    t = len(step.positions)
    qkv, k, v = _fused_kv(t, nh, nkv, hd, gen)
    kc = torch.zeros(16, bs, nkv, hd, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    # The decode's earlier 39 keys are already cached; this step writes its new ones.
    keys = [torch.randn(40, nkv, hd, generator=gen), None]
    values = [torch.randn(40, nkv, hd, generator=gen), None]
    keys[0][39], values[0][39] = k[0], v[0]
    keys[1], values[1] = k[1:].clone(), v[1:].clone()
    scatter_dense_kv(
        step, [keys[0][:39].half(), keys[1][:0].half()], [values[0][:39].half(), values[1][:0].half()],
        kc, vc,
    )  # fmt: skip
    ops.write_kv_cache(k, v, kc, vc, step.meta.slot_mapping.to(torch.int64))
    tables = torch.zeros(2, max(len(x) for x in step.block_tables), dtype=torch.int32)
    for i, row in enumerate(step.block_tables):
        tables[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    tseq = torch.tensor([0] + [1] * 23, dtype=torch.int32)
    tctx = (step.positions + 1).to(torch.int32)
    query = qkv[:, : nh * hd].reshape(t, nh, hd)
    out = _attend(query, nh, nkv, hd, kc, vc, tables, tseq, tctx)
    expected = naive_attention(
        step, query, [x.half().float() for x in keys], [x.half().float() for x in values],
        1 / math.sqrt(hd),
    )  # fmt: skip
    torch.testing.assert_close(out.view_as(query).double(), expected, rtol=1e-5, atol=2e-6)


# ----------------------------------------------------------------------------- int8 KV


@_ATTENTION_SHAPES
@pytest.mark.parametrize("kv_dtype", [torch.int8, F16_I8], ids=["i8", "f16-i8"])
def test_paged_attention_i8_matches_dense_oracle(
    bs: int, nh: int, nkv: int, hd: int, kv_dtype
) -> None:
    """int8 caches (rows with their scales), or int8 values under float16 keys, against the
    float64 oracle of the values they stand for (q * scale), within the float32 path's
    bound: the scale folded into the scores and weights is the only change to the float
    arithmetic."""
    step, query, keys, values, kc, vc, tables, tseq, tctx = _attention_inputs(
        _MIXED_STEP, nh, nkv, hd, bs
    )
    dk, dv = kv_dtype if isinstance(kv_dtype, tuple) else (kv_dtype, kv_dtype)
    kc8, vc8 = _as_kv_dtype(kc, vc, kv_dtype)
    assert vc8.shape[-1] == hd + 4 and kc8.shape[-1] == (hd + 4 if dk == torch.int8 else hd)
    out = _attend(query, nh, nkv, hd, kc8, vc8, tables, tseq, tctx)
    held_k, held_v = (
        [held_by_kv_cache(x, dk) for x in keys],
        [held_by_kv_cache(x, dv) for x in values],
    )
    expected = naive_attention(step, query, held_k, held_v, 1 / math.sqrt(hd))
    torch.testing.assert_close(out.view_as(query).double(), expected, rtol=1e-5, atol=2e-6)
    # and what the quantization costs against the unrounded K/V: small, not zero
    exact = naive_attention(step, query, keys, values, 1 / math.sqrt(hd))
    err = (out.view_as(query).double() - exact).abs().max().item()
    assert 1e-6 < err < 0.05


@pytest.mark.parametrize(("nkv", "hd"), [(3, 64), (2, 32)], ids=["smollm2", "hd32"])
def test_kv_write_i8_is_the_reference_quantization(nkv: int, hd: int) -> None:
    """After a write, each written slot holds bit for bit `reference.quantize_kv_int8` of its
    rows (round to nearest even, per-row scale after the values; a zero row has scale 0,
    values past float16's range are clamped first); slots < 0 and untouched slots are left
    as they were."""
    gen = torch.Generator().manual_seed(12)
    nh, bs, blocks, t = 3, 4, 8, 6
    _, k, v = _fused_kv(t, nh, nkv, hd, gen, scale=30.0)
    k[2, 0] = 0.0  # a zero row
    k[3, 0, 5] = 1e9  # clamped to 65504
    v[4, nkv - 1, :8] = torch.tensor([0.5, -0.5, 1.5, 2.5, -127.0, 127.0, 63.5, 0.0])  # ties
    v[4, nkv - 1, 8:] = 0.0
    slots = torch.tensor([5, -1, 0, 31, 12, 7], dtype=torch.int64)
    kc = torch.full((blocks, bs, nkv, hd + 4), 77, dtype=torch.int8)
    vc = kc.clone()
    ops.write_kv_cache(k, v, kc, vc, slots)
    rows_k, rows_v = kc.view(-1, nkv, hd + 4), vc.view(-1, nkv, hd + 4)
    written = torch.zeros(blocks * bs, dtype=torch.bool)
    for r, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        written[slot] = True
        assert torch.equal(rows_k[slot], reference.quantize_kv_int8(k[r]))
        assert torch.equal(rows_v[slot], reference.quantize_kv_int8(v[r]))
    assert bool((rows_k[~written] == 77).all() and (rows_v[~written] == 77).all())
    deq_k = reference.dequantize_kv_int8(rows_k)
    assert bool((deq_k[0, 0] == 0).all())  # row 2's slot 0
    assert deq_k[31, 0, 5].item() == pytest.approx(65504.0)  # row 3's
    # the ties of v[4]'s last head (scale 1): nearest-even
    tie_row = reference.dequantize_kv_int8(rows_v[12])[nkv - 1, :8]
    assert tie_row.tolist() == [0.0, -0.0, 2.0, 2.0, -127.0, 127.0, 64.0, 0.0]
    rel = (reference.dequantize_kv_int8(rows_v[slots[0]]) - v[0]).abs().max() / v[0].abs().max()
    assert 0 < rel.item() <= 0.5 / 127 + 1e-6


@pytest.mark.parametrize("kv_dtype", [torch.int8, F16_I8], ids=["i8", "f16-i8"])
def test_kv_write_then_i8_attention_matches_oracle(kv_dtype) -> None:
    """End to end as the engine runs a step: the kernel's own writes into int8 caches (or
    float16 keys and int8 values), then attention over them, a prefill chunk of 40 and one
    of 23, against the oracle of the values the caches hold."""
    gen = torch.Generator().manual_seed(4)
    nh, nkv, hd, bs = 9, 3, 64, 16
    step = make_step([(40, 40), (23, 23)], bs, 16, generator=gen)
    t = len(step.positions)
    qkv, k, v = _fused_kv(t, nh, nkv, hd, gen)
    dk, dv = kv_dtype if isinstance(kv_dtype, tuple) else (kv_dtype, kv_dtype)
    kc, vc = _as_kv_dtype(torch.zeros(16, bs, nkv, hd), torch.zeros(16, bs, nkv, hd), kv_dtype)
    ops.write_kv_cache(k, v, kc, vc, step.meta.slot_mapping.to(torch.int64))
    if dk == torch.float16:
        slots = step.meta.slot_mapping.to(torch.int64)
        assert torch.equal(kc.view(-1, nkv, hd)[slots], k.half())
    tables = torch.zeros(2, max(len(x) for x in step.block_tables), dtype=torch.int32)
    for i, row in enumerate(step.block_tables):
        tables[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    tseq = torch.tensor([0] * 40 + [1] * 23, dtype=torch.int32)
    tctx = (step.positions + 1).to(torch.int32)
    query = qkv[:, : nh * hd].reshape(t, nh, hd)
    out = _attend(query, nh, nkv, hd, kc, vc, tables, tseq, tctx)
    keys, values = (
        [held_by_kv_cache(k[:40], dk), held_by_kv_cache(k[40:], dk)],
        [held_by_kv_cache(v[:40], dv), held_by_kv_cache(v[40:], dv)],
    )
    expected = naive_attention(step, query, keys, values, 1 / math.sqrt(hd))
    torch.testing.assert_close(out.view_as(query).double(), expected, rtol=1e-5, atol=2e-6)


def test_kv_cache_dtypes_refused() -> None:
    k = torch.randn(2, 1, 32)
    slots = torch.tensor([0, 1])
    f16 = torch.zeros(1, 2, 1, 32, dtype=torch.float16)
    i8 = torch.zeros(1, 2, 1, 32, dtype=torch.int8)  # no room for the rows' scales
    for kc, vc, why in (
        (f16, torch.zeros(1, 2, 1, 32), "both int8, or float16 keys"),  # mixed
        (f16.bfloat16(), f16.bfloat16(), "both int8, or float16 keys"),  # not a kind read
        (i8, i8, "rows of 36 elements"),
    ):
        with pytest.raises(ValueError, match=why):
            ops.write_kv_cache(k, k, kc, vc, slots)
        with pytest.raises(ValueError, match=why):
            ops.paged_attention(
                k[:1, 0], 1, 1, 32, kc, vc, torch.zeros(1, 1, dtype=torch.int32),
                torch.zeros(1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32), 2, 1.0,
                ops.AttentionScratch(),
            )  # fmt: skip


def test_attention_scratch_covers_every_thread_of_the_calling_team() -> None:
    """The scratch grows for the OpenMP team of whichever Python thread calls: the engine
    loop's thread may run more OpenMP threads than the thread that sized it first (an
    overflow here corrupted the heap in the structured-output tests)."""
    import threading

    scratch = ops.AttentionScratch()
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scratch.get(1000)
        small = scratch.per_thread
        scratch.get(10)  # a shorter context keeps the grown rows
        assert scratch.per_thread == small
        seen: dict[str, int] = {}

        def other_thread() -> None:  # a fresh thread: OpenMP's default team size
            buf = scratch.get(10)
            seen["threads"] = ops.library().hearth_num_threads()
            seen["floats"] = buf.numel()

        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert seen["floats"] >= scratch.per_thread * seen["threads"]
    finally:
        torch.set_num_threads(saved)
