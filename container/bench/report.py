"""Results as text: the stdout table, results.md, the ratio lines and results.json.

One table per sweep, the servers of a run side by side per level. A level with failed
requests is flagged `!` and its ratios are marked as not counting: its figures describe a
server that did less work than asked. The plot is `plot.py`'s job.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from container.bench.compare import RATIO_FIGURES, compare_ratios
from container.bench.config import SWEEP_PROMPT_LEN
from container.bench.host import describe_host
from container.bench.plot import render_svg
from container.bench.results import level_key, sweeps_in
from container.bench.stats import Result

# (header, key, format) of the stdout and Markdown tables; latencies in ms.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.1f}"),
    ("TTFT p99", "ttft_p99_ms", "{:.1f}"),
    ("ITL p50", "itl_p50_ms", "{:.1f}"),
    ("ITL p99", "itl_p99_ms", "{:.1f}"),
    ("TPOT p50", "tpot_p50_ms", "{:.1f}"),
    ("E2E p50", "e2e_p50_ms", "{:.1f}"),
)
FAILED_MARK = "!"
FAILED_NOTE = f"{FAILED_MARK} requests failed: this level does not count"


def fmt(value: Any, spec: str = "{:.1f}") -> str:
    return "-" if value is None else spec.format(value)


def level_line(level: Result) -> str:
    """The one-line summary printed when a level finishes."""
    verdict = "" if level.get("counts", True) else " (failures: does not count)"
    return (
        f"c={level['concurrency']} in={level.get('input_len')}: "
        f"{level['completed']}/{level['num_prompts']} ok in {level['duration_s']:.1f} s, "
        f"{level['output_throughput']:.1f} out tok/s, TTFT p50 {fmt(level.get('ttft_p50_ms'))} "
        f"ms, ITL p50 {fmt(level.get('itl_p50_ms'))} ms{verdict}"
    )


def sweep_title(sweep: str, results: Sequence[Result]) -> str:
    """`concurrency sweep: 128 in / 128 out` or `prompt-len sweep: c=16, 128 out`."""
    levels = [lv for r in results for lv in r["levels"] if level_key(lv)[0] == sweep]
    out = {lv.get("output_len") for lv in levels} - {None}
    out_text = "/".join(str(x) for x in sorted(out)) or "?"
    if sweep == SWEEP_PROMPT_LEN:
        concs = "/".join(str(c) for c in sorted({lv["concurrency"] for lv in levels}))
        return f"{sweep} sweep: c={concs}, {out_text} out"
    ins = "/".join(str(x) for x in sorted({lv.get("input_len") for lv in levels} - {None}))
    return f"{sweep} sweep: {ins or '?'} in / {out_text} out"


def table_rows(results: Sequence[Result], sweep: str) -> list[list[str]]:
    """Header and one row per (x, label) of one sweep: labels side by side per level."""
    x_name = "in" if sweep == SWEEP_PROMPT_LEN else "conc"
    rows = [["label", x_name, "ok/n", *(header for header, _, _ in COLUMNS)]]
    entries = [
        (level_key(lv)[1], i, r["label"], lv)
        for i, r in enumerate(results)
        for lv in r["levels"]
        if level_key(lv)[0] == sweep
    ]
    for x, _, label, level in sorted(entries, key=lambda e: (e[0], e[1])):
        ok_n = f"{level.get('completed', 0)}/{level.get('num_prompts', 0)}"
        if not level.get("counts", True):
            ok_n += FAILED_MARK
        cells = [fmt(level.get(key), spec) for _, key, spec in COLUMNS]
        rows.append([label, str(x), ok_n, *cells])
    return rows


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _has_failures(results: Sequence[Result]) -> bool:
    return any(not lv.get("counts", True) for r in results for lv in r["levels"])


def sweep_failures(results: Sequence[Result], sweep: str) -> list[str]:
    """`hearth: 2 request(s) failed in the prompt-len sweep; it does not count` per result."""
    lines = []
    for result in results:
        levels = [lv for lv in result["levels"] if level_key(lv)[0] == sweep]
        failed = sum(lv.get("failed", 0) for lv in levels)
        if failed or not all(lv.get("counts", True) for lv in levels):
            lines.append(
                f"{result['label']}: {failed} request(s) failed in the {sweep} sweep; "
                "it does not count"
            )
    return lines


def format_table(results: Sequence[Result]) -> str:
    """Aligned plain-text tables for stdout, one per sweep; latencies in ms."""
    lines: list[str] = []
    for sweep in sweeps_in(results):
        if lines:
            lines.append("")
        lines.append(sweep_title(sweep, results))
        lines += _aligned(table_rows(results, sweep))
        lines += [f"{FAILED_MARK} {line}" for line in sweep_failures(results, sweep)]
    lines.append("(latencies in ms)")
    if _has_failures(results):
        lines.append(f"({FAILED_NOTE})")
    return "\n".join(lines)


def _ratio_level(ratio: Result) -> str:
    if ratio["sweep"] == SWEEP_PROMPT_LEN:
        return f"in={ratio['input_len']} c={ratio['concurrency']}"
    return f"c={ratio['concurrency']}"


def ratio_rows(ours: Result, other: Result) -> list[list[str]]:
    """Header and one row per level both ran: our figure over theirs, and whether it counts.

    `vs` names the baseline's source when it is a per-level pick (the best vLLM dtype).
    """
    rows = [["level", *(header for _, _, header in RATIO_FIGURES), "counts", "vs"]]
    for r in compare_ratios(ours, other):
        cells = [fmt(r[key], "{:.2f}x") for key, _, _ in RATIO_FIGURES]
        verdict = "yes" if r["counts"] else "no (failures)"
        rows.append([_ratio_level(r), *cells, verdict, str(r["baseline"])])
    return rows


def ratio_title(ours: Result, other: Result) -> str:
    """`ratios hearth / vllm-float32 (hearth = median of hearth-1, hearth-2)`."""
    title = f"ratios {ours['label']} / {other['label']}"
    if ours.get("passes"):
        title += f" ({ours['label']} = median of {', '.join(ours['passes'])})"
    return title + "; out tok/s: higher is better for the first, TTFT and ITL: lower"


def format_ratios(ours: Result, other: Result) -> str:
    """An aligned table of our figures over theirs, one row per level both ran."""
    rows = ratio_rows(ours, other)
    if len(rows) == 1:
        return f"{ours['label']}/{other['label']}: no level in common"
    return "\n".join(_aligned(rows))


def format_markdown(
    result: Result,
    compare: Sequence[Result] = (),
    host: dict[str, Any] | None = None,
    pairs: Sequence[tuple[Result, Result]] = (),
) -> str:
    """results.md: parameters, host, one table per sweep, and the ratio lines of each pair."""
    cfg = result.get("config", {})
    results = [result, *compare]
    lines = [
        f"# hearth bench: {', '.join(str(r['label']) for r in results)}",
        "",
        f"- server: {cfg.get('base_url')}, model `{cfg.get('model')}`",
        f"- random token-id prompts, EOS ignored, streamed /v1/completions, seed "
        f"{cfg.get('seed')}, request rate inf{', --quick' if cfg.get('quick') else ''}",
        f"- run {result.get('created')}, repeat {result.get('repeat', 1)} (median of repeats)",
        "- latencies in ms; output tok/s = output tokens / wall time of the level",
    ]
    if host:
        lines.append(f"- host: {describe_host(host)}")
    for r in results:
        server = r.get("server") or {}
        notes = []
        if server.get("ready_s") is not None:
            notes.append(f"ready {server['ready_s']:.0f} s after start")
        if server.get("loadavg_at_start") is not None:
            notes.append(f"host load average {server['loadavg_at_start']} when its pass began")
        if notes:
            lines.append(f"- {r['label']}: {', '.join(notes)}")
    for sweep in sweeps_in(results):
        rows = table_rows(results, sweep)
        lines += [
            "",
            f"## {sweep_title(sweep, results)}",
            "",
            "| " + " | ".join(rows[0]) + " |",
            "|" + "|".join("---" for _ in rows[0]) + "|",
            *("| " + " | ".join(row) + " |" for row in rows[1:]),
        ]
        failures = sweep_failures(results, sweep)
        if failures:
            lines += ["", *(f"- **{line}**" for line in failures)]
    if _has_failures(results):
        lines += ["", f"{FAILED_NOTE.replace(FAILED_MARK, '`!`', 1)}."]
    for ours, other in pairs:
        rows = ratio_rows(ours, other)
        lines += [
            "",
            "## R" + ratio_title(ours, other)[1:],
            "",
            "| " + " | ".join(rows[0]) + " |",
            "|" + "|".join("---" for _ in rows[0]) + "|",
            *("| " + " | ".join(row) + " |" for row in rows[1:]),
        ]
    return "\n".join(lines) + "\n"


def write_outputs(
    result: Result,
    compare: Sequence[Result],
    out_dir: str | Path,
    host: dict[str, Any] | None = None,
    pairs: Sequence[tuple[Result, Result]] = (),
) -> list[Path]:
    """Write results.json (the first server's result, the others under "compare", the host
    and the ratios), results.md and results.svg."""
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    record: Result = dict(result)
    if compare:
        record["compare"] = list(compare)
    if host:
        record["host"] = host
    if pairs:
        record["ratios"] = [
            {"ours": a["label"], "baseline": b["label"], "levels": compare_ratios(a, b)}
            for a, b in pairs
        ]
    files = {
        "results.json": json.dumps(record, indent=2) + "\n",
        "results.md": format_markdown(result, compare, host, pairs),
        "results.svg": render_svg([result, *compare]),
    }
    paths = []
    for name, text in files.items():
        path = directory / name
        path.write_text(text)
        paths.append(path)
    return paths
