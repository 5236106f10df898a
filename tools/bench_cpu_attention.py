"""Benchmark the C decode attention with a float32, a float16 and an int8 KV cache, or (--prefill) the
prefill attention of the float32 decode loops against the AVX2 build's float32 prefill loops
(the same bits) and the bfloat16 kernels.

usage: python tools/bench_cpu_attention.py [--batch 1 16 64] [--ctx 128 512 2048]
                                           [--threads 1 2] [--repeat 7] [--cold-mb 256]
       python tools/bench_cpu_attention.py --prefill [--ctx 512 1024 2048 4096] [--threads 2]
                                           [--kv-cache-dtype float16|float16-int8]

--prefill: one call is one layer's attention of a prompt of `ctx` tokens in one chunk (every
token a query over its causal prefix), float16 KV (or float16 keys, int8 values), the same
shape; per (ctx, threads) the time per call (minimum and median over --repeat rounds, the
kernels' rounds alternating) and GFLOP/s (4 * heads * head_dim * ctx (ctx + 1) / 2: the two
products of the causal half) of the float32 kernel's decode loops (``fp32``), the ``avx2``
build's float32 prefill loops (``fp32-prefill``, hearth_attention_f32.c), the AVX512-BF16
kernel (the ``avx512_vnni`` build) and the AMX-BF16
tiles (``amx``), each where this host runs it.

One call is one layer of a decode step of SmolLM2-135M's shape (9 query heads on 3 kv
heads of head_dim 64, block size 16): B sequences, each decoding one token over `ctx`
keys, block tables drawn from a shuffled pool as after the engine has run a while. Prints
per (B, ctx, threads) the time per call of each cache dtype (minimum and median over
--repeat rounds, the dtypes' rounds alternating; quote minimums on a shared host), the effective GB/s of KV read
(B * ctx * 2 * nkv * row bytes / time; an int8 row carries its 4-byte scale) and the
float16 and int8 speed-ups over float32. Each round calls
every one of several cache copies totalling >= --cold-mb of KV once, so the cache is read
from memory as in a real step (whose 30 layers' KV and weights do not stay in cache);
--cold-mb 0 measures a cache-hot single copy.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import reference
from kernels.cpu import build, ops

NH, NKV, HD, BS = 9, 3, 64, 16
DTYPES = (torch.float32, torch.float16, torch.int8)


def _cache_of(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return reference.quantize_kv_int8(x) if dtype == torch.int8 else x.to(dtype)


def _row_bytes(dtype: torch.dtype) -> int:
    return reference.kv_head_elems(HD, dtype) * torch.empty((), dtype=dtype).element_size()


def _case(batch: int, ctx: int, dtype: torch.dtype, copies: int, gen: torch.Generator):
    blocks_per_seq = -(-ctx // BS)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(batch, blocks_per_seq)
    caches = []
    for _ in range(copies):
        kc, vc = (
            _cache_of(torch.randn(num_blocks, BS, NKV, HD, generator=gen), dtype) for _ in "kv"
        )
        caches.append((kc, vc))
    q = torch.randn(batch, NH * HD, generator=gen)
    seq = torch.arange(batch, dtype=torch.int32)
    tctx = torch.full((batch,), ctx, dtype=torch.int32)
    return q, caches, tables, seq, tctx


def _timer(batch: int, ctx: int, dtype: torch.dtype, args, gen: torch.Generator):
    """A function that times one round of calls (seconds per call) of this case."""
    per_copy = batch * ctx * 2 * NKV * _row_bytes(dtype)
    copies = max(1, math.ceil(args.cold_mb * 1e6 / per_copy)) if args.cold_mb > 0 else 1
    q, caches, tables, seq, tctx = _case(batch, ctx, dtype, copies, gen)
    scratch = ops.AttentionScratch()
    out = torch.empty(batch, NH * HD)
    scale = 1 / math.sqrt(HD)
    calls = max(len(caches), 3)

    def call(kc: torch.Tensor, vc: torch.Tensor) -> None:
        ops.paged_attention(q, NH, NKV, HD, kc, vc, tables, seq, tctx, ctx, scale, scratch, out)

    def one_round() -> float:
        t0 = time.perf_counter()
        for i in range(calls):
            call(*caches[i % len(caches)])
        return (time.perf_counter() - t0) / calls

    for kc, vc in caches[:2]:  # warm-up: scratch, page faults of the output
        call(kc, vc)
    return one_round


PrefillKernel = tuple[str, str | None, int, int | None]
"""(label, library variant, bfloat16 min_run, float32 prefill min run or None: the build's)."""


def _prefill_kernels() -> list[PrefillKernel]:
    """Each prefill kernel this host runs: the float32 decode loops (the prefill loops off),
    the AVX2 build's float32 prefill loops, the bfloat16 kernels."""
    from kernels.cpu import bf16_ops

    kernels: list[PrefillKernel] = [("fp32", None, 0, 0)]
    if ops.f32_prefill_path("avx2"):
        kernels.append(("fp32-prefill", "avx2", 0, None))
    for variant in ("avx512_vnni", "amx"):
        if variant in build.host_isa().supported:
            path = bf16_ops.attention_path(HD, variant)
            if path != "none" and path not in [k[0] for k in kernels]:
                kernels.append((path, variant, bf16_ops.ATTENTION_MIN_RUN, None))
    return kernels


def _prefill_timer(ctx: int, kernel: PrefillKernel, values: torch.dtype, gen: torch.Generator):
    _, variant, min_run, f32_min_run = kernel
    blocks = -(-ctx // BS)
    tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(1, blocks)
    kc = torch.randn(blocks, BS, NKV, HD, generator=gen).half()
    vc = _cache_of(torch.randn(blocks, BS, NKV, HD, generator=gen), values)
    q = torch.randn(ctx, NH * HD, generator=gen)
    seq = torch.zeros(ctx, dtype=torch.int32)
    tctx = torch.arange(1, ctx + 1, dtype=torch.int32)
    scratch = ops.AttentionScratch()
    out = torch.empty(ctx, NH * HD)
    scale = 1 / math.sqrt(HD)

    def call() -> float:
        with contextlib.ExitStack() as stack:
            if f32_min_run is not None:
                stack.enter_context(ops.f32_prefill_min_run(f32_min_run, variant))
            t0 = time.perf_counter()
            ops.paged_attention(
                q, NH, NKV, HD, kc, vc, tables, seq, tctx, ctx, scale, scratch, out,
                min_run=min_run, variant=variant,
            )  # fmt: skip
            return time.perf_counter() - t0

    call()  # warm-up: scratch, the repack buffer, page faults of the output
    return call


def prefill(args) -> int:
    kernels = _prefill_kernels()
    values = torch.int8 if args.kv_cache_dtype == "float16-int8" else torch.float16
    print(
        f"shape: {NH} heads / {NKV} kv heads x {HD}, block {BS}, {args.kv_cache_dtype} KV; one "
        f"call = one layer's attention of a ctx-token prompt in one chunk; {args.repeat} rounds"
    )
    print()
    head = " | ".join(f"{k[0]} ms (min / med) | {k[0]} GFLOP/s" for k in kernels)
    speedups = " | ".join(f"{k[0]} speed-up" for k in kernels[1:])
    print(f"| ctx | thr | {head} | {speedups} |")
    print("|---|---|" + "---|" * (2 * len(kernels) + len(kernels) - 1))
    saved = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for ctx in args.ctx:
                timers = [_prefill_timer(ctx, kernel, values, gen) for kernel in kernels]
                times = [[fn() for fn in timers] for _ in range(args.repeat)]
                flops = 4 * NH * HD * ctx * (ctx + 1) / 2
                cells, mins = [], []
                for i in range(len(kernels)):
                    rounds = [row[i] for row in times]
                    best = min(rounds)
                    mins.append(best)
                    cells.append(
                        f"{best * 1e3:.2f} / {statistics.median(rounds) * 1e3:.2f} | "
                        f"{flops / best / 1e9:.0f}"
                    )
                ups = " | ".join(f"{mins[0] / m:.2f}x" for m in mins[1:])
                print(f"| {ctx} | {threads} | {' | '.join(cells)} | {ups} |", flush=True)
    finally:
        torch.set_num_threads(saved)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/bench_cpu_attention.py", description=__doc__)
    parser.add_argument("--prefill", action="store_true", help="prefill attention (see above)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--ctx", type=int, nargs="+", default=None)
    parser.add_argument("--threads", type=int, nargs="+", default=None)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--cold-mb", type=float, default=256.0)
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["float16", "float16-int8"],
        default="float16",
        help="--prefill: the cache (float16-int8: float16 keys, int8 values, the AVX2 default)",
    )
    args = parser.parse_args(argv)
    if not ops.available():
        print("no C kernels on this host (no AVX2)", file=sys.stderr)
        return 1
    host = build.host_isa()
    try:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = "?"
    print(f"host: {host.describe()}; load average {load}")
    if args.prefill:
        args.ctx = args.ctx or [512, 1024, 2048, 4096]
        args.threads = args.threads or [2]
        return prefill(args)
    args.ctx = args.ctx or [128, 512, 2048]
    args.threads = args.threads or [1, 2]
    print(
        f"shape: {NH} heads / {NKV} kv heads x {HD}, block {BS}; one call = one layer's decode "
        f"attention; KV copies >= {args.cold_mb:g} MB per round; {args.repeat} rounds"
    )
    print()
    print(
        "| B | ctx | thr | KV MB f32 | f32 us (min / med) | f32 GB/s | f16 us (min / med) | f16 GB/s "
        "| i8 us (min / med) | i8 GB/s | f16 speed-up | i8 speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    saved = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch in args.batch:
                for ctx in args.ctx:
                    cells, mins = [], []
                    timers = [_timer(batch, ctx, dtype, args, gen) for dtype in DTYPES]
                    # Rounds of the dtypes alternate, so host load drifts hit both alike.
                    times = [[fn() for fn in timers] for _ in range(args.repeat)]
                    for i, dtype in enumerate(DTYPES):
                        rounds = [row[i] for row in times]
                        nbytes = batch * ctx * 2 * NKV * _row_bytes(dtype)
                        best = min(rounds)
                        mins.append(best)
                        cells.append(
                            f"{best * 1e6:.0f} / {statistics.median(rounds) * 1e6:.0f} | "
                            f"{nbytes / best / 1e9:.1f}"
                        )
                    mb32 = batch * ctx * 2 * NKV * HD * 4 / 1e6
                    print(
                        f"| {batch} | {ctx} | {threads} | {mb32:.1f} | {' | '.join(cells)} | "
                        f"{mins[0] / mins[1]:.2f}x | {mins[0] / mins[2]:.2f}x |",
                        flush=True,
                    )
    finally:
        torch.set_num_threads(saved)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
