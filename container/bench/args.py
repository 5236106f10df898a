"""The arguments of `hearth bench`: parser, checks, and the `BenchConfig` they make.

Kept apart from `cli.py` (which runs the servers and reports) so the flag surface reads on
its own, and so argument handling is testable without starting anything.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from urllib.parse import urlsplit

from container.bench import anchor
from container.bench.config import (
    DEFAULT_CONCURRENCIES,
    DEFAULT_PROMPT_LEN_CONCURRENCY,
    DEFAULT_PROMPT_LENS,
    SWEEP_CONCURRENCY,
    SWEEP_PROMPT_LEN,
    SWEEPS,
    BenchConfig,
)
from container.help_format import HelpFormatter

COMPARE_VLLM = "vllm"  # `--compare` with no file: run the vLLM-CPU anchor in this run


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `hearth bench` subcommand and its arguments, grouped as `--help` shows them."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server (vllm bench serve method)",
        description=(
            "Benchmark any OpenAI-compatible server the way `vllm bench serve` does with the "
            "random dataset: prompts of exactly the given number of random token ids, output "
            "tokens with EOS ignored, streamed from /v1/completions, every request of a level "
            "submitted at once behind a fixed concurrency. Two sweeps: concurrency (at "
            "--input-len) and prompt length (at --prompt-len-concurrency). With --compare, "
            "vLLM-CPU is started in the same run (after the server under test is stopped) and "
            "ratios are printed. Writes results.json, results.md and results.svg to "
            "--output-dir and prints a table. Exit code: 0 all requests succeeded, 1 some "
            "failed (those levels do not count), 2 a server could not be reached or started."
        ),
        formatter_class=HelpFormatter,
    )
    _add_server_args(parser.add_argument_group("server"))
    _add_load_args(parser.add_argument_group("load"))
    _add_compare_args(parser.add_argument_group("comparison"))
    report = parser.add_argument_group("report")
    report.add_argument(
        "--label",
        default=None,
        help="name in the table; default: 'hearth' with --spawn-server, "
        "else the server's host:port",
    )
    report.add_argument("--output-dir", default=".bench", help="where the result files go")
    report.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between live progress lines within a level",
    )
    return parser


def _add_server_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server to benchmark (ignored with --spawn-server)",
    )
    group.add_argument(
        "--model", default=None, help="model name to send; default: the first id of GET /v1/models"
    )
    group.add_argument("--api-key", default=None, help="bearer token; default: $OPENAI_API_KEY")
    group.add_argument(
        "--spawn-server",
        action="store_true",
        help="start `hearth serve` on a free loopback port, benchmark it, "
        "stop it (its log goes to OUTPUT_DIR/server-LABEL.log)",
    )
    group.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="extra `hearth serve` arguments for --spawn-server, split like a "
        "shell; repeatable. Use the = form for flags: --server-arg='--max-num-seqs 32'",
    )
    group.add_argument(
        "--server-timeout",
        type=float,
        default=900.0,
        metavar="S",
        help="seconds to wait for a spawned server to be ready (vLLM-CPU takes minutes)",
    )


def _add_load_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--sweeps",
        default=",".join(SWEEPS),
        metavar="LIST",
        help=f"comma-separated sweeps to run, of: {', '.join(SWEEPS)}",
    )
    group.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=list(DEFAULT_CONCURRENCIES),
        metavar="C",
        help="levels of the concurrency sweep, run in order",
    )
    group.add_argument(
        "--num-prompts",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="requests per concurrency level: one value for all, or one per level; default 8 "
        "at c=1, 4*c up to 16, 2*c above (--quick: 4 at c=1, else c)",
    )
    group.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    group.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    group.add_argument(
        "--prompt-lens",
        type=int,
        nargs="+",
        default=list(DEFAULT_PROMPT_LENS),
        metavar="L",
        help="prompt lengths of the prompt-length sweep",
    )
    group.add_argument(
        "--prompt-len-concurrency",
        type=int,
        default=DEFAULT_PROMPT_LEN_CONCURRENCY,
        metavar="C",
        help="concurrency of the prompt-length sweep",
    )
    group.add_argument(
        "--prompt-len-num-prompts",
        type=int,
        default=None,
        metavar="N",
        help="requests per prompt length; default as for its concurrency",
    )
    group.add_argument(
        "--quick",
        action="store_true",
        help="fewer requests per level (one wave: 4 at c=1, else c) so both sweeps fit a "
        "few minutes; rougher figures, for checking, not for quoting",
    )
    group.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    group.add_argument(
        "--vocab-size",
        type=int,
        default=49152,
        help="prompt token ids are drawn from [1000, VOCAB_SIZE-1000)",
    )
    group.add_argument(
        "--warmup",
        type=int,
        default=1,
        metavar="N",
        help="untimed requests before each server's sweeps (vLLM's initial test run)",
    )
    group.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the sweeps N times per server and report the median of each figure",
    )
    group.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="per-request timeout"
    )


def _add_compare_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--compare",
        action="append",
        nargs="?",
        const=COMPARE_VLLM,
        default=[],
        metavar="JSON",
        help="alone: also run the vLLM-CPU anchor in this run (needs --spawn-server; one "
        "server at a time) and print ratios. With a file: put a previous results.json (or "
        "vLLM --save-result file) beside this run, with ratios. Repeatable",
    )
    group.add_argument(
        "--compare-dtypes",
        default="float32",
        metavar="LIST",
        help="vLLM --dtype values to run in turn (e.g. float32,bfloat16); the better vLLM per "
        "level (highest out tok/s) counts for the ratios",
    )
    group.add_argument(
        "--sandwich",
        action="store_true",
        help="run hearth again after the baselines (hearth, vLLM, hearth) so host drift "
        "shows; ratios use the median of the two hearth passes",
    )
    group.add_argument(
        "--anchor-dir",
        default=None,
        metavar="DIR",
        help="where setup-vllm-cpu.sh put vLLM and the model; default: $BASE or "
        "~/.cache/hearth-anchors",
    )
    group.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="extra `vllm serve` arguments, split like a shell; repeatable",
    )


def parse_sweeps(value: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    unknown = [name for name in names if name not in SWEEPS]
    if unknown or not names:
        raise ValueError(f"--sweeps takes a comma list of {', '.join(SWEEPS)}; got {value!r}")
    return names


def parse_dtypes(value: str) -> list[str]:
    dtypes = [name.strip() for name in value.split(",") if name.strip()]
    if not dtypes:
        raise ValueError("--compare-dtypes needs at least one dtype")
    return dtypes


def build_config(args: argparse.Namespace, base_url: str, model: str) -> BenchConfig:
    sweeps = parse_sweeps(args.sweeps)
    return BenchConfig(
        base_url=base_url,
        model=model,
        concurrencies=tuple(args.concurrency) if SWEEP_CONCURRENCY in sweeps else (),
        num_prompts=tuple(args.num_prompts or ()) if SWEEP_CONCURRENCY in sweeps else (),
        input_len=args.input_len,
        output_len=args.output_len,
        prompt_lens=tuple(args.prompt_lens) if SWEEP_PROMPT_LEN in sweeps else (),
        prompt_len_concurrency=args.prompt_len_concurrency,
        prompt_len_num_prompts=args.prompt_len_num_prompts or 0,
        quick=args.quick,
        seed=args.seed,
        vocab_size=args.vocab_size,
        api_key=args.api_key,
        warmup=args.warmup,
        timeout_s=args.timeout,
        progress_interval_s=args.progress_interval,
    )


def default_label(args: argparse.Namespace) -> str:
    if args.label:
        return str(args.label)
    if args.spawn_server:
        return "hearth"
    return urlsplit(args.base_url).netloc or args.base_url


def validate(args: argparse.Namespace) -> BenchConfig:
    """Fail on bad arguments before a server is started or a request sent."""
    config = build_config(args, args.base_url, "-")
    if args.repeat < 1 or args.warmup < 0:
        raise ValueError("--repeat must be >= 1 and --warmup >= 0")
    if args.prompt_len_num_prompts is not None and args.prompt_len_num_prompts < 1:
        raise ValueError("--prompt-len-num-prompts must be >= 1")
    parse_dtypes(args.compare_dtypes)
    if (COMPARE_VLLM in args.compare or args.sandwich) and not args.spawn_server:
        raise ValueError(
            "--compare (vLLM) and --sandwich start and stop each server in turn, so they "
            "need --spawn-server: two servers at once would measure each other"
        )
    if COMPARE_VLLM in args.compare:
        anchor.check_anchor(anchor_dir(args))
    return config


def anchor_dir(args: argparse.Namespace) -> Path:
    return Path(args.anchor_dir) if args.anchor_dir else anchor.default_anchor_dir()
