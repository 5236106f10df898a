"""CUDA benchmark: Triton kernels against the torch reference, SmolLM2-like shapes.

Prints one line per op and shape: the torch reference's and the Triton kernel's time per
call (CUDA events, median of several rounds after warm-up), the speed-up, and the largest
difference between the two outputs. Needs a CUDA device and triton.

    python -m tools.bench_gpu [--dtype bfloat16|float32] [--rounds N] [--iters N]

``--device cpu --quick`` (with ``TRITON_INTERPRET=1``) runs every line once on tiny shapes
through the interpreter: a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kernels import reference
from tests.kernels.cases import make_step

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, HIDDEN, INTER = 9, 3, 64, 16, 576, 1536


class _Bench:
    def __init__(self, device: str, iters: int, rounds: int) -> None:
        self.device = device
        self.iters = iters
        self.rounds = rounds

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def time_ms(self, fn: Callable[[], object]) -> float:
        for _ in range(min(3, self.iters)):
            fn()
        self._sync()
        samples = []
        for _ in range(self.rounds):
            if self.device == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.iters):
                    fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / self.iters)
            else:
                t0 = time.perf_counter()
                for _ in range(self.iters):
                    fn()
                samples.append((time.perf_counter() - t0) * 1e3 / self.iters)
        return statistics.median(samples)

    def row(self, name: str, ref_fn: Callable[[], object], tri_fn: Callable[[], object]) -> None:
        ref_out, tri_out = ref_fn(), tri_fn()
        if isinstance(ref_out, tuple):
            ref_out, tri_out = ref_out[0], tri_out[0]  # type: ignore[index]
        diff = ""
        if isinstance(ref_out, torch.Tensor) and isinstance(tri_out, torch.Tensor):
            diff = f"{(ref_out.float() - tri_out.float()).abs().max().item():.1e}"
        t_ref = self.time_ms(ref_fn)
        t_tri = self.time_ms(tri_fn)
        print(f"{name:44s} {t_ref:9.4f} {t_tri:9.4f} {t_ref / t_tri:7.2f}x {diff:>9s}", flush=True)


def _elementwise_rows(b: _Bench, dtype: torch.dtype, token_counts: tuple[int, ...]) -> None:
    from kernels.triton.activation import silu_and_mul_triton
    from kernels.triton.kv_cache import write_kv_cache_triton
    from kernels.triton.rms_norm import fused_add_rms_norm_triton, rms_norm_triton
    from kernels.triton.rotary import rotary_embedding_triton

    dev = b.device
    cache = reference.build_cos_sin_cache(HEAD_DIM, 8192, 100000.0, dtype, dev)
    k_cache = torch.zeros(2048, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
    for t in token_counts:
        x = torch.randn(t, HIDDEN, device=dev, dtype=dtype)
        r = torch.randn_like(x)
        w = torch.rand(HIDDEN, device=dev, dtype=dtype) + 0.5
        b.row(
            f"rms_norm T={t}",
            lambda x=x, w=w: reference.rms_norm(x, w, 1e-5),
            lambda x=x, w=w: rms_norm_triton(x, w, 1e-5),
        )
        b.row(
            f"fused_add_rms_norm T={t}",
            lambda x=x, r=r, w=w: reference.fused_add_rms_norm(x, r, w, 1e-5),
            lambda x=x, r=r, w=w: fused_add_rms_norm_triton(x, r, w, 1e-5),
        )
        qkv = torch.randn(t, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device=dev, dtype=dtype)
        q = qkv[:, : NUM_HEADS * HEAD_DIM].view(t, NUM_HEADS, HEAD_DIM)
        k = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM]
        k = k.view(t, NUM_KV_HEADS, HEAD_DIM)
        pos = torch.randint(0, 8192, (t,), device=dev)
        b.row(
            f"rotary_embedding T={t}",
            lambda p=pos, q=q, k=k: reference.rotary_embedding(p, q, k, cache),
            lambda p=pos, q=q, k=k: rotary_embedding_triton(p, q, k, cache),
        )
        g = torch.randn(t, 2 * INTER, device=dev, dtype=dtype)
        b.row(
            f"silu_and_mul T={t}",
            lambda g=g: reference.silu_and_mul(g),
            lambda g=g: silu_and_mul_triton(g),
        )
        slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device=dev)[:t]
        b.row(
            f"write_kv_cache T={t}",
            lambda k=k, s=slots: reference.write_kv_cache(k, k, k_cache, k_cache, s),
            lambda k=k, s=slots: write_kv_cache_triton(k, k, k_cache, k_cache, s),
        )


def _attention_rows(b: _Bench, dtype: torch.dtype, quick: bool) -> None:
    from kernels.triton.paged_attention import paged_attention_triton

    gen = torch.Generator().manual_seed(0)

    def lens(n: int, lo: int, hi: int) -> list[tuple[int, int]]:
        return [(int(s), 1) for s in torch.randint(lo, hi, (n,), generator=gen)]

    if quick:
        cases = {"decode 2 x ctx~40": lens(2, 30, 50), "mixed 2 decodes + 40": lens(2, 9, 30)}
        cases["mixed 2 decodes + 40"] += [(40, 40)]
    else:
        cases = {
            "decode 16 x ctx~256": lens(16, 240, 273),
            "decode 64 x ctx~1024": lens(64, 900, 1150),
            "decode 256 x ctx~2048": lens(256, 1800, 2300),
            "prefill 1 x 512": [(512, 512)],
            "prefill 4 x 2048": [(2048, 2048)] * 4,
            "chunk 512 after 1536 prefix": [(2048, 512)],
            "mixed 16 decodes + 512 prefill": [*lens(16, 240, 273), (512, 512)],
        }
    num_blocks = max(sum(-(-s // BLOCK_SIZE) for s, _ in seqs) for seqs in cases.values()) + 16
    kc = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=b.device, dtype=dtype)
    vc = torch.randn_like(kc)
    scale = HEAD_DIM**-0.5
    for name, seqs in cases.items():
        step = make_step(seqs, BLOCK_SIZE, num_blocks, generator=gen, device=b.device)
        q = torch.randn(step.positions.shape[0], NUM_HEADS, HEAD_DIM, device=b.device, dtype=dtype)
        b.row(
            f"paged_attention {name}",
            lambda q=q, m=step.meta: reference.paged_attention(q, kc, vc, m, scale),
            lambda q=q, m=step.meta: paged_attention_triton(q, kc, vc, m, scale),
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one call each")
    args = ap.parse_args()
    if args.device == "cuda":
        assert torch.cuda.is_available(), "needs a CUDA device (or --device cpu --quick)"
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    b = _Bench(args.device, 1 if args.quick else args.iters, 1 if args.quick else args.rounds)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    print(f"{name}  torch {torch.__version__}  dtype {args.dtype}")
    print(
        f"{'op / shape':44s} {'torch ms':>9s} {'triton ms':>9s} {'speedup':>8s} {'max|diff|':>9s}"
    )
    _elementwise_rows(b, dtype, (8,) if args.quick else (16, 512, 4096))
    _attention_rows(b, dtype, args.quick)


if __name__ == "__main__":
    main()
