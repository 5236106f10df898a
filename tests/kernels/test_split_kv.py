"""Split-KV (flash-decoding) decode against the torch reference and the float64 oracle.

The interpreter tests force a split count on tiny shapes (the CPU has no multiprocessors
to fill); the ``gpu`` test takes the automatic choice on long contexts, at model shapes.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton.paged_attention import (
    MAX_SPLITS,
    SPLIT_MIN_SEQ_LEN,
    decode_num_splits,
)
from tests.kernels.cases import make_step, naive_attention, scatter_dense_kv

TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


def _run(
    seq_lens: list[int],
    nh: int,
    nkv: int,
    hd: int,
    bs: int,
    dtype: torch.dtype,
    device: str,
    num_splits: int | None,
    seed: int,
) -> None:
    from kernels.triton.paged_attention import paged_attention_triton

    gen = torch.Generator().manual_seed(seed)
    seqs = [(s, 1) for s in seq_lens]
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 4
    step = make_step(seqs, bs, num_blocks, generator=gen, device=device, table_pad=2)
    kc = torch.randn(num_blocks, bs, nkv, hd, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, bs, nkv, hd, generator=gen).to(dtype)
    keys = [torch.randn(s, nkv, hd, generator=gen).to(dtype) for s in seq_lens]
    values = [torch.randn(s, nkv, hd, generator=gen).to(dtype) for s in seq_lens]
    scatter_dense_kv(step, keys, values, kc, vc)
    kc, vc = kc.to(device), vc.to(device)
    q = torch.randn(len(seq_lens), nh, hd, generator=gen).to(dtype).to(device)
    got = paged_attention_triton(q, kc, vc, step.meta, hd**-0.5, num_splits=num_splits)
    expected = reference.paged_attention(q, kc, vc, step.meta, hd**-0.5)
    torch.testing.assert_close(got, expected, **TOL[dtype])
    if dtype == torch.float32:
        oracle = naive_attention(step, q.cpu(), keys, values, hd**-0.5)
        torch.testing.assert_close(got.double().cpu(), oracle, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 32])
def test_split_kv_decode_matches_reference(triton_device: str, dtype: torch.dtype, bs: int) -> None:
    # GQA 4:2, contexts shorter than, equal to and longer than the slices; 3 splits so
    # some slices of the short sequences are empty and must drop out of the merge.
    _run([1, 5, 40, 97], 4, 2, 16, bs, dtype, triton_device, num_splits=3, seed=bs)


def test_split_kv_one_split_per_key(triton_device: str) -> None:
    # More splits than 16-key tiles: most slices are empty, the merge still exact.
    _run([33, 2], 2, 1, 16, 16, torch.float32, triton_device, num_splits=7, seed=5)


def test_decode_num_splits_policy() -> None:
    # Short contexts, or a batch that already fills the GPU: no split.
    assert decode_num_splits(1, 8, SPLIT_MIN_SEQ_LEN - 1, 132) == 1
    assert decode_num_splits(64, 8, 8192, 132) == 1
    # One long sequence, 8 kv heads on 132 SMs: about two waves, capped.
    assert decode_num_splits(1, 8, 8192, 132) == MAX_SPLITS
    assert decode_num_splits(4, 8, 8192, 132) == 9  # ceil(264 / 32)
    # Never slices shorter than 256 keys on average.
    assert decode_num_splits(1, 8, 1024, 132) == 4
    assert decode_num_splits(0, 8, 8192, 132) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 32])
def test_split_kv_long_context_gpu(triton_device: str, dtype: torch.dtype, bs: int) -> None:
    if triton_device != "cuda":
        pytest.skip("TRITON_INTERPRET=1 is set: this test needs the compiled kernels")
    n = decode_num_splits(3, 8, 8000, torch.cuda.get_device_properties(0).multi_processor_count)
    assert n > 1, "these shapes must take the split-KV path"
    # Llama-3.2-1B attention: 32 heads on 8 kv heads, head_dim 64; auto split count.
    _run([8000, 3001, 1200], 32, 8, 64, bs, dtype, "cuda", num_splits=None, seed=7)
