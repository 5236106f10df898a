"""Ratios of one server's figures to another's, level by level.

Issue 7 states its goal as ratios to vLLM-CPU measured in the same run: output tok/s (higher
is better for hearth), TTFT p50 and ITL p50 (lower is better). Two helpers shape the sides
first: several passes of one server (a sandwich: hearth, vLLM, hearth) become their
per-level median, and several vLLM dtypes become, per level, the one with the highest
output tok/s ("the better vLLM counts"). A ratio whose levels had failed requests is kept
but marked as not counting.
"""

from __future__ import annotations

from collections.abc import Sequence

from container.bench.results import level_key, sort_levels
from container.bench.stats import Result, merge_repeats

# (name in a ratio record, level key, header in the tables)
RATIO_FIGURES: tuple[tuple[str, str, str], ...] = (
    ("output_throughput", "output_throughput", "out tok/s"),
    ("ttft_p50", "ttft_p50_ms", "TTFT p50"),
    ("itl_p50", "itl_p50_ms", "ITL p50"),
)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare_ratios(ours: Result, other: Result) -> list[Result]:
    """Per level both ran (same sweep and x): our figure over theirs, and whether it counts."""
    theirs = {level_key(level): level for level in other["levels"]}
    ratios = []
    for level in ours["levels"]:
        base = theirs.get(level_key(level))
        if base is None:
            continue
        record: Result = {
            "sweep": level_key(level)[0],
            "concurrency": level["concurrency"],
            "input_len": level.get("input_len"),
            "baseline": base.get("source", other["label"]),
            "counts": bool(level.get("counts", True) and base.get("counts", True)),
        }
        for name, key, _ in RATIO_FIGURES:
            record[name] = _ratio(level.get(key), base.get(key))
        ratios.append(record)
    return ratios


def median_of_passes(passes: Sequence[Result], label: str) -> Result:
    """One result from several passes of one server: per level, the median of each figure.

    A level only some passes ran is taken from those. `passes` names the labels merged.
    """
    by_key: dict[tuple[str, int], list[Result]] = {}
    for result in passes:
        for level in result["levels"]:
            by_key.setdefault(level_key(level), []).append(level)
    levels = [merge_repeats([[lv] for lv in group])[0] for group in by_key.values()]
    return {
        "label": label,
        "passes": [result["label"] for result in passes],
        "levels": sort_levels(levels),
    }


def best_per_level(results: Sequence[Result], label: str) -> Result:
    """Per level, the result with the highest output tok/s among those that count.

    A level where none counts takes the best that does not, still marked as not counting.
    Each level says in `source` which result it came from.
    """
    by_key: dict[tuple[str, int], list[tuple[Result, str]]] = {}
    for result in results:
        for level in result["levels"]:
            by_key.setdefault(level_key(level), []).append((level, result["label"]))
    levels = []
    for group in by_key.values():
        level, source = max(
            group,
            key=lambda item: (
                bool(item[0].get("counts", True)),
                item[0].get("output_throughput") or 0.0,
            ),
        )
        levels.append({**level, "source": source})
    return {"label": label, "levels": sort_levels(levels)}
