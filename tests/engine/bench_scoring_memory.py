"""Memory of scoring a big batch: 64 prompts of 512 tokens, prompt logprobs, all at once.

    .venv/bin/python tests/engine/bench_scoring_memory.py [--prompts 64] [--tokens 512] [--k 5]

Runs the engine core in this process (the same core the server spawns), commits every
page of the KV cache first (so what is measured is scoring, not the fixed pool filling
up), resets the kernel's peak-RSS mark, scores the batch (`max_tokens` 0, so only the
prompts go through the model) and prints RSS before, peak during and after.

The bound it checks: peak - before <= transient + results, where
- transient = one step's activations (`max_num_batched_tokens` rows) plus one chunk of
  vocabulary-wide logits and log-softmax (`LOGITS_ELEMENTS_PER_CHUNK` floats each), with
  a 2x allowance for the allocator, and
- results = the TokenLogprob entries kept until each request ends.
Holding `[prompt_len, vocab]` float32 logits per prompt instead would need
prompts * tokens * vocab * 4 bytes (6.4 GB here). Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.config import EngineConfig
from engine.messages import AddRequest
from engine.prompt_logprobs import LOGITS_ELEMENTS_PER_CHUNK
from engine.sampling_params import SamplingParams

MIB = 1 << 20


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM (peak RSS) to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--k", type=int, default=5, help="prompt_logprobs (top-k alternatives)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()

    from engine.core import EngineCore

    n, length = args.prompts, args.tokens
    config = EngineConfig(
        max_model_len=length + 16,
        max_num_seqs=n,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=2,
    )
    core = EngineCore(config)
    core.warm_up()
    vocab = core.vocab_size
    for k_cache, v_cache in core.runner.kv_caches:
        k_cache.fill_(0)
        v_cache.fill_(0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=args.k)
    gc.collect()
    before = status_kib("VmRSS")
    reset_peak_rss()

    start = time.monotonic()
    for i, ids in enumerate(prompts):
        admission = core.add_request(
            AddRequest(request_id=f"score-{i}", prompt_token_ids=ids, params=params)
        )
        assert admission.accepted, admission.message
    results = {}
    steps = 0
    while core.has_work():
        for _, out in core.step():
            results[out.request_id] = out.prompt_logprobs
        steps += 1
    elapsed = time.monotonic() - start
    peak = status_kib("VmHWM")
    after = status_kib("VmRSS")
    scored = sum(len(r or []) - 1 for r in results.values())

    hidden = config.max_num_batched_tokens * 576 * 4
    chunk = LOGITS_ELEMENTS_PER_CHUNK * 4
    # One TokenLogprob with k alternatives: the struct, two floats/ints and k tuples.
    per_entry = 200 + args.k * 150
    bound = 2 * (40 * hidden + 3 * chunk) + scored * per_entry
    naive = n * (length - 1) * vocab * 4
    print(
        f"scored {scored} prompt tokens ({n} prompts x {length}, k={args.k}) in {steps} steps, {elapsed:.0f} s"
    )
    print(
        f"engine RSS before {before / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB, after {after / 1024:.0f} MiB"
    )
    print(
        f"peak - before = {(peak - before) / 1024:.0f} MiB; stated bound {bound / MIB:.0f} MiB "
        f"({'within' if (peak - before) * 1024 <= bound else 'ABOVE'}); "
        f"[prompt_len, vocab] logits for the batch would be {naive / MIB:.0f} MiB"
    )
    print(f"KV cache pool (committed before measuring): {core.model_info.num_kv_blocks} blocks")


if __name__ == "__main__":
    main()
