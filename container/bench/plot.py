"""results.svg: tok/s, TTFT p50 and ITL p50 against concurrency and against prompt length.

A row of three panels per sweep, a bar per server in each group, so several servers (hearth,
vLLM at each dtype, hearth again) share one plot. Hand-written SVG because matplotlib is not
a dependency; bars rather than lines since the levels are few and categorical. A level with
failed requests is drawn pale and marked `!`: it does not count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from container.bench.config import SWEEP_PROMPT_LEN
from container.bench.results import level_key, sweeps_in
from container.bench.stats import Result

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1")
PANEL_W, PANEL_H, MARGIN_L, MARGIN_T, MARGIN_B, GAP = 400, 290, 60, 60, 45, 20
LEGEND_H = 30
# (level key, panel title) of the three panels of a row.
FIGURES = (
    ("output_throughput", "output tokens/s (higher is better)"),
    ("ttft_p50_ms", "TTFT p50, ms (lower is better)"),
    ("itl_p50_ms", "ITL p50, ms (lower is better)"),
)


def _axis(value: float, max_ticks: int = 5) -> tuple[float, int]:
    """Tick step (1, 2, 2.5 or 5 x 10^k) and tick count so the axis ends just above `value`."""
    if value <= 0:
        return 1.0, 1
    rough = value / max_ticks
    exponent = 10 ** math.floor(math.log10(rough))
    step = next(m * exponent for m in (1, 2, 2.5, 5, 10) if m * exponent >= rough)
    return step, max(1, math.ceil(value / step - 1e-9))


def _panel(
    results: Sequence[Result], sweep: str, key: str, title: str, x0: float, y0: float
) -> list[str]:
    """One grouped bar chart: a group per level of `sweep`, a bar per result."""
    levels = {
        (i, level_key(lv)[1]): lv
        for i, r in enumerate(results)
        for lv in r["levels"]
        if level_key(lv)[0] == sweep
    }
    xs = sorted({x for _, x in levels})
    step, ticks = _axis(max((lv.get(key) or 0.0 for lv in levels.values()), default=0.0))
    top = step * ticks
    plot_w, plot_h = PANEL_W - MARGIN_L - 10, PANEL_H - MARGIN_T - MARGIN_B
    left, base = x0 + MARGIN_L, y0 + MARGIN_T + plot_h
    out = [
        f'<text x="{x0 + PANEL_W / 2}" y="{y0 + MARGIN_T - 20}" class="title">'
        f"{escape(title)}</text>"
    ]
    for tick in range(ticks + 1):
        y = base - plot_h * tick / ticks
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" class="grid"/>'
        )
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" class="ytick">{step * tick:g}</text>')
    prefix = "in=" if sweep == SWEEP_PROMPT_LEN else "c="
    group_w = plot_w / max(len(xs), 1)
    bar_w = group_w * 0.8 / max(len(results), 1)
    for g, x_value in enumerate(xs):
        gx = left + g * group_w + group_w * 0.1
        out.append(
            f'<text x="{gx + group_w * 0.4:.1f}" y="{base + 18}" class="xtick">'
            f"{prefix}{x_value}</text>"
        )
        for i in range(len(results)):
            level = levels.get((i, x_value))
            value = level.get(key) if level else None
            if level is None or value is None:
                continue
            counts = level.get("counts", True)
            h = plot_h * value / top
            x = gx + i * bar_w
            opacity = "" if counts else ' fill-opacity="0.3"'
            out.append(
                f'<rect x="{x:.1f}" y="{base - h:.1f}" width="{max(bar_w - 2, 1):.1f}" '
                f'height="{h:.1f}" fill="{PALETTE[i % len(PALETTE)]}"{opacity}/>'
            )
            mark = "" if counts else "!"
            out.append(
                f'<text x="{x + bar_w / 2 - 1:.1f}" y="{base - h - 4:.1f}" '
                f'class="value">{value:.3g}{mark}</text>'
            )
    out.append(f'<line x1="{left}" y1="{base}" x2="{left + plot_w}" y2="{base}" class="axis"/>')
    return out


def render_svg(results: Sequence[Result]) -> str:
    """The whole plot: a legend, then a row of panels per sweep the results ran."""
    sweeps = sweeps_in(results) or ["concurrency"]
    width = len(FIGURES) * PANEL_W + (len(FIGURES) - 1) * GAP
    height = LEGEND_H + len(sweeps) * (PANEL_H + 20)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
        "<style>.title{font-size:13px;font-weight:bold;text-anchor:middle}"
        ".row{font-size:14px;font-weight:bold}"
        ".ytick{font-size:10px;text-anchor:end}.xtick{font-size:11px;text-anchor:middle}"
        ".value{font-size:9px;text-anchor:middle}.legend{font-size:11px}"
        ".grid{stroke:#ddd}.axis{stroke:#333}</style>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for i, result in enumerate(results):
        x = MARGIN_L + i * 170
        parts.append(
            f'<rect x="{x}" y="8" width="12" height="12" fill="{PALETTE[i % len(PALETTE)]}"/>'
        )
        parts.append(
            f'<text x="{x + 16}" y="18" class="legend">{escape(str(result["label"]))}</text>'
        )
    cfg = results[0].get("config", {}) if results else {}
    if cfg:
        caption = f"{cfg.get('model')}, output {cfg.get('output_len')} tokens; ! = failures"
        parts.append(f'<text x="{width - 10}" y="18" class="ytick">{escape(caption)}</text>')
    for row, sweep in enumerate(sweeps):
        y0 = LEGEND_H + row * (PANEL_H + 20)
        parts.append(f'<text x="10" y="{y0 + 18}" class="row">{escape(sweep)} sweep</text>')
        for col, (key, title) in enumerate(FIGURES):
            parts += _panel(results, sweep, key, title, col * (PANEL_W + GAP), y0)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
