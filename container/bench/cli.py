"""`hearth bench`: the command line around the benchmark package.

Kept apart from the measuring modules so they stay importable and testable without argparse,
and so `hearth serve` does not import the benchmark client. This module turns arguments
into a `BenchConfig` and a list of server passes (hearth, then vLLM-CPU at each dtype with
`--compare`, then hearth again with `--sandwich`), runs them one at a time, and reports.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx

from container.bench import anchor
from container.bench.args import (
    COMPARE_VLLM,
    add_bench_parser,
    anchor_dir,
    build_config,
    default_label,
    parse_dtypes,
    validate,
)
from container.bench.compare import best_per_level, median_of_passes
from container.bench.config import BenchConfig
from container.bench.host import describe_host, detect_host
from container.bench.load import auth_headers, log_stderr, run_benchmark
from container.bench.report import format_ratios, format_table, ratio_title, write_outputs
from container.bench.results import load_results, merge_results
from container.bench.server import ServerStartError, hearth_env, serve_command
from container.bench.session import (
    BASELINE,
    SUBJECT,
    Measure,
    ServerPlan,
    run_session,
    sandwich,
)
from container.bench.stats import Result, total_failed

EXIT_OK, EXIT_FAILED_REQUESTS, EXIT_SETUP = 0, 1, 2


# --------------------------------------------------------------------------- plans


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    """Register `hearth bench` on the `hearth` parser."""
    add_bench_parser(subparsers).set_defaults(func=run_bench)


def build_plans(args: argparse.Namespace, config: BenchConfig) -> list[ServerPlan]:
    """The servers of this run, in order: the subject, vLLM per dtype, the subject again."""
    label = default_label(args)
    if args.spawn_server:
        subject = ServerPlan(
            label=label,
            kind="hearth",
            command=lambda port: serve_command(port, args.server_arg, _context_len(config)),
            env=hearth_env(),
        )
    else:
        subject = ServerPlan(label=label, kind="url", base_url=args.base_url)
    baselines = []
    if COMPARE_VLLM in args.compare:
        anchor_home = anchor_dir(args)
        for dtype in parse_dtypes(args.compare_dtypes):
            baselines.append(
                ServerPlan(
                    label=f"vllm-{dtype}",
                    role=BASELINE,
                    kind="vllm",
                    command=_vllm_command(anchor_home, dtype, config, args.vllm_arg),
                    env=anchor.vllm_env(),
                    ready_path=anchor.READY_PATH,
                    extra={"dtype": dtype},
                )
            )
    return sandwich(subject, baselines, again=args.sandwich)


def _context_len(config: BenchConfig) -> int:
    """Both servers get the same context: serve-vllm-cpu.sh's 2048, or what the longest
    prompt-length level needs."""
    return max(anchor.DEFAULT_MAX_MODEL_LEN, config.max_total_len)


def _vllm_command(
    anchor_dir: Path, dtype: str, config: BenchConfig, extra: list[str]
) -> Callable[[int], list[str]]:
    return lambda port: anchor.vllm_command(anchor_dir, port, dtype, _context_len(config), extra)


# --------------------------------------------------------------------------- running


def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model id of GET /v1/models, the name vLLM's client would also be given."""
    with httpx.Client(timeout=30.0, trust_env=False) as client:
        response = client.get(f"{base_url.rstrip('/')}/v1/models", headers=auth_headers(api_key))
    if response.status_code != 200:
        raise ServerStartError(
            f"GET /v1/models answered {response.status_code}: {response.text[:300]}"
        )
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, LookupError, TypeError):
        raise ServerStartError(
            f"GET /v1/models listed no model id ({response.text[:200]}); pass --model"
        ) from None


def _measurer(args: argparse.Namespace) -> Measure:
    """What measures one server of the run; baselines get no key and their own model name."""

    def measure(base_url: str, plan: ServerPlan, index: int) -> Result:
        is_subject = plan.role == SUBJECT
        api_key = args.api_key if is_subject else None
        model = (args.model if is_subject else None) or discover_model(base_url, api_key)
        log_stderr(f"benchmarking {plan.label}: {model} at {base_url}")
        config = build_config(args, base_url, model)
        if not is_subject:
            config = replace(config, api_key=None)
        return run_benchmark(config, plan.label, repeat=args.repeat, pass_key=str(index))

    return measure


def run_bench(args: argparse.Namespace) -> int:
    """Entry point of `hearth bench`; returns the exit code."""
    if args.api_key is None:  # read here, not as the default, so --help never shows it
        args.api_key = os.environ.get("OPENAI_API_KEY") or None
    try:
        config = validate(args)
        files = [path for path in args.compare if path != COMPARE_VLLM]
        saved = merge_results([load_results(path) for path in files])
    except (ValueError, OSError) as exc:
        print(f"hearth bench: {exc}", file=sys.stderr)
        return EXIT_SETUP
    host = detect_host()
    log_stderr(f"host: {describe_host(host)}")
    plans = build_plans(args, config)
    try:
        results, error = run_session(
            plans, _measurer(args), args.output_dir, args.server_timeout, log_stderr
        )
    except (ServerStartError, httpx.HTTPError, ValueError) as exc:
        print(f"hearth bench: {exc}", file=sys.stderr)
        return EXIT_SETUP
    if not results:
        print(f"hearth bench: {error}", file=sys.stderr)
        return EXIT_SETUP
    code = report(results, saved, host, args.output_dir)  # what ran is reported either way
    if error:
        print(
            f"hearth bench: {error} (later servers of the run were not measured)", file=sys.stderr
        )
        return EXIT_SETUP
    return code


def ratio_pairs(results: list[Result], saved: list[Result]) -> list[tuple[Result, Result]]:
    """(ours, baseline) pairs to print ratios for.

    Ours: the subject, or the median of its passes in a sandwich. Baselines: each vLLM dtype,
    the best of them per level when there are several, and each saved file. In a sandwich,
    last the second subject pass over the first: how far the host drifted meanwhile.
    """
    subjects = [r for r in results if r["server"]["role"] == SUBJECT]
    baselines = [r for r in results if r["server"]["role"] == BASELINE]
    ours = subjects[0]
    if len(subjects) > 1:
        ours = median_of_passes(subjects, subjects[0]["label"].removesuffix("-1"))
    pairs = [(ours, other) for other in baselines]
    if len(baselines) > 1:
        pairs.append((ours, best_per_level(baselines, "best vllm")))
    pairs += [(ours, other) for other in saved]
    if len(subjects) > 1:  # host drift: the last subject pass over the first (1.00x: none)
        pairs.append((subjects[-1], subjects[0]))
    return pairs


def report(
    results: list[Result], saved: list[Result], host: dict[str, object], output_dir: str
) -> int:
    """Write the files, print the tables and ratios; the exit code says if requests failed."""
    pairs = ratio_pairs(results, saved)
    compare = [*results[1:], *saved]
    paths = write_outputs(results[0], compare, output_dir, host, pairs)
    print(format_table([results[0], *compare]))
    for ours, other in pairs:
        print(f"\n{ratio_title(ours, other)}:")
        print(format_ratios(ours, other))
    print(f"\nhost: {describe_host(host)}")
    print("wrote " + ", ".join(str(p) for p in paths))
    failed = sum(total_failed(result) for result in results)
    if failed:
        print(
            f"hearth bench: {failed} request(s) failed; levels marked ! do not count",
            file=sys.stderr,
        )
        return EXIT_FAILED_REQUESTS
    return EXIT_OK
