"""The AVX2 build's float32 prefill attention (kernels/cpu/hearth_attention_f32.c) against
the float32 loops every other row takes (hearth_cpu.c), bitwise, and against float64.

Contract: runs of at least ``f32_prefill_min_run`` consecutive positions of one sequence
take GEMM-shaped loops over the run's keys and values widened once to float32; every
score, softmax weight and output is the same float32 arithmetic in the same order as the
loops that decodes take, so a token's output does not depend on which loops ran it. The
``avx2`` build runs on every host with the fast path, so these run everywhere; the AVX-512
builds have no such loops (their float32 kernel sums in another order).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.cases import attention_inputs, naive_attention, poison_blocks_before_windows

ops = pytest.importorskip("kernels.cpu.ops")
if not ops.available():
    pytest.skip("host has no AVX2: the CPU kernels do not run here", allow_module_level=True)

from kernels.cpu.build import host_isa  # noqa: E402

VARIANT = "avx2"
"""The build with the loops; every host that runs the fast path runs it."""

# Runs of 8 to 300 tokens (two of them chunks that start mid-sequence) between decodes and
# pieces shorter than the min run, which stay on the decode loops.
MIXED = [(5, 1), (300, 300), (37, 1), (70, 40), (29, 3), (50, 17), (16, 16), (200, 15), (90, 8)]
MIN_RUN = 8
LONG = [1, 3, 5, 6, 7, 8]
"""Indices into MIXED of the runs of at least MIN_RUN tokens."""


@pytest.fixture
def threads():
    """``threads(n)`` sets the OpenMP thread count the kernels see; restored after the test."""
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


def _attend(query, nh, nkv, hd, kc, vc, tables, tseq, tctx, *, min_run, window=0):
    with ops.f32_prefill_min_run(min_run, VARIANT):
        return ops.paged_attention(
            query.reshape(len(tseq), -1), nh, nkv, hd, kc, vc, tables, tseq, tctx,
            int(tctx.max()), 1 / math.sqrt(hd), ops.AttentionScratch(), sliding_window=window,
            variant=VARIANT,
        ).view(len(tseq), nh, hd)  # fmt: skip


def _both(seqs, nh, nkv, hd, bs, kv_dtype, window=0, long_runs=None):
    """(prefill loops, decode loops, inputs): the same call with the min run at MIN_RUN and
    at 0; asserts the first computed ``long_runs`` runs (default: MIXED's LONG)."""
    inputs = attention_inputs(seqs, nh, nkv, hd, bs, kv_dtype)
    _, query, _, _, kc, vc, tables, tseq, tctx = inputs
    before = ops.f32_prefill_runs_done(VARIANT)
    fast = _attend(query, nh, nkv, hd, kc, vc, tables, tseq, tctx, min_run=MIN_RUN, window=window)
    assert ops.f32_prefill_runs_done(VARIANT) - before == (
        len(LONG) if long_runs is None else long_runs
    )
    before = ops.f32_prefill_runs_done(VARIANT)
    loops = _attend(query, nh, nkv, hd, kc, vc, tables, tseq, tctx, min_run=0, window=window)
    assert ops.f32_prefill_runs_done(VARIANT) == before  # min run 0: none
    return fast, loops, inputs


KV_DTYPES = pytest.mark.parametrize(
    "kv_dtype",
    [torch.float32, torch.float16, torch.int8, (torch.float16, torch.int8)],
    ids=["f32", "f16", "i8", "f16-i8"],
)


@pytest.mark.parametrize(
    ("bs", "nh", "nkv", "hd"),
    [(16, 9, 3, 64), (4, 9, 3, 64), (16, 16, 1, 32), (8, 4, 2, 96), (32, 8, 8, 128)],
    ids=["smollm2-bs16", "smollm2-bs4", "mqa16-hd32", "gqa2-hd96", "mha-hd128-bs32"],
)
@KV_DTYPES
def test_prefill_runs_are_bitwise_the_decode_loops(bs, nh, nkv, hd, kv_dtype) -> None:
    fast, loops, inputs = _both(MIXED, nh, nkv, hd, bs, kv_dtype)
    assert torch.equal(fast, loops)
    # and both are the attention of what the cache holds (float64 reference)
    step, query, keys, values, *_ = inputs
    ref = naive_attention(step, query, keys, values, 1 / math.sqrt(hd))
    assert torch.allclose(fast.double(), ref, rtol=1e-4, atol=1e-5)


@KV_DTYPES
@pytest.mark.parametrize("window", [1, 19, 200])
def test_sliding_window_is_bitwise_and_blocks_before_it_are_not_read(kv_dtype, window) -> None:
    """Whole cache blocks before every window of a sequence's rows hold NaN (freed blocks
    another sequence reused): neither kernel reads them, and the rows agree bitwise."""
    nh, nkv, hd, bs = 9, 3, 64, 4
    step, query, _, _, kc, vc, tables, tseq, tctx = attention_inputs(
        MIXED, nh, nkv, hd, bs, kv_dtype
    )
    poison_blocks_before_windows(step, bs, window, kc, vc)
    args = (query, nh, nkv, hd, kc, vc, tables, tseq, tctx)
    before = ops.f32_prefill_runs_done(VARIANT)
    fast = _attend(*args, min_run=MIN_RUN, window=window)
    assert ops.f32_prefill_runs_done(VARIANT) - before == len(LONG)
    loops = _attend(*args, min_run=0, window=window)
    assert not bool(fast.isnan().any())
    assert torch.equal(fast, loops)


def test_a_rows_result_does_not_depend_on_its_chunking_the_call_or_threads(threads) -> None:
    """A prompt's rows alone, in the mixed call, cut into chunks of either side of the min
    run (so one piece takes the prefill loops and the next the decode loops), on one thread
    or two: bitwise the same."""
    nh, nkv, hd = 9, 3, 64
    _, query, _, _, kc, vc, tables, tseq, tctx = attention_inputs(
        MIXED, nh, nkv, hd, 16, (torch.float16, torch.int8)
    )

    def attend(rows: slice) -> torch.Tensor:
        return _attend(
            query[rows], nh, nkv, hd, kc, vc, tables, tseq[rows], tctx[rows], min_run=MIN_RUN
        )

    threads(2)
    full = attend(slice(None))
    start = MIXED[0][1]  # the 300-token prompt's first row
    for n in (1, 2):
        threads(n)
        assert torch.equal(attend(slice(None)), full)
        for rows in (
            slice(start, start + 300),
            slice(start, start + 137),  # the prompt's first chunk
            slice(start + 137, start + 300),  # and the rest: contexts from 138
            slice(start + 250, start + 257),  # 7 tokens: the decode loops
            slice(start + 257, start + 266),  # 9 tokens: the prefill loops
            slice(start + 299, start + 300),  # the last token alone
        ):
            assert torch.equal(attend(rows), full[rows]), (n, rows)


@pytest.mark.parametrize(
    ("nh", "nkv", "hd", "seqs", "long_runs"),
    [
        (9, 3, 64, [(4096, 24), (2049, 9), (3000, 1), (4000, 40)], 3),
        # 8 kv heads x 4200 keys x (2 x 128 + 2) floats: over the 32 MB a group of widened
        # heads may take, so the heads go in two groups
        (8, 8, 128, [(4200, 16), (300, 12)], 2),
    ],
    ids=["smollm2", "mha-hd128-head-groups"],
)
def test_long_contexts_grow_the_buffer_and_agree(nh, nkv, hd, seqs, long_runs) -> None:
    """Chunks at contexts of ~2-4k keys (their widened keys and values, MBs a kv head, grow
    the thread's buffer), a 1-token run among them, and heads widened in groups."""
    fast, loops, _ = _both(seqs, nh, nkv, hd, 16, torch.float16, long_runs=long_runs)
    assert torch.equal(fast, loops)


def test_only_the_avx2_build_has_the_loops() -> None:
    assert ops.f32_prefill_path(VARIANT)
    for variant in host_isa().supported:
        if variant != VARIANT:  # AVX-512 builds sum 16 lanes: their float32 rows stay theirs
            assert not ops.f32_prefill_path(variant), variant
