"""Benchmark the q8-activation GEMMs against the fp32 kernel and torch bf16, per shape.

usage: OMP_NUM_THREADS=2 python tools/bench_q8_gemm.py [--tokens 1 4 16 64 256] [--threads 2]

For SmolLM2-135M's linears (Q4_1: qkv 576->960, o 576->576, gate_up 576->3072, down
1536->576; Q8_0: the tied LM head 576->49152) at each token count T, prints the time per
call (median of repeats) and GOP/s (2 T K N / time) of:
  fp32        the existing fp32-accumulating kernel (`ops.linear`, this host's variant or
              --cpu-isa's)
  q8:<v>      `linear_q8act` in each variant the host supports (amx-vnni: the amx build
              kept on its VNNI kernels; amx: AMX tiles at every T)
  bf16-tiles  `bf16_ops.linear_tiles` (gguf-bf16's kernel: AMX tiles, or AVX512-BF16) at
              every T, where this host has one
  torch-bf16  `F.linear` on bf16 weights and inputs (oneDNN, AMX where the host has it): the
              ceiling reference, not batch invariant.
At T = 1 the weight stream is the bound: GB/s of packed weight bytes is printed too. Each
method cycles through copies of its weight totalling >= --cold-mb (default 96 MB, more than
the caches), so the weights come from memory as in a decode step (--cold-mb 0: cache-hot). Then
the quality sanity figure: relative error of q8act vs the fp32 kernel (and of both vs the
float64 product with the dequantized weights) on gaussian x and random Q4_1 blocks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.cpu import bf16_ops, build, ops, q8_ops

SHAPES = [  # (name, kind, K, N)
    ("qkv", "q4_1", 576, 960),
    ("o_proj", "q4_1", 576, 576),
    ("gate_up", "q4_1", 576, 3072),
    ("down", "q4_1", 1536, 576),
    ("lm_head", "q8_0", 576, 49152),
]


def raw_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF rows: f16 scales ~1e-2, Q4_1 mins ~ -8 d, every quant value."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    d = (rng.uniform(0.5, 1.5, (n, nb)) * 0.01).astype(np.float16)
    parts = [d.view(np.uint8).reshape(n, nb, 2)]
    if kind == "q4_1":
        m = (-8 * d.astype(np.float32)).astype(np.float16)
        parts += [
            m.view(np.uint8).reshape(n, nb, 2),
            rng.integers(0, 256, (n, nb, 16), dtype=np.uint8),
        ]
    else:
        parts.append(rng.integers(-127, 128, (n, nb, 32), dtype=np.int8).view(np.uint8))
    return np.ascontiguousarray(np.concatenate(parts, axis=2).reshape(n, -1))


def dequantize(kind: str, raw: np.ndarray) -> torch.Tensor:
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 20 if kind == "q4_1" else 34)
    d = blocks[:, :, 0:2].copy().view(np.float16).astype(np.float32)
    if kind == "q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16).astype(np.float32)
        q = np.concatenate([blocks[:, :, 4:] & 15, blocks[:, :, 4:] >> 4], axis=2).astype(
            np.float32
        )
        w = d * q + m
    else:
        w = d * blocks[:, :, 2:].view(np.int8).astype(np.float32)
    return torch.from_numpy(w.reshape(n, -1))


class Cycle:
    """Round-robin over copies of one weight (so repeats do not find it in cache)."""

    def __init__(self, items: list) -> None:
        self.items, self.i = items, 0

    def next(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


def timeit(
    fn: Callable[[], object], budget_s: float, stat: str = "median", max_reps: int = 400
) -> float:
    """Seconds per call (median or min of the repeats): warm-up, then repeats filling about
    `budget_s`. On a shared host the min shows the kernel, the median what a caller sees."""
    fn()
    t0 = time.perf_counter()
    fn()
    est = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max_reps, max(5, budget_s / est)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) if stat == "min" else statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument(
        "--shapes", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES]
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.25, help="seconds of repeats per measurement")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch bf16 reference")
    ap.add_argument("--stat", choices=["median", "min"], default="median", help="of the repeats")
    ap.add_argument(
        "--cold-mb", type=float, default=96.0, help="cycle weight copies totalling this"
    )
    ap.add_argument(
        "--cpu-isa",
        default="auto",
        choices=("auto", *build.VARIANTS),
        help="the variant `fp32` runs (default: the host's highest; a lower one times that build here)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    isa = build.select_variant(args.cpu_isa)
    print(f"host: {isa.describe()}; {torch.get_num_threads()} threads; torch {torch.__version__}")
    modes: list[tuple[str, str, int]] = []
    for v in isa.supported:
        if v == "amx":
            modes += [("q8:amx-vnni", v, q8_ops.AMX_NEVER), ("q8:amx", v, 1)]
        else:
            modes.append((f"q8:{v}", v, q8_ops.AMX_NEVER))
    if "amx" in isa.supported:
        print(f"amx variant integer path: {q8_ops.integer_path('amx')}")
    tiles = ["bf16-tiles"] if bf16_ops.available() else []
    cols = ["fp32", *(m[0] for m in modes), *tiles, *([] if args.no_torch else ["torch-bf16"])]
    header = f"| shape | T | {' | '.join(cols)} | best q8 vs fp32 |"
    print(f"\ntime per call in us ({args.stat} of repeats; GOP/s = 2 T K N / time)\n")
    print(header)
    print("|" + "---|" * (len(cols) + 3))
    for name, kind, k, n in SHAPES:
        if name not in args.shapes:
            continue
        raw = raw_blocks(kind, n, k)
        q8_w = q8_ops.pack_q8act(kind, raw)
        copies = max(1, int(np.ceil(args.cold_mb * 1e6 / q8_w.nbytes)))
        fp32_ws = Cycle([ops.pack(kind, raw) for _ in range(copies)])
        q8_ws = Cycle([q8_w] + [q8_ops.pack_q8act(kind, raw) for _ in range(copies - 1)])
        dense = dequantize(kind, raw)
        tile_ws = Cycle(
            [
                bf16_ops.pack_tiles(dense, ops.pack(kind, raw), min_t=1, raw=raw)
                for _ in range(copies)
            ]
            if tiles
            else []
        )
        bf16 = dense.to(torch.bfloat16)
        bf16_ws = Cycle([bf16] + [bf16.clone() for _ in range(0 if args.no_torch else copies - 1)])
        for t in args.tokens:
            x = torch.randn(t, k)
            out = torch.empty(t, n)
            xb = x.to(torch.bfloat16)
            fns: dict[str, Callable[[], object]] = {
                "fp32": lambda x=x, out=out, ws=fp32_ws: ops.linear(x, ws.next(), out=out)
            }
            for label, v, amx_min_t in modes:
                fns[label] = lambda v=v, a=amx_min_t, x=x, out=out, ws=q8_ws: q8_ops.linear_q8act(
                    x, ws.next(), out=out, variant=v, amx_min_t=a
                )
            if tiles:
                fns["bf16-tiles"] = lambda x=x, out=out, ws=tile_ws: bf16_ops.linear_tiles(
                    x, ws.next(), out=out
                )
            if not args.no_torch:
                fns["torch-bf16"] = lambda xb=xb, ws=bf16_ws: torch.nn.functional.linear(
                    xb, ws.next()
                )
            secs = {c: timeit(fns[c], args.budget, args.stat) for c in cols}
            ops_ = 2 * t * k * n
            cells = [f"{secs[c] * 1e6:.0f} ({ops_ / secs[c] / 1e9:.0f})" for c in cols]
            best = min((c for c in cols if c.startswith("q8:")), key=secs.__getitem__)
            speed = f"{secs['fp32'] / secs[best]:.1f}x ({best[3:]})"
            if t == 1:
                speed += f", {q8_w.nbytes / secs[best] / 1e9:.1f} GB/s of weights"
            print(f"| {name} {k}->{n} {kind} | {t} | {' | '.join(cells)} | {speed} |", flush=True)
    # quality sanity
    k, n = 576, 3072
    raw = raw_blocks("q4_1", n, k, seed=1)
    x = torch.randn(64, k)
    exact = x.double() @ dequantize("q4_1", raw).double().T
    fp32 = ops.linear(x, ops.pack("q4_1", raw)).double()
    q8 = q8_ops.linear_q8act(x, q8_ops.pack_q8act("q4_1", raw)).double()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    print(
        f"\nquality (gaussian x [64, 576], random Q4_1 576->3072): ||q8act - fp32|| / ||fp32|| = "
        f"{rel(q8, fp32):.2e}; vs float64 exact: q8act {rel(q8, exact):.2e}, fp32 kernel {rel(fp32, exact):.2e}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
