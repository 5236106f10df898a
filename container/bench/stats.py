"""Per-request measurements in, the figures of a level out: `vllm bench serve`'s statistics.

TTFT is the time to the first chunk carrying text, ITL every gap between successive text
chunks (pooled over requests, like vLLM), E2E the time to the last text chunk, TPOT
`(E2E - TTFT) / (output tokens - 1)`. Throughputs divide by the wall time of the whole level.
Failed requests are counted and left out of every figure, and a level with any failure is
marked as not counting: a server that drops the hard requests would otherwise look faster.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from container.bench.config import LevelSpec

Result = dict[str, Any]

LATENCIES = ("ttft", "itl", "tpot", "e2e")
PERCENTILES = (50, 90, 99)
# Figures that add up over repeats; identity keys are copied; every other number is the
# median over repeats.
COUNT_KEYS = frozenset(
    {
        "num_prompts",
        "completed",
        "failed",
        "total_output_tokens",
        "total_input_tokens",
        "prompt_len_mismatch",
        "output_len_mismatch",
    }
)
IDENTITY_KEYS = frozenset({"sweep", "concurrency", "input_len", "output_len"})


@dataclass
class RequestResult:
    """What one streamed completion measured; times in seconds from sending the request."""

    ok: bool = False
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default, which vLLM uses); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _latency_samples(ok: list[RequestResult]) -> dict[str, list[float]]:
    """Per-figure samples in ms; ITL pools every gap of every request, as vLLM does."""
    return {
        "ttft": [r.ttft_s * 1e3 for r in ok],
        "itl": [gap * 1e3 for r in ok for gap in r.itl_s],
        "tpot": [
            (r.e2e_s - r.ttft_s) * 1e3 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1
        ],
        "e2e": [r.e2e_s * 1e3 for r in ok],
    }


def summarize_level(spec: LevelSpec, results: list[RequestResult], duration_s: float) -> Result:
    """The level's figures; failed requests only count in `failed`."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens or spec.input_len for r in ok)
    duration_s = max(duration_s, 1e-9)
    level: Result = {
        "sweep": spec.sweep,
        "concurrency": spec.concurrency,
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        # Sanity checks: a server that re-tokenizes the ids or stops at EOS measures less work.
        "prompt_len_mismatch": sum(
            r.prompt_tokens is not None and r.prompt_tokens != spec.input_len for r in ok
        ),
        "output_len_mismatch": sum(r.output_tokens != spec.output_len for r in ok),
        "first_error": next((r.error for r in results if r.error), None),
    }
    for name, samples in _latency_samples(ok).items():
        level[f"{name}_mean_ms"] = statistics.fmean(samples) if samples else None
        for q in PERCENTILES:
            level[f"{name}_p{q}_ms"] = percentile(samples, q)
    level["counts"] = level_counts(level)
    return level


def level_counts(level: Result) -> bool:
    """Whether a level's figures may be quoted: every request it sent succeeded."""
    return bool(level.get("completed")) and not level.get("failed")


def merge_repeats(runs: list[list[Result]]) -> list[Result]:
    """One level list from N sweeps: counts add up, every other figure is the median."""
    merged = []
    for levels in zip(*runs, strict=True):
        level: Result = {"repeats": len(levels)}
        for key, first in levels[0].items():
            values = [lv[key] for lv in levels if lv.get(key) is not None]
            if key in IDENTITY_KEYS:
                level[key] = first
            elif key == "counts":
                continue  # recomputed from the summed counts below
            elif key in COUNT_KEYS:
                level[key] = sum(values)
            elif values and all(isinstance(v, int | float) for v in values):
                level[key] = statistics.median(values)
            else:
                level[key] = values[0] if values else None
        level["counts"] = level_counts(level)
        merged.append(level)
    return merged


def level_warnings(level: Result) -> list[str]:
    """Say when the server did less work than asked, which would flatter its figures."""
    warnings = []
    if level.get("prompt_len_mismatch"):
        warnings.append(
            f"{level['prompt_len_mismatch']} response(s) reported prompt_tokens != "
            f"{level['input_len']} (token-id prompts not taken as sent?)"
        )
    if level.get("output_len_mismatch"):
        warnings.append(
            f"{level['output_len_mismatch']} response(s) had output tokens != "
            f"{level['output_len']} (ignore_eos not honoured, or usage missing with "
            "multi-token chunks?)"
        )
    return warnings


def sweep_verdicts(levels: list[Result]) -> dict[str, Result]:
    """Per sweep: failed requests over its levels, and whether the sweep counts (none did)."""
    verdicts: dict[str, Result] = {}
    for level in levels:
        entry = verdicts.setdefault(level.get("sweep") or "concurrency", {"failed": 0})
        entry["failed"] += level.get("failed", 0)
        entry["counts"] = entry.get("counts", True) and level_counts(level)
    return verdicts


def total_failed(result: Result) -> int:
    """Failed requests over every level (and repeat) of a result."""
    return sum(level.get("failed", 0) for level in result["levels"])
