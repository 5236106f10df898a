"""`hearth bench`: the command line around `container.bench`.

Kept apart from `container/bench.py` so the measuring code stays importable and testable
without argparse, and so `hearth serve` does not import the benchmark client. This module
also owns `--spawn-server`: starting `hearth serve` on a free loopback port, waiting for it
to load the model, and stopping it the way a platform would (SIGTERM, then wait).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

import httpx

from container import bench

EXIT_OK, EXIT_FAILED_REQUESTS, EXIT_SETUP = 0, 1, 2


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the empty ones ("default: None" tells a reader nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    """Register `hearth bench` on the `hearth` parser."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server (vllm bench serve method)",
        description=(
            "Benchmark any OpenAI-compatible server the way `vllm bench serve` does with the "
            "random dataset: prompts of exactly --input-len random token ids, --output-len "
            "tokens with EOS ignored, streamed from /v1/completions, every request submitted "
            "at once behind a fixed concurrency. Writes results.json, results.md and "
            "results.svg to --output-dir and prints a table. Exit code: 0 all requests "
            "succeeded, 1 some failed, 2 the server could not be reached or started."
        ),
        formatter_class=_HelpFormatter,
    )
    target = parser.add_argument_group("server")
    target.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server to benchmark (ignored with --spawn-server)",
    )
    target.add_argument(
        "--model", default=None, help="model name to send; default: the first id of GET /v1/models"
    )
    target.add_argument(
        "--api-key",
        default=None,
        help="bearer token to send; default: $OPENAI_API_KEY",
    )
    target.add_argument(
        "--spawn-server",
        action="store_true",
        help="start `hearth serve` on a free loopback port, benchmark it, "
        "stop it (its log goes to OUTPUT_DIR/server.log)",
    )
    target.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="extra `hearth serve` arguments for --spawn-server, split like a "
        "shell; repeatable. Use the = form for flags: "
        "--server-arg='--max-num-seqs 32'",
    )
    target.add_argument(
        "--server-timeout",
        type=float,
        default=900.0,
        metavar="S",
        help="seconds to wait for the spawned server's GET /ping",
    )
    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 16],
        metavar="C",
        help="concurrency levels, run in order",
    )
    load.add_argument(
        "--num-prompts",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="requests per level: one value for all, or one per level; default 8 at c=1, else 4*c",
    )
    load.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    load.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    load.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    load.add_argument(
        "--vocab-size",
        type=int,
        default=49152,
        help="prompt token ids are drawn from [1000, VOCAB_SIZE-1000)",
    )
    load.add_argument(
        "--warmup",
        type=int,
        default=1,
        metavar="N",
        help="untimed requests before the sweep (vLLM's initial test run)",
    )
    load.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the whole sweep N times and report the median of each figure",
    )
    load.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="per-request timeout"
    )
    report = parser.add_argument_group("report")
    report.add_argument(
        "--label",
        default=None,
        help="name in the table; default: 'hearth' with --spawn-server, "
        "else the server's host:port",
    )
    report.add_argument("--output-dir", default=".bench", help="where the result files go")
    report.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="JSON",
        help="a previous results.json (or vLLM --save-result file) to put "
        "beside this run, with ratios; repeatable",
    )
    report.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between live progress lines within a level",
    )
    parser.set_defaults(func=run_bench)


# --------------------------------------------------------------------------- spawning


class ServerStartError(RuntimeError):
    """The spawned server exited or never answered GET /ping."""


def free_port() -> int:
    """A loopback port nobody listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_command(port: int, server_args: Sequence[str]) -> list[str]:
    """`hearth serve` through this interpreter, so the venv and the code are the ones running."""
    extra = [token for value in server_args for token in shlex.split(value)]
    return [
        sys.executable,
        "-m",
        "container.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]


def _child_env() -> dict[str, str]:
    """Our environment, with this checkout first on PYTHONPATH: `-m container.cli` must
    import the same code as the bench, even when hearth is not pip-installed."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class SpawnedServer:
    """A server process for the length of a `with` block; yields its base URL.

    Started in its own session so that, should SIGTERM not be enough, the whole group
    (gunicorn workers and the engine core included) can be killed without touching anything
    else. Its output goes to a log file: the bench's own output stays readable, and the tail
    is shown if it fails to start.
    """

    def __init__(
        self,
        command: Sequence[str],
        port: int,
        log_path: Path,
        ready_timeout_s: float = 900.0,
        log: bench.Log = bench.log_stderr,
        poll_interval_s: float = 0.5,
        progress_interval_s: float = 5.0,
        stop_timeout_s: float = 60.0,
    ) -> None:
        self.command = list(command)
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.log = log
        self.poll_interval_s = poll_interval_s
        self.progress_interval_s = progress_interval_s
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log(f"starting: {shlex.join(self.command)} (log: {self.log_path})")
        with self.log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=_child_env(),
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.base_url

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        """Poll GET /ping until 200; model load and warm-up can take minutes on 2 cores."""
        assert self.process is not None
        start = last_note = time.monotonic()
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                if self.process.poll() is not None:
                    raise ServerStartError(
                        f"the server exited with code {self.process.returncode} before it "
                        f"was ready; last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                if _ping(client, self.base_url):
                    self.log(
                        f"server ready at {self.base_url} after {time.monotonic() - start:.0f} s"
                    )
                    return
                now = time.monotonic()
                if now - start > self.ready_timeout_s:
                    raise ServerStartError(
                        f"no 200 from {self.base_url}/ping in {self.ready_timeout_s:.0f} s; "
                        f"last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                if now - last_note >= self.progress_interval_s:
                    self.log(f"  waiting for the server (loading the model?): {now - start:.0f} s")
                    last_note = now
                time.sleep(self.poll_interval_s)

    def stop(self) -> None:
        """SIGTERM and wait, as a platform stops it; SIGKILL the group only if it hangs."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.log(f"the server ignored SIGTERM for {self.stop_timeout_s:.0f} s; killing it")
                _signal_group(process.pid, signal.SIGKILL)
                process.wait()
        if _signal_group(process.pid, signal.SIGTERM):
            self.log("the server left processes behind; sent them SIGTERM")

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def _ping(client: httpx.Client, base_url: str) -> bool:
    try:
        return client.get(f"{base_url}/ping").status_code == 200
    except httpx.HTTPError:
        return False


def _signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Signal the process group we started; False when it has no process left."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


# --------------------------------------------------------------------------- running


def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model id of GET /v1/models, the name vLLM's client would also be given."""
    with httpx.Client(timeout=30.0, trust_env=False) as client:
        response = client.get(
            f"{base_url.rstrip('/')}/v1/models", headers=bench.auth_headers(api_key)
        )
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


def default_label(args: argparse.Namespace) -> str:
    if args.label:
        return str(args.label)
    if args.spawn_server:
        return "hearth"
    return urlsplit(args.base_url).netloc or args.base_url


def build_config(args: argparse.Namespace, base_url: str, model: str) -> bench.BenchConfig:
    return bench.BenchConfig(
        base_url=base_url,
        model=model,
        concurrencies=tuple(args.concurrency),
        num_prompts=tuple(args.num_prompts or ()),
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        vocab_size=args.vocab_size,
        api_key=args.api_key,
        warmup=args.warmup,
        timeout_s=args.timeout,
        progress_interval_s=args.progress_interval,
    )


def _validate(args: argparse.Namespace) -> None:
    """Fail on bad arguments before a server is started or a request sent."""
    bench.BenchConfig(
        base_url=args.base_url,
        model="-",
        concurrencies=tuple(args.concurrency),
        num_prompts=tuple(args.num_prompts or ()),
        input_len=args.input_len,
        output_len=args.output_len,
        vocab_size=args.vocab_size,
    )
    if args.repeat < 1 or args.warmup < 0:
        raise ValueError("--repeat must be >= 1 and --warmup >= 0")


def _measure(args: argparse.Namespace, base_url: str) -> bench.Result:
    model = args.model or discover_model(base_url, args.api_key)
    bench.log_stderr(f"benchmarking {model} at {base_url}")
    config = build_config(args, base_url, model)
    return bench.run_benchmark(config, default_label(args), repeat=args.repeat)


def run_bench(args: argparse.Namespace) -> int:
    """Entry point of `hearth bench`; returns the exit code."""
    if args.api_key is None:  # read here, not as the default, so --help never shows it
        args.api_key = os.environ.get("OPENAI_API_KEY") or None
    try:
        _validate(args)
        compare = bench.merge_results([bench.load_results(p) for p in args.compare])
    except (ValueError, OSError) as exc:
        print(f"hearth bench: {exc}", file=sys.stderr)
        return EXIT_SETUP
    try:
        if args.spawn_server:
            port = free_port()
            log_path = Path(args.output_dir) / "server.log"
            command = serve_command(port, args.server_arg)
            with SpawnedServer(command, port, log_path, args.server_timeout) as url:
                result = _measure(args, url)
        else:
            result = _measure(args, args.base_url)
    except (ServerStartError, httpx.HTTPError, ValueError) as exc:
        print(f"hearth bench: {exc}", file=sys.stderr)
        return EXIT_SETUP
    return report(result, compare, args.output_dir)


def report(result: bench.Result, compare: list[bench.Result], output_dir: str) -> int:
    """Write the files, print the table and ratios; the exit code says if requests failed."""
    paths = bench.write_outputs(result, compare, output_dir)
    print(bench.format_table([result, *compare]))
    for other in compare:
        print(f"\nratios {result['label']} / {other['label']}:")
        print(bench.format_ratios(result, other))
    print("\nwrote " + ", ".join(str(p) for p in paths))
    failed = bench.total_failed(result)
    if failed:
        print(f"hearth bench: {failed} request(s) failed", file=sys.stderr)
        return EXIT_FAILED_REQUESTS
    return EXIT_OK
