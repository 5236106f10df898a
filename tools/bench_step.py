"""Engine-only timing: prefill and decode step times of the in-process core, no HTTP.

    python -m tools.bench_step [--quantization auto|gguf|none] [--batch 1 16 64]

Prints, per batch size, the median decode step (ms), decode tok/s of the engine alone and
the prefill time of `--prompt-len` tokens per sequence, after a warm-up. It isolates the
engine's cost from the API workers' (HTTP, detokenization, SSE); `hearth bench` measures
the whole server. Figures on a shared host are only comparable within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.config import CPU_ISAS, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from engine.core import EngineCore, freeze_startup_objects
from engine.messages import AddRequest
from engine.sampling_params import SamplingParams


def _run(
    core: EngineCore,
    batch: int,
    prompt_len: int,
    decode_steps: int,
    seed: int,
    sampling: dict[str, float] | None = None,
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(
        max_tokens=decode_steps + 1, ignore_eos=True, **(sampling or {"temperature": 0.0})
    )
    high = min(40000, core.vocab_size)  # a small test vocabulary too
    for i in range(batch):
        ids = torch.randint(min(100, high // 2), high, (prompt_len,), generator=gen).tolist()
        msg = AddRequest(request_id=f"b{seed}-{i}", prompt_token_ids=ids, params=params)
        admission = core.add_request(msg)
        if not admission.accepted:
            raise SystemExit(f"the engine refused a {prompt_len}-token prompt: {admission.message}")
    prefill_start = time.perf_counter()
    step_times: list[float] = []
    cpu_times: list[float] = []
    # Prefill ends when every sequence has its first token: with a chunked prefill the
    # first sequences decode while later ones still prefill, so a count of outputs would
    # end it early.
    started: set[str] = set()
    first_token_at = None
    while core.has_work():
        t0, c0 = time.perf_counter(), time.process_time()
        outs = core.step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if first_token_at is None:
            started.update(out.request_id for _, out in outs)
            if len(started) >= batch:
                first_token_at = time.perf_counter()
        elif len(outs) == batch:
            step_times.append(dt)
            cpu_times.append(dc)
    prefill = (first_token_at or time.perf_counter()) - prefill_start
    med = statistics.median(step_times) if step_times else float("nan")
    cpu = statistics.median(cpu_times) if cpu_times else float("nan")
    return {
        "batch": batch,
        "prefill_s": prefill,
        "decode_ms": med * 1e3,
        "cpu_ms": cpu * 1e3,
        "tok_s": batch / med,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_step", description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="engine threads (default: all)")
    parser.add_argument(
        "--cpu-isa",
        default="auto",
        choices=CPU_ISAS,
        help="CPU kernel build (default: the host's highest; a lower one times that build here)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache element type (default: auto, as hearth serve resolves it for the mode)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (default 0: greedy; > 0 times the random draw too)",
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)"
    )
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (with --temperature)")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=16384,
        help="step budget (large by default, so a whole batch is prefilled before decoding)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=max(2048, args.prompt_len + args.decode_steps + 16),
        kv_cache_memory=1 << 30,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        cpu_isa=args.cpu_isa,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    core = EngineCore(config, progress=print)
    core.warm_up()
    freeze_startup_objects()  # as the engine process does once it is ready
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    print(f"mode: {core.backends.description}")
    print(f"sampling: {sampling if args.temperature > 0 else 'greedy'}")
    print("batch  prefill(s)  decode step(ms)  step CPU(ms)  decode tok/s")
    for i, batch in enumerate(args.batch):
        r = _run(core, batch, args.prompt_len, args.decode_steps, seed=i, sampling=sampling)
        print(
            f"{r['batch']:5d}  {r['prefill_s']:10.2f}  {r['decode_ms']:15.1f}  "
            f"{r['cpu_ms']:12.1f}  {r['tok_s']:12.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
