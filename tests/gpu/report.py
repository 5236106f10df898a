"""The Markdown summary of a device check (``gpu-check.md``), from its JSON result."""

from __future__ import annotations

from typing import Any


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def markdown(result: dict[str, Any]) -> str:
    secs = result["sections"]
    lines = [
        f"# hearth device check{' (CPU dry run)' if result['dry_run'] else ''}",
        "",
        f"Total {result['seconds']} s.",
        "",
        "| section | status | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {s['status']} | {s.get('seconds', '')} |" for n, s in secs.items()]
    lines += ["", "Goals: " + ", ".join(f"{k}={v}" for k, v in result["goals_met"].items())]
    env = secs.get("env", {})
    if env.get("status") == "ok":
        keys = ("gpu", "torch", "triton", "transformers", "copy_bandwidth_gb_s")
        lines += ["", "Env: " + ", ".join(f"{k} {env[k]}" for k in keys if k in env)]
    ker = secs.get("kernels", {})
    if "tests" in ker:
        lines += [
            "",
            f"Kernels (pytest -m gpu): {ker['tests']} tests, {ker['failures']} failures, "
            f"{ker['errors']} errors, {ker['skipped']} skipped.",
        ]
    par = secs.get("parity", {})
    models = {k: v for k, v in par.items() if isinstance(v, dict)}
    if models:
        lines += [
            "",
            "| model | fp32 eager identical | fp32 graphs identical | bf16 top-1 | "
            "bf16 top-1 (clear margin) | bf16 KL |",
            "|---|---|---|---|---|---|",
        ]
        for name, m in models.items():
            tf = m["bf16_teacher_forced"]
            lines.append(
                f"| {name} | {m['fp32_greedy_eager']['identical']} | "
                f"{m['fp32_greedy_graphs']['identical']} | {_fmt(tf['top1_agreement'])} | "
                f"{_fmt(tf['top1_agreement_clear_margin'])} | {_fmt(tf['kl_nats_per_token'])} |"
            )
    tp = secs.get("throughput", {})
    if "transformers" in tp:
        hf = {r["concurrency"]: r["output_tok_s"] for r in tp["transformers"]}
        eager = {r["concurrency"]: r for r in tp["eager"]["rows"]}
        lines += [
            "",
            f"Throughput, {tp['model']}, {tp['in']} in / {tp['out']} out (tok/s; step ms):",
            "",
            "| c | graphs tok/s | eager tok/s | transformers tok/s | graphs step ms | "
            "eager step ms | roofline ms | roofline fraction (graphs) | step / weight read |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in tp["graphs"]["rows"]:
            c = r["concurrency"]
            e = eager.get(c, {})
            lines.append(
                f"| {c} | {_fmt(r['output_tok_s'])} | {_fmt(e.get('output_tok_s'))} | "
                f"{_fmt(hf.get(c))} | {_fmt(r['decode_step_ms'])} | "
                f"{_fmt(e.get('decode_step_ms'))} | {_fmt(r['roofline_step_ms'])} | "
                f"{_fmt(r['roofline_fraction'])} | {_fmt(r['step_over_weight_read'])} |"
            )
    srv = secs.get("server", {})
    if "chat_status" in srv:
        lines += [
            "",
            f"Server: chat {srv['chat_status']}, stream {srv['stream_status']} "
            f"({srv['stream_chunks']} chunks, same text as the chat: {srv['stream_equals_chat']}).",
        ]
    cpu = secs.get("cpu", {})
    if "tests" in cpu:
        lines += [
            "",
            f"CPU: {cpu['cpu']}, {cpu['cores']} cores, [{' '.join(cpu['flags'])}]; C kernel "
            f"variants {', '.join(cpu['variants']) or 'none'} (default {cpu['variant']}); their "
            f"tests: {cpu['tests']}, {cpu['failures']} failures, {cpu['errors']} errors, "
            f"{cpu['skipped']} skipped.",
        ]
    for name, s in secs.items():
        if s["status"] == "error":
            lines += ["", f"**{name} error**: `{s['error']}`"]
    return "\n".join(lines) + "\n"
