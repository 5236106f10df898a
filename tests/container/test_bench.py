"""Tests of `hearth bench` against a fake OpenAI-compatible streaming server.

The fake is a test double for the benchmark *client* only: it streams one text chunk per
requested token with known sleeps (a longer one before the first chunk, like a prefill), so
the measured TTFT and ITL have known lower bounds. It runs in a thread for most tests, and as
a subprocess (this file run as a script) for the `--spawn-server` machinery.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from container import bench
from container.bench_cli import (
    ServerStartError,
    SpawnedServer,
    add_bench_command,
    free_port,
    serve_command,
)

MODEL = "fake-model"
FIRST_CHUNK_S = 0.03  # the fake's "prefill": sleep before the first chunk
CHUNK_S = 0.01  # sleep before every later chunk


# --------------------------------------------------------------------------- the fake server


@dataclass
class FakeBehaviour:
    """How the fake answers; tests flip these to simulate overload or missing usage."""

    status: int = 200
    fail_every: int = 0  # with status 200: every n-th completion answers 503
    send_usage: bool = True
    ready_after_s: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ready_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.ready_at = time.monotonic() + self.ready_after_s


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0, behaviour: FakeBehaviour | None = None) -> None:
        super().__init__(("127.0.0.1", port), FakeOpenAIHandler)
        self.behaviour = behaviour or FakeBehaviour()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class FakeOpenAIHandler(BaseHTTPRequestHandler):
    """/v1/models, /ping and a streaming /v1/completions over chunked HTTP/1.1."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as uvicorn does: else small chunks bunch up (delayed ACK)
    server: FakeServer

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: the test output should show the bench's lines only."""

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif self.path == "/ping":
            ready = time.monotonic() >= self.server.behaviour.ready_at
            self._json(200 if ready else 503, {})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        behaviour = self.server.behaviour
        with behaviour.lock:
            behaviour.requests.append(body)
            number = len(behaviour.requests)
        failing = behaviour.fail_every and number % behaviour.fail_every == 0
        if behaviour.status != 200 or failing:
            self._json(503, {"error": {"message": "fake overload", "code": 503}})
            return
        self._stream(body, behaviour.send_usage)

    def _stream(self, body: dict[str, Any], send_usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        tokens = body["max_tokens"]
        for i in range(tokens):
            time.sleep(FIRST_CHUNK_S if i == 0 else CHUNK_S)
            choice = {"index": 0, "text": f" t{i}", "finish_reason": None}
            self._event({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})
        if send_usage:
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens}
            self._event({"id": "cmpl-1", "choices": [], "usage": usage})
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _event(self, payload: dict[str, Any]) -> None:
        self._chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer()
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _config(server: FakeServer, **overrides: Any) -> bench.BenchConfig:
    values: dict[str, Any] = {
        "base_url": server.base_url,
        "model": MODEL,
        "concurrencies": (1, 4),
        "num_prompts": (4, 8),
        "input_len": 16,
        "output_len": 5,
        "warmup": 1,
        "progress_interval_s": 60.0,
    }
    return bench.BenchConfig(**{**values, **overrides})


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hearth")
    add_bench_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *argv])
    return int(args.func(args))


def _levels(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {level["concurrency"]: level for level in result["levels"]}


# --------------------------------------------------------------------------- measuring


def test_sweep_measures_the_fake_stream(fake_server: FakeServer) -> None:
    lines: list[str] = []
    config = _config(fake_server, progress_interval_s=0.05)
    result = bench.run_benchmark(config, "fake", log=lines.append)
    levels = _levels(result)

    for conc, n in ((1, 4), (4, 8)):
        level = levels[conc]
        assert (level["completed"], level["failed"], level["num_prompts"]) == (n, 0, n)
        assert level["total_output_tokens"] == n * 5
        assert level["prompt_len_mismatch"] == level["output_len_mismatch"] == 0
        # Lower bounds from the fake's sleeps (5% slack for timer granularity), loose uppers.
        assert FIRST_CHUNK_S * 950 <= level["ttft_p50_ms"] <= level["ttft_p99_ms"] < 1000
        assert CHUNK_S * 950 <= level["itl_p50_ms"] <= level["itl_p99_ms"] < 1000
        assert level["itl_p50_ms"] < level["ttft_p50_ms"]
        assert level["tpot_p50_ms"] >= CHUNK_S * 950
        assert level["e2e_p50_ms"] >= (FIRST_CHUNK_S + 4 * CHUNK_S) * 950
        assert level["output_throughput"] > 0 and level["request_throughput"] > 0
    # The fake serves requests in parallel, so 4 slots must beat 1 by a wide margin.
    assert levels[4]["output_throughput"] > 1.5 * levels[1]["output_throughput"]

    print("\n".join(lines))
    assert any(line.startswith("warm-up") for line in lines)
    assert any("c=1: 4/4 ok" in line for line in lines)
    assert any("done, 0 failed" in line for line in lines)  # the live count of a level


def test_requests_follow_the_vllm_random_method(fake_server: FakeServer) -> None:
    config = _config(fake_server, vocab_size=5000)
    bench.run_benchmark(config, "fake", log=lambda _: None)
    sent = fake_server.behaviour.requests
    assert len(sent) == 1 + 4 + 8  # warm-up + both levels
    for body in sent:
        assert body["model"] == MODEL
        assert len(body["prompt"]) == 16
        assert all(1000 <= token < 4000 for token in body["prompt"])
        assert body["max_tokens"] == 5 and body["temperature"] == 0
        assert body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
    # No prompt repeats within a run (prefix caching would flatter the figures).
    assert len({tuple(body["prompt"]) for body in sent}) == len(sent)


def test_short_outputs_are_flagged(fake_server: FakeServer) -> None:
    lines: list[str] = []
    config = _config(fake_server, concurrencies=(2,), num_prompts=(2,), warmup=0)
    bench.run_benchmark(config, "fake", log=lines.append)
    assert not any("warning" in line for line in lines)
    # The fake honours max_tokens, so a stricter expectation plays a server that stops early.
    level = bench.summarize_level(2, [bench.RequestResult(ok=True, output_tokens=3)], 1.0, config)
    [warning] = bench.level_warnings(level, config)
    assert "output tokens != 5" in warning


def test_output_tokens_fall_back_to_chunk_count(fake_server: FakeServer) -> None:
    fake_server.behaviour.send_usage = False
    result = bench.run_benchmark(_config(fake_server, warmup=0), "fake", log=lambda _: None)
    assert _levels(result)[4]["total_output_tokens"] == 8 * 5
    assert _levels(result)[4]["prompt_len_mismatch"] == 0


def test_some_failures_leave_the_rest_measured(fake_server: FakeServer) -> None:
    fake_server.behaviour.fail_every = 3
    config = _config(fake_server, concurrencies=(4,), num_prompts=(9,), warmup=0)
    lines: list[str] = []
    level = bench.run_benchmark(config, "fake", log=lines.append)["levels"][0]
    assert (level["completed"], level["failed"]) == (6, 3)
    assert level["total_output_tokens"] == 6 * 5
    assert level["ttft_p50_ms"] >= FIRST_CHUNK_S * 950
    assert "503" in level["first_error"]
    assert sum("first failed request" in line for line in lines) == 1


# --------------------------------------------------------------------------- the CLI


def test_cli_writes_files_and_prints_the_table(
    fake_server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = tmp_path / "first"
    common = ["--base-url", fake_server.base_url, "--concurrency", "1", "4"]
    common += ["--input-len", "8", "--output-len", "3", "--warmup", "0"]
    code = _run_cli(
        [*common, "--num-prompts", "2", "4", "--label", "fake", "--output-dir", str(first)]
    )
    out = first_out = capsys.readouterr().out
    assert code == 0
    header = out.splitlines()[0].split()
    assert header[:4] == ["label", "conc", "ok/n", "out"]
    assert "TTFT" in header and "ITL" in header
    assert out.splitlines()[1].split()[:3] == ["fake", "1", "2/2"]
    assert out.splitlines()[2].split()[:3] == ["fake", "4", "4/4"]
    assert all(body["model"] == MODEL for body in fake_server.behaviour.requests)  # discovered

    saved = json.loads((first / "results.json").read_text())
    assert saved["schema"] == bench.SCHEMA and saved["label"] == "fake"
    assert [lv["completed"] for lv in saved["levels"]] == [2, 4]
    assert "| fake | 1 | 2/2 |" in (first / "results.md").read_text()
    svg = ET.parse(first / "results.svg").getroot()
    assert svg.tag.endswith("svg") and "fake" in (first / "results.svg").read_text()

    # A second run compared with the first: both labels, ratios, medians of 2 repeats.
    second = tmp_path / "second"
    argv = [*common, "--num-prompts", "2", "--label", "other", "--repeat", "2"]
    code = _run_cli([*argv, "--compare", str(first / "results.json"), "--output-dir", str(second)])
    out = capsys.readouterr().out
    print(first_out, out, sep="\n")  # shown by pytest -s / on failure
    assert code == 0
    rows = [line.split()[:3] for line in out.splitlines()[1:5]]
    assert rows == [
        ["other", "1", "4/4"],
        ["fake", "1", "2/2"],
        ["other", "4", "4/4"],
        ["fake", "4", "4/4"],
    ]
    assert "ratios other / fake:" in out and "c=4: out tok/s other/fake" in out
    saved = json.loads((second / "results.json").read_text())
    assert saved["compare"][0]["label"] == "fake" and len(saved["runs"]) == 2
    assert saved["levels"][0]["repeats"] == 2
    assert "Ratios other / fake" in (second / "results.md").read_text()
    ET.parse(second / "results.svg")


def test_cli_counts_503s_without_crashing(
    fake_server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_server.behaviour.status = 503
    argv = ["--base-url", fake_server.base_url, "--concurrency", "1", "4", "--num-prompts", "3"]
    code = _run_cli([*argv, "--output-len", "3", "--output-dir", str(tmp_path)])
    captured = capsys.readouterr()
    print(captured.out, captured.err)
    assert code == 1
    assert captured.err.count("first failed request: HTTP 503") == 1
    assert "fake overload" in captured.err and "6 request(s) failed" in captured.err
    label = fake_server.base_url.removeprefix("http://")  # the default label: host:port
    assert captured.out.splitlines()[1].split()[:5] == [label, "1", "0/3", "0.0", "0.00"]
    saved = json.loads((tmp_path / "results.json").read_text())
    for level in saved["levels"]:
        assert (level["completed"], level["failed"], level["ttft_p50_ms"]) == (0, 3, None)
        assert level["first_error"].startswith("HTTP 503")
    ET.parse(tmp_path / "results.svg")


def test_cli_without_a_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert _run_cli(["--base-url", url, "--output-dir", str(tmp_path)]) == 2  # no /v1/models
    argv = ["--base-url", url, "--model", "m", "--concurrency", "2", "--num-prompts", "2"]
    assert _run_cli([*argv, "--warmup", "0", "--output-dir", str(tmp_path)]) == 1
    assert "ConnectError" in capsys.readouterr().err


def test_cli_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--concurrency", "1", "4", "--num-prompts", "1", "2", "3"]
    assert _run_cli([*argv, "--output-dir", str(tmp_path)]) == 2
    assert "one value or one per concurrency level" in capsys.readouterr().err
    assert _run_cli(["--compare", str(tmp_path / "missing.json")]) == 2


# --------------------------------------------------------------------------- --spawn-server


def test_spawned_server_is_awaited_used_and_stopped(tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, __file__, "--port", str(port), "--ready-after", "0.4"]
    lines: list[str] = []
    server = SpawnedServer(
        command,
        port,
        tmp_path / "server.log",
        ready_timeout_s=30,
        log=lines.append,
        poll_interval_s=0.1,
        progress_interval_s=0.2,
    )
    with server as url:
        process = server.process
        config = bench.BenchConfig(
            base_url=url, model=MODEL, concurrencies=(2,), num_prompts=(2,), output_len=3, warmup=0
        )
        result = bench.run_benchmark(config, "spawned", log=lines.append)
    assert result["levels"][0]["completed"] == 2
    assert process is not None and process.returncode is not None  # stopped by SIGTERM
    assert server.process is None
    assert any("waiting for the server" in line for line in lines)
    assert any(line.startswith("server ready") for line in lines)


def test_spawned_server_that_exits_is_reported(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "print('boom: no model'); raise SystemExit(3)"]
    server = SpawnedServer(command, free_port(), tmp_path / "server.log", log=lambda _: None)
    with pytest.raises(ServerStartError, match=r"code 3(.|\n)*boom: no model"), server:
        pass


def test_serve_command_runs_hearth_serve_with_extra_args() -> None:
    command = serve_command(8123, ["--max-num-seqs 32", "--dtype=float32"])
    assert command[:4] == [sys.executable, "-m", "container.cli", "serve"]
    assert command[4:] == [
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--max-num-seqs",
        "32",
        "--dtype=float32",
    ]


# --------------------------------------------------------------------------- pure helpers


def test_percentile_is_linear_like_numpy() -> None:
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert bench.percentile([float(i) for i in range(101)], 99) == pytest.approx(99.0)
    assert bench.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert bench.percentile([7.0], 99) == 7.0
    assert bench.percentile([], 50) is None


def test_random_prompts_are_seeded_and_in_range() -> None:
    a = bench.random_prompts(3, 128, 49152, "0:0:1")
    assert a == bench.random_prompts(3, 128, 49152, "0:0:1")
    assert a != bench.random_prompts(3, 128, 49152, "0:0:16")
    assert all(len(p) == 128 and min(p) >= 1000 and max(p) < 48152 for p in a)


def test_num_prompts_defaults_follow_the_anchors() -> None:
    assert bench.resolve_num_prompts([1, 16], []) == [8, 64]
    assert bench.resolve_num_prompts([1, 4, 16], [5]) == [5, 5, 5]
    assert bench.resolve_num_prompts([1, 16], [3, 7]) == [3, 7]
    with pytest.raises(ValueError):
        bench.resolve_num_prompts([1, 16], [1, 2, 3])


def test_vllm_result_files_load_and_compare(tmp_path: Path) -> None:
    paths = []
    for conc, tps, ttft in ((1, 10.0, 120.0), (16, 58.0, 7600.0)):
        data = {
            "label": "vllm",
            "max_concurrency": conc,
            "num_prompts": 4 * conc,
            "completed": 4 * conc,
            "output_throughput": tps,
            "median_ttft_ms": ttft,
            "p99_ttft_ms": ttft * 2,
            "median_itl_ms": 93.0,
            "median_e2el_ms": 1.0,
        }
        paths.append(tmp_path / f"vllm-c{conc}.json")
        paths[-1].write_text(json.dumps(data))
    [vllm] = bench.merge_results([bench.load_results(p) for p in paths])
    assert vllm["label"] == "vllm" and [lv["concurrency"] for lv in vllm["levels"]] == [1, 16]
    assert vllm["levels"][0]["itl_p50_ms"] == 93.0 and vllm["levels"][1]["ttft_p99_ms"] == 15200.0

    ours = {
        "label": "hearth",
        "levels": [{"concurrency": 16, "output_throughput": 116.0, "ttft_p50_ms": 3800.0}],
    }
    [ratio] = bench.compare_ratios(ours, vllm)
    assert ratio == {"concurrency": 16, "output_throughput": 2.0, "ttft_p50": 0.5}
    assert "c=16: out tok/s hearth/vllm 2.00x, TTFT p50 hearth/vllm 0.50x" in bench.format_ratios(
        ours, vllm
    )


def test_merge_repeats_sums_counts_and_takes_medians() -> None:
    runs = [
        [
            {
                "concurrency": 1,
                "completed": n,
                "failed": 0,
                "output_throughput": t,
                "ttft_p50_ms": None if t == 3.0 else t,
                "first_error": None,
            }
        ]
        for n, t in ((2, 1.0), (2, 3.0), (1, 10.0))
    ]
    [level] = bench.merge_repeats(runs)
    assert level["completed"] == 5 and level["repeats"] == 3
    assert level["output_throughput"] == 3.0
    assert level["ttft_p50_ms"] == 5.5  # median of the repeats that measured it


# --------------------------------------------------------------------------- script mode


def _serve_fake() -> None:
    """`python test_bench.py --port P`: the fake as a process, for the spawn test."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready-after", type=float, default=0.0)
    args = parser.parse_args()
    FakeServer(args.port, FakeBehaviour(ready_after_s=args.ready_after)).serve_forever()


if __name__ == "__main__":
    _serve_fake()
