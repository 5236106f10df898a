"""Compiled Triton kernels on CUDA against the torch reference, at model-like shapes.

Marked ``gpu`` and skipped without CUDA. Unlike the interpreter tests these exercise the
real compiler paths: bf16 ``tl.dot`` on tensor cores, fp32 ``ieee`` dots, RTNE casts, and
the production tile sizes.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.cases import make_step, naive_attention, scatter_dense_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.bfloat16]
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


@pytest.fixture(autouse=True)
def _compiled(triton_device: str) -> None:
    if triton_device != "cuda":
        pytest.skip("TRITON_INTERPRET=1 is set: these tests need the compiled kernels")


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_gpu(dtype: torch.dtype) -> None:
    from kernels.triton.rms_norm import fused_add_rms_norm_triton, rms_norm_triton

    torch.manual_seed(0)
    x = torch.randn(300, 576, device="cuda").to(dtype)
    r = torch.randn(300, 576, device="cuda").to(dtype)
    w = (torch.rand(576, device="cuda") + 0.5).to(dtype)
    torch.testing.assert_close(
        rms_norm_triton(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), **TOL[dtype]
    )
    a, b = fused_add_rms_norm_triton(x, r, w, 1e-5)
    ra, rb = reference.fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(b, rb)  # RTNE on the GPU: the rounded sum is bitwise
    torch.testing.assert_close(a, ra, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_silu_gpu(dtype: torch.dtype) -> None:
    from kernels.triton.activation import silu_and_mul_triton
    from kernels.triton.rotary import rotary_embedding_triton

    torch.manual_seed(1)
    t = 257
    qkv = torch.randn(t, 15 * 64, device="cuda").to(dtype)
    q = qkv[:, : 9 * 64].view(t, 9, 64)
    k = qkv[:, 9 * 64 : 12 * 64].view(t, 3, 64)
    pos = torch.randint(0, 8192, (t,), device="cuda")
    cache = reference.build_cos_sin_cache(64, 8192, 100000.0, dtype, "cuda")
    q1, k1 = rotary_embedding_triton(pos, q, k, cache)
    q2, k2 = reference.rotary_embedding(pos, q, k, cache)
    torch.testing.assert_close(q1, q2, **TOL[dtype])
    torch.testing.assert_close(k1, k2, **TOL[dtype])
    x = torch.randn(t, 2 * 1536, device="cuda").to(dtype)
    torch.testing.assert_close(silu_and_mul_triton(x), reference.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_gpu(dtype: torch.dtype) -> None:
    from kernels.triton.kv_cache import write_kv_cache_triton

    k = torch.randn(100, 3, 64, device="cuda").to(dtype)
    slots = torch.randperm(64 * 16, device="cuda")[:100]
    slots[::7] = -1
    caches = [torch.zeros(64, 16, 3, 64, device="cuda", dtype=dtype) for _ in range(4)]
    write_kv_cache_triton(k, k, caches[0], caches[1], slots)
    reference.write_kv_cache(k, k, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seqs",
    [
        [(s, 1) for s in (1, 17, 255, 256, 257, 1000, 33, 2048)],
        [(512, 512)],
        [(700, 300), (129, 129), (64, 1 + 1)],
        [(s, 1) for s in (40, 300, 1025)] + [(600, 600), (900, 77), (31, 31)],
    ],
    ids=["decodes", "prefill", "chunked", "mixed"],
)
def test_paged_attention_gpu(dtype: torch.dtype, seqs: list[tuple[int, int]]) -> None:
    from kernels.triton.paged_attention import paged_attention_triton

    gen = torch.Generator().manual_seed(2)
    bs, nh, nkv, hd = 16, 9, 3, 64
    num_blocks = sum(-(-s // bs) for s, _ in seqs) + 8
    step = make_step(seqs, bs, num_blocks, generator=gen, device="cuda", table_pad=3)
    kc = torch.randn(num_blocks, bs, nkv, hd, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, bs, nkv, hd, generator=gen).to(dtype)
    keys = [torch.randn(s, nkv, hd, generator=gen).to(dtype) for s, _ in seqs]
    values = [torch.randn(s, nkv, hd, generator=gen).to(dtype) for s, _ in seqs]
    scatter_dense_kv(step, keys, values, kc, vc)
    kc, vc = kc.cuda(), vc.cuda()
    q = torch.randn(step.positions.shape[0], nh, hd, generator=gen).to(dtype).cuda()
    got = paged_attention_triton(q, kc, vc, step.meta, hd**-0.5)
    expected = reference.paged_attention(q, kc, vc, step.meta, hd**-0.5)
    torch.testing.assert_close(got, expected, **TOL[dtype])
    if dtype == torch.float32:
        oracle = naive_attention(step, q.cpu(), keys, values, hd**-0.5)
        torch.testing.assert_close(got.double().cpu(), oracle, atol=2e-5, rtol=2e-5)
