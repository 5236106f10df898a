"""Saved results read back: an earlier `hearth bench` results.json or a vLLM result file.

`--compare FILE` puts such a run beside this one. Files of the first schema (concurrency
sweep only, no `sweep` on a level) and `vllm bench serve --save-result` files (one level
each) are mapped onto the current level layout, so every table and ratio treats them alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from container.bench.config import SWEEP_CONCURRENCY, SWEEP_PROMPT_LEN, SWEEPS
from container.bench.stats import Result, level_counts


def level_key(level: Result) -> tuple[str, int]:
    """(sweep, the value it varies): what lines up a level of one server with another's."""
    sweep = level.get("sweep") or SWEEP_CONCURRENCY
    x = level.get("input_len") if sweep == SWEEP_PROMPT_LEN else level.get("concurrency")
    return sweep, int(x or 0)


def sort_levels(levels: list[Result]) -> list[Result]:
    """Concurrency sweep first, each sweep by its x."""
    order = {name: i for i, name in enumerate(SWEEPS)}
    return sorted(levels, key=lambda lv: (order.get(level_key(lv)[0], 99), level_key(lv)[1]))


def sweeps_in(results: Sequence[Result]) -> list[str]:
    """The sweeps any of the results ran, in their run order."""
    present = {level_key(lv)[0] for r in results for lv in r["levels"]}
    return [s for s in SWEEPS if s in present] + sorted(present - set(SWEEPS))


def load_results(path: str | Path) -> Result:
    """A results.json from an earlier `hearth bench`, or a `vllm bench serve --save-result`
    file (one level each; same-label files are merged by `merge_results`)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and isinstance(data.get("levels"), list):
        result = {k: v for k, v in data.items() if k not in ("compare", "runs", "ratios", "host")}
        result["levels"] = [_normalize(level) for level in result["levels"]]
        return result
    if isinstance(data, dict) and "output_throughput" in data:
        return _from_vllm(data, Path(path))
    raise ValueError(f"{path}: neither a hearth bench results.json nor a vLLM result file")


def _normalize(level: Result) -> Result:
    """Levels of the first schema were all of the concurrency sweep and had no verdict."""
    level = {"sweep": SWEEP_CONCURRENCY, **level}
    level.setdefault("counts", level_counts(level))
    return level


_VLLM_KEYS = {"ttft": "ttft", "itl": "itl", "tpot": "tpot", "e2e": "e2el"}


def _from_vllm(data: dict[str, Any], path: Path) -> Result:
    """Map vLLM's `median_ttft_ms`-style keys onto ours."""
    level: Result = {
        "sweep": SWEEP_CONCURRENCY,
        "concurrency": data.get("max_concurrency") or 0,
        "input_len": data.get("random_input_len"),
        "num_prompts": data.get("num_prompts", data.get("completed", 0)),
        "completed": data.get("completed", 0),
        "failed": data.get("failed", 0),
        "duration_s": data.get("duration", 0.0),
        "total_output_tokens": data.get("total_output_tokens", 0),
        "request_throughput": data.get("request_throughput"),
        "output_throughput": data.get("output_throughput"),
        "total_token_throughput": data.get("total_token_throughput"),
    }
    for ours, theirs in _VLLM_KEYS.items():
        level[f"{ours}_mean_ms"] = data.get(f"mean_{theirs}_ms")
        level[f"{ours}_p50_ms"] = data.get(f"median_{theirs}_ms")
        for q in (90, 99):
            level[f"{ours}_p{q}_ms"] = data.get(f"p{q}_{theirs}_ms")
    level["counts"] = level_counts(level)
    label = data.get("label") or data.get("backend") or path.stem
    return {"schema": "vllm-bench-serve", "label": str(label), "levels": [level]}


def merge_results(results: list[Result]) -> list[Result]:
    """Join results with one label (e.g. one vLLM file per concurrency) into one entry."""
    by_label: dict[str, Result] = {}
    for result in results:
        entry = by_label.setdefault(result["label"], {**result, "levels": []})
        entry["levels"] = entry["levels"] + list(result["levels"])
    for entry in by_label.values():
        entry["levels"] = sort_levels(entry["levels"])
    return list(by_label.values())
