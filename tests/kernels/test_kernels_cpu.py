"""The C kernels of the CPU fast path against independent oracles.

Quantized GEMMs are checked against gguf-py's own dequantizer followed by a float64
matmul: the kernel rebuilds each weight exactly as gguf-py does, so the only difference
allowed is float32 accumulation error, bounded by ``K * eps * sum|x_k w_k|``. Attention is
checked against the float64 dense oracle of ``tests.kernels.cases``. Batch invariance (a token's
result never depends on what else is in the call) is checked bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kernels import reference
from kernels.cpu import ops
from tests.kernels.cases import make_step, naive_attention, scatter_dense_kv

pytestmark = pytest.mark.skipif(not ops.available(), reason="host has no AVX2 (torch path only)")

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

KINDS = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
EPS32 = float(np.finfo(np.float32).eps)


def _quantized(kind: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    raw = gguf_quants.quantize(w, KINDS[kind])  # [n, k/32 * block bytes] uint8
    dequant = torch.from_numpy(gguf_quants.dequantize(raw, KINDS[kind]).astype(np.float32))
    return raw, dequant


def _assert_within_accumulation_bound(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    bound = x.shape[1] * EPS32 * (x.double().abs() @ w.double().abs().T) + 1e-30
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("tokens", [1, 3, 8, 13, 37])
def test_quantized_gemm_equals_dequantized_weights(kind: str, tokens: int) -> None:
    n, k = 48, 96
    raw, dequant = _quantized(kind, n, k, seed=tokens)
    packed = ops.pack(kind, raw)
    x = torch.randn(tokens, k)
    _assert_within_accumulation_bound(ops.linear(x, packed), x, dequant)


def test_quantized_gemm_bias_and_strided_rows() -> None:
    raw, dequant = _quantized("q4_1", 16, 64, seed=3)
    bias = torch.randn(16)
    packed = ops.pack("q4_1", raw, bias)
    wide = torch.randn(5, 100)
    x = wide[:, 10:74]  # rows with a stride of 100
    _assert_within_accumulation_bound(ops.linear(x, packed), x.contiguous(), dequant, bias)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_quantized_gemm_is_batch_invariant(kind: str) -> None:
    """Token i's output is bitwise the same alone, in a batch of 9 and in a batch of 40."""
    raw, _ = _quantized(kind, 64, 128, seed=7)
    packed = ops.pack(kind, raw)
    x = torch.randn(40, 128)
    batch = ops.linear(x, packed)
    for i in (0, 5, 8, 39):
        assert torch.equal(ops.linear(x[i : i + 1], packed)[0], batch[i])
        assert torch.equal(ops.linear(x[:9], packed)[min(i, 8)], batch[min(i, 8)])


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("n", [8, 24, 40, 56])
def test_quantized_gemm_odd_group_count(kind: str, n: int) -> None:
    """An odd number of 8-row groups: Q4_1 tiles pair groups, so the last one is alone
    (every row checked against the oracle, nothing written past n)."""
    raw, dequant = _quantized(kind, n, 64, seed=n)
    bias = torch.randn(n)
    packed = ops.pack(kind, raw, bias)
    for tokens in (1, 7):
        x = torch.randn(tokens, 64)
        big = torch.full((tokens, n + 8), float("nan"))
        ops.linear(x, packed, out=big[:, :n])
        _assert_within_accumulation_bound(big[:, :n], x, dequant, bias)
        assert bool(big[:, n:].isnan().all())


def test_pack_refuses_bad_shapes() -> None:
    raw, _ = _quantized("q4_1", 12, 64, seed=1)  # 12 rows: not a multiple of 8
    with pytest.raises(ValueError, match="rows"):
        ops.pack("q4_1", raw)
    with pytest.raises(ValueError, match="unsupported"):
        ops.pack("q5_0", raw)


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


def _attention_inputs(seqs: list[tuple[int, int]], nh: int, nkv: int, hd: int, bs: int):
    gen = torch.Generator().manual_seed(5)
    step = make_step(seqs, bs, 64, generator=gen)
    k_cache = torch.zeros(64, bs, nkv, hd)
    v_cache = torch.zeros(64, bs, nkv, hd)
    keys = [torch.randn(s, nkv, hd, generator=gen) for s, _ in seqs]
    values = [torch.randn(s, nkv, hd, generator=gen) for s, _ in seqs]
    scatter_dense_kv(step, keys, values, k_cache, v_cache)
    query = torch.randn(sum(q for _, q in seqs), nh, hd, generator=gen)
    width = max(len(t) for t in step.block_tables)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, t in enumerate(step.block_tables):
        tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    token_seq = torch.tensor(
        [i for i, (_, q) in enumerate(seqs) for _ in range(q)], dtype=torch.int32
    )
    token_ctx = (step.positions + 1).to(torch.int32)
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


def test_paged_attention_is_batch_invariant() -> None:
    """A sequence's tokens get bitwise the same output alone and inside a larger step."""
    nh, nkv, hd = 4, 2, 64
    seqs = [(30, 1), (25, 10), (50, 1)]
    _, query, _, _, kc, vc, tables, tseq, tctx = _attention_inputs(seqs, nh, nkv, hd, 16)
    scratch = ops.AttentionScratch()
    q2 = query.reshape(len(tseq), -1)
    full = ops.paged_attention(q2, nh, nkv, hd, kc, vc, tables, tseq, tctx, 50, 0.125, scratch)
    # The prefill chunk alone, and cut where the kernel's 4-token tiles would not start.
    for rows in (slice(0, 1), slice(1, 11), slice(11, 12), slice(3, 11), slice(2, 7)):
        alone = ops.paged_attention(
            q2[rows], nh, nkv, hd, kc, vc, tables, tseq[rows], tctx[rows], 50, 0.125, scratch
        )
        assert torch.equal(alone, full[rows])
