"""Prefill attention on the bfloat16 units (kernels/cpu/hearth_attention_bf16.c) against
float64 references, for each variant this host runs (``amx``: AMX-BF16 tiles,
``avx512_vnni``: AVX512-BF16 dot products, forced down on an AMX host).

Contract: runs of at least ``min_run`` consecutive positions of one sequence round each
query, key and value element (as the cache holds it) and each softmax weight once to
bfloat16 (nearest-even, unit roundoff u = 2^-8: 8 significant bits); scores, maxima, the
exponentials and all sums are float32. Every other row is the float32 kernel's, bitwise.
The bounds below follow from that:

- against the float64 attention of the *rounded* Q, K, V: the weights' rounding moves an
  output by at most u * sum_j w_j |v_j| (``mag``, the same attention of |V|); the float32
  sums (scores over head_dim, the row sum and the value sums over a few hundred keys) add
  well under 2^-10 of the same scale;
- against the float64 attention of the cache's own values: rounding Q and K moves each
  score by at most D = (2u + u^2) * scale * |q|.|k_j|, which scales each weight by a
  factor within exp(+-2D); rounding V adds u * mag; then the kernel's own error above.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.cases import attention_inputs, poison_blocks_before_windows

ops = pytest.importorskip("kernels.cpu.ops")
if not ops.available():
    pytest.skip("host has no AVX2: the CPU kernels do not run here", allow_module_level=True)

from kernels import reference  # noqa: E402
from kernels.cpu import bf16_ops  # noqa: E402
from kernels.cpu.build import host_isa  # noqa: E402

U = 2.0**-8
"""bfloat16's unit roundoff (nearest-even, 8 significant bits)."""
F32_SUMS = 2.0**-10
"""Allowance for the float32 sums, relative to ``mag`` (see the module docstring)."""
MIN_RUN = bf16_ops.ATTENTION_MIN_RUN

VARIANTS = [v for v in host_isa().supported if bf16_ops.attention_path(64, v) != "none"]
"""Variants with a bfloat16 attention kernel this host runs."""
if not VARIANTS:
    pytest.skip(
        f"no bfloat16 attention kernel runs here ({host_isa().describe()})",
        allow_module_level=True,
    )
WITHOUT = [v for v in host_isa().supported if bf16_ops.attention_path(64, v) == "none"]


@pytest.fixture(params=VARIANTS)
def variant(request) -> str:
    return request.param


@pytest.fixture
def threads():
    """``threads(n)`` sets the OpenMP thread count the kernels see; restored after the test."""
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


# Runs of 16, 17, 40 and 300 tokens, two of them chunks that start mid-sequence (their
# first context is not 1), between decodes and short chunks that stay on float32.
MIXED = [(5, 1), (300, 300), (37, 1), (70, 40), (29, 3), (50, 17), (16, 16), (200, 15)]
DECODE_LIKE = (0, 2, 4, 7)
"""Indices into MIXED of sequences whose rows are below the min run."""


def _reference(step, query, keys, values, scale, window=0):
    """float64 attention per row and head: (out, mag = the weights . |V|, the largest
    scale * |q|.|k_j| over the keys a row sees)."""
    nh = query.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    mag = torch.zeros(query.shape, dtype=torch.float64)
    amax = torch.zeros(query.shape[:2], dtype=torch.float64)
    row = 0
    for seq_len, q_len, k, v in zip(step.seq_lens, step.query_lens, keys, values, strict=True):
        group = nh // k.shape[1]
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        hidden = k_pos > q_pos
        if window:
            hidden |= k_pos <= q_pos - window
        for h in range(nh):
            q_h = query[row : row + q_len, h].double()
            k_h, v_h = k[:seq_len, h // group].double(), v[:seq_len, h // group].double()
            weights = torch.softmax((q_h @ k_h.T * scale).masked_fill(hidden, -math.inf), -1)
            out[row : row + q_len, h] = weights @ v_h
            mag[row : row + q_len, h] = weights @ v_h.abs()
            a = (q_h.abs() @ k_h.abs().T * scale).masked_fill(hidden, 0)
            amax[row : row + q_len, h] = a.amax(-1)
        row += q_len
    return out, mag, amax


def _bf16(xs):
    return [x.bfloat16().float() for x in xs]


def _attend(variant, query, nh, nkv, hd, kc, vc, tables, tseq, tctx, *, window=0, min_run=MIN_RUN):
    return ops.paged_attention(
        query.reshape(len(tseq), -1), nh, nkv, hd, kc, vc, tables, tseq, tctx, int(tctx.max()),
        1 / math.sqrt(hd), ops.AttentionScratch(), sliding_window=window, min_run=min_run,
        variant=variant,
    ).view(len(tseq), nh, hd)  # fmt: skip


def _long_rows(seqs, skip=DECODE_LIKE) -> torch.Tensor:
    return torch.tensor(
        [i not in skip for i, (_, q) in enumerate(seqs) for _ in range(q)], dtype=torch.bool
    )


def _check_bounds(got, step, query, keys, values, hd, window, rows) -> None:
    scale = 1 / math.sqrt(hd)
    # the rounded operands' attention: only the weights' rounding and float32 sums differ
    ref, mag, _ = _reference(
        step, query.bfloat16().float(), _bf16(keys), _bf16(values), scale, window
    )
    err = (got.double() - ref).abs()[rows]
    bound = (U + F32_SUMS) * mag[rows]
    assert bool((err <= bound).all()), float((err / bound).max())
    # the exact attention of the cache's values
    ref, mag, amax = _reference(step, query, keys, values, scale, window)
    grow = torch.exp(2 * (2 * U + U * U) * amax)[..., None]
    bound = ((grow - 1) + grow * (U + (U + F32_SUMS) * (1 + U))) * mag
    err = (got.double() - ref).abs()[rows]
    assert bool((err <= bound[rows]).all()), float((err / bound[rows]).max())
    # the check is not vacuous: bf16 shows (a dim whose values are all 0, as an int8 row's
    # small values can be, has bound and error 0)
    ratio = torch.where(bound[rows] > 0, err / bound[rows], torch.zeros_like(err))
    assert float(ratio.max()) > 1e-3


SHAPES = pytest.mark.parametrize(
    ("bs", "nh", "nkv", "hd"),
    [(16, 9, 3, 64), (4, 9, 3, 64), (16, 16, 1, 32), (8, 4, 2, 96)],
    ids=["smollm2-bs16", "smollm2-bs4", "mqa16-hd32", "gqa2-hd96"],
)


KV_DTYPES = pytest.mark.parametrize(
    "kv_dtype",
    [torch.float32, torch.float16, torch.int8, (torch.float16, torch.int8)],
    ids=["f32", "f16", "i8", "f16-i8"],
)


@SHAPES
@KV_DTYPES
def test_prefill_runs_are_within_the_bfloat16_bound(variant, bs, nh, nkv, hd, kv_dtype) -> None:
    step, query, keys, values, kc, vc, tables, tseq, tctx = attention_inputs(
        MIXED, nh, nkv, hd, bs, kv_dtype
    )
    got = _attend(variant, query, nh, nkv, hd, kc, vc, tables, tseq, tctx)
    rows = _long_rows(MIXED)
    _check_bounds(got, step, query, keys, values, hd, 0, rows)
    # the short runs are the float32 kernel's own rows, bitwise
    fp32 = _attend(variant, query, nh, nkv, hd, kc, vc, tables, tseq, tctx, min_run=0)
    assert torch.equal(got[~rows], fp32[~rows])
    assert not torch.equal(got[rows], fp32[rows])  # and the long ones did take bfloat16
    if isinstance(kv_dtype, tuple) or kv_dtype == torch.int8:
        # an int8 row is read as the float32 q * scale, then rounded
        kf, vf = (
            reference.dequantize_kv_int8(c) if c.dtype == torch.int8 else c.float()
            for c in (kc, vc)
        )
        same = _attend(variant, query, nh, nkv, hd, kf, vf, tables, tseq, tctx)
        assert torch.equal(got[rows], same[rows])


@KV_DTYPES
@pytest.mark.parametrize("window", [1, 19, 200])
def test_sliding_window_is_honoured_and_blocks_before_it_are_not_read(
    variant, kv_dtype, window
) -> None:
    """Each row sees its last `window` keys; whole cache blocks before every window of a
    sequence's rows hold NaN (freed blocks another sequence reused) and must not be read."""
    nh, nkv, hd, bs = 9, 3, 64, 4
    step, query, keys, values, kc, vc, tables, tseq, tctx = attention_inputs(
        MIXED, nh, nkv, hd, bs, kv_dtype
    )
    poison_blocks_before_windows(step, bs, window, kc, vc)
    got = _attend(variant, query, nh, nkv, hd, kc, vc, tables, tseq, tctx, window=window)
    assert not bool(got.isnan().any())
    _check_bounds(got, step, query, keys, values, hd, window, _long_rows(MIXED))


def test_min_run_zero_and_builds_without_bfloat16_are_the_float32_kernel() -> None:
    nh, nkv, hd = 9, 3, 64
    _, query, _, _, kc, vc, tables, tseq, tctx = attention_inputs(
        MIXED, nh, nkv, hd, 16, torch.float16
    )
    assert WITHOUT, "every x86 host with the fast path runs the avx2 build"
    for variant in WITHOUT:  # avx2 / avx512 builds: min_run is accepted and changes nothing
        # (compared with the same build at min_run 0: the AVX-512 builds sum scores on 16
        # lanes, the AVX2 build on 8, so the builds' float32 kernels differ in rounding)
        fp32 = _attend(variant, query, nh, nkv, hd, kc, vc, tables, tseq, tctx, min_run=0)
        got = _attend(variant, query, nh, nkv, hd, kc, vc, tables, tseq, tctx)
        assert torch.equal(got, fp32), variant


@pytest.mark.parametrize("window", [0, 19])
def test_a_rows_result_does_not_depend_on_the_call_its_chunking_or_threads(
    variant, window, threads
) -> None:
    """A long run's row gets bitwise the same output alone, inside the mixed call, cut into
    other chunks of at least the min run (key blocks are aligned to positions, not to the
    chunk), and with one thread or two."""
    nh, nkv, hd = 9, 3, 64
    _, query, _, _, kc, vc, tables, tseq, tctx = attention_inputs(
        MIXED, nh, nkv, hd, 16, torch.float16
    )

    def attend(rows: slice) -> torch.Tensor:
        return _attend(
            variant, query[rows], nh, nkv, hd, kc, vc, tables, tseq[rows], tctx[rows],
            window=window,
        )  # fmt: skip

    threads(2)
    full = attend(slice(None))
    starts = [0]
    for _, q in MIXED:
        starts.append(starts[-1] + q)
    long_run, chunk40 = slice(starts[1], starts[2]), slice(starts[3], starts[4])
    for n in (1, 2):
        threads(n)
        assert torch.equal(attend(slice(None)), full)
        for rows in (
            long_run,
            chunk40,
            slice(starts[1], starts[1] + 137),  # the prompt's first chunk
            slice(starts[1] + 137, starts[2]),  # and the rest: contexts from 138
            slice(starts[1] + 250, starts[1] + 266),  # one tile, not at a multiple of 16
            slice(starts[3] + 3, starts[4]),
        ):
            assert torch.equal(attend(rows), full[rows]), (n, rows)


def test_the_variant_is_named_per_build_and_head_dim() -> None:
    for variant in host_isa().supported:
        path = bf16_ops.attention_path(64, variant)
        if variant == "amx":
            status = bf16_ops.library("amx").hearth_bf16_status()
            assert path == ("amx-bf16" if status == 1 else "avx512-bf16"), status
            # O of a 16-row tile must fit the tile registers: wider heads use AVX512-BF16
            assert bf16_ops.attention_path(96, variant) == "avx512-bf16"
        elif variant == "avx512_vnni":
            assert path == "avx512-bf16"
        else:
            assert path == "none"


def test_a_step_of_many_long_contexts_is_cut_into_groups_with_the_same_rows(variant) -> None:
    """Eleven 16-token chunks at context ~4096 repack more keys than one group holds
    (REPACK_CAP, 16 Mi elements): the runs go in groups, and each row is the same as when
    its chunk is the call's only run."""
    nh, nkv, hd, bs = 9, 3, 64, 16
    seqs = [(4096 - i, 16) for i in range(11)]
    _, query, _, _, kc, vc, tables, tseq, tctx = attention_inputs(
        seqs, nh, nkv, hd, bs, torch.float16
    )
    full = _attend(variant, query, nh, nkv, hd, kc, vc, tables, tseq, tctx)
    for i in (0, 5, 10):
        rows = slice(16 * i, 16 * i + 16)
        alone = _attend(variant, query[rows], nh, nkv, hd, kc, vc, tables, tseq[rows], tctx[rows])
        assert torch.equal(alone, full[rows]), i
