"""Tests of `hearth bench` against a fake OpenAI-compatible streaming server.

The fake (`fake_openai.py`) is a test double for the benchmark *client* only. Nothing here
asserts on durations: the figures are checked for their relations (p50 <= p99, TTFT <=
E2E), counts and state (what was sent, how many streams were in flight), never against
wall-clock bounds that a busy host could break.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from container.bench import compare, load, report, results, stats
from container.bench.cli import add_bench_command
from container.bench.config import BenchConfig, LevelSpec, resolve_num_prompts
from container.bench.server import ServerStartError, SpawnedServer, free_port, serve_command
from tests.container import fake_openai
from tests.container.fake_openai import MODEL, FakeServer


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer()
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _config(server: FakeServer, **overrides: Any) -> BenchConfig:
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
    return BenchConfig(**{**values, **overrides})


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
    result = load.run_benchmark(config, "fake", log=lines.append)
    levels = _levels(result)

    for conc, n in ((1, 4), (4, 8)):
        level = levels[conc]
        assert (level["completed"], level["failed"], level["num_prompts"]) == (n, 0, n)
        assert level["total_output_tokens"] == n * 5
        assert level["prompt_len_mismatch"] == level["output_len_mismatch"] == 0
        assert level["counts"] is True and level["sweep"] == "concurrency"
        assert (level["input_len"], level["output_len"]) == (16, 5)
        # Relations that hold for any timings: percentiles ordered, and per request
        # TTFT <= E2E (so every percentile of TTFT <= the same one of E2E).
        for name in ("ttft", "itl", "tpot", "e2e"):
            assert 0 < level[f"{name}_p50_ms"] <= level[f"{name}_p90_ms"]
            assert level[f"{name}_p90_ms"] <= level[f"{name}_p99_ms"]
        for q in (50, 90, 99):
            assert level[f"ttft_p{q}_ms"] <= level[f"e2e_p{q}_ms"]
        assert level["output_throughput"] > 0 and level["request_throughput"] > 0
    # The semaphore: never more streams than the level's concurrency, and at c=4 the
    # requests (all submitted at once) overlap; the warm-up and c=1 run one at a time.
    arrivals = fake_server.behaviour.in_flight_at_arrival
    assert arrivals[:5] == [1] * 5  # warm-up + the 4 requests at c=1
    assert max(arrivals[5:]) <= 4 and max(arrivals[5:]) > 1

    print("\n".join(lines))
    assert any(line.startswith("warm-up") for line in lines)
    assert any("c=1 in=16: 4/4 ok" in line for line in lines)
    assert any("done, 0 failed" in line for line in lines)  # the live count of a level


def test_requests_follow_the_vllm_random_method(fake_server: FakeServer) -> None:
    config = _config(fake_server, vocab_size=5000)
    load.run_benchmark(config, "fake", log=lambda _: None)
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
    load.run_benchmark(config, "fake", log=lines.append)
    assert not any("warning" in line for line in lines)
    # The fake honours max_tokens, so a stricter expectation plays a server that stops early.
    spec = LevelSpec("concurrency", 2, config.input_len, config.output_len, 1)
    level = stats.summarize_level(spec, [stats.RequestResult(ok=True, output_tokens=3)], 1.0)
    [warning] = stats.level_warnings(level)
    assert "output tokens != 5" in warning


def test_output_tokens_fall_back_to_chunk_count(fake_server: FakeServer) -> None:
    fake_server.behaviour.send_usage = False
    result = load.run_benchmark(_config(fake_server, warmup=0), "fake", log=lambda _: None)
    assert _levels(result)[4]["total_output_tokens"] == 8 * 5
    assert _levels(result)[4]["prompt_len_mismatch"] == 0


def test_some_failures_leave_the_rest_measured(fake_server: FakeServer) -> None:
    fake_server.behaviour.fail_every = 3
    config = _config(fake_server, concurrencies=(4,), num_prompts=(9,), warmup=0)
    lines: list[str] = []
    result = load.run_benchmark(config, "fake", log=lines.append)
    assert result["sweeps"] == {"concurrency": {"failed": 3, "counts": False}}
    level = result["levels"][0]
    assert (level["completed"], level["failed"]) == (6, 3)
    assert level["total_output_tokens"] == 6 * 5
    assert level["ttft_p50_ms"] is not None  # the 6 that succeeded are measured
    assert level["counts"] is False  # but a level with failures does not count
    assert "503" in level["first_error"]
    assert sum("first failed request" in line for line in lines) == 1


# --------------------------------------------------------------------------- the CLI


def test_cli_writes_files_and_prints_the_table(
    fake_server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = tmp_path / "first"
    common = ["--base-url", fake_server.base_url, "--concurrency", "1", "4"]
    common += ["--input-len", "8", "--output-len", "3", "--warmup", "0"]
    common += ["--sweeps", "concurrency"]
    code = _run_cli(
        [*common, "--num-prompts", "2", "4", "--label", "fake", "--output-dir", str(first)]
    )
    out = first_out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[0] == "concurrency sweep: 8 in / 3 out"
    header = out.splitlines()[1].split()
    assert header[:4] == ["label", "conc", "ok/n", "out"]
    assert "TTFT" in header and "ITL" in header
    assert out.splitlines()[2].split()[:3] == ["fake", "1", "2/2"]
    assert out.splitlines()[3].split()[:3] == ["fake", "4", "4/4"]
    assert all(body["model"] == MODEL for body in fake_server.behaviour.requests)  # discovered

    saved = json.loads((first / "results.json").read_text())
    assert saved["schema"] == load.SCHEMA and saved["label"] == "fake"
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
    rows = [line.split()[:3] for line in out.splitlines()[2:6]]
    assert rows == [
        ["other", "1", "4/4"],
        ["fake", "1", "2/2"],
        ["other", "4", "4/4"],
        ["fake", "4", "4/4"],
    ]
    assert "ratios other / fake;" in out
    ratio_rows = [line.split() for line in out.splitlines() if line.startswith("c=")]
    assert [row[0] for row in ratio_rows] == ["c=1", "c=4"]
    assert all(row[-2:] == ["yes", "fake"] for row in ratio_rows)
    saved = json.loads((second / "results.json").read_text())
    assert saved["compare"][0]["label"] == "fake" and len(saved["runs"]) == 2
    assert saved["levels"][0]["repeats"] == 2
    assert "## Ratios other / fake" in (second / "results.md").read_text()
    ET.parse(second / "results.svg")


def test_cli_counts_503s_without_crashing(
    fake_server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_server.behaviour.status = 503
    argv = ["--base-url", fake_server.base_url, "--concurrency", "1", "4", "--num-prompts", "3"]
    argv += ["--sweeps", "concurrency", "--output-len", "3"]
    code = _run_cli([*argv, "--output-dir", str(tmp_path)])
    captured = capsys.readouterr()
    print(captured.out, captured.err)
    assert code == 1
    assert captured.err.count("first failed request: HTTP 503") == 1
    assert "fake overload" in captured.err and "6 request(s) failed" in captured.err
    label = fake_server.base_url.removeprefix("http://")  # the default label: host:port
    # Failed levels are flagged in the table, the JSON and the exit code.
    assert captured.out.splitlines()[2].split()[:5] == [label, "1", "0/3!", "0.0", "0.00"]
    assert "does not count" in captured.out
    saved = json.loads((tmp_path / "results.json").read_text())
    for level in saved["levels"]:
        assert (level["completed"], level["failed"], level["ttft_p50_ms"]) == (0, 3, None)
        assert level["counts"] is False
        assert level["first_error"].startswith("HTTP 503")
    ET.parse(tmp_path / "results.svg")


def test_cli_without_a_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert _run_cli(["--base-url", url, "--output-dir", str(tmp_path)]) == 2  # no /v1/models
    argv = ["--base-url", url, "--model", "m", "--concurrency", "2", "--num-prompts", "2"]
    argv += ["--sweeps", "concurrency", "--warmup", "0"]
    assert _run_cli([*argv, "--output-dir", str(tmp_path)]) == 1
    assert "ConnectError" in capsys.readouterr().err


def test_cli_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--concurrency", "1", "4", "--num-prompts", "1", "2", "3"]
    assert _run_cli([*argv, "--output-dir", str(tmp_path)]) == 2
    assert "one value or one per concurrency level" in capsys.readouterr().err
    assert _run_cli(["--compare", str(tmp_path / "missing.json")]) == 2


# --------------------------------------------------------------------------- --spawn-server


def test_spawned_server_is_awaited_used_and_stopped(tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, fake_openai.__file__, "--port", str(port), "--ready-after", "0.4"]
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
        config = BenchConfig(
            base_url=url, model=MODEL, concurrencies=(2,), num_prompts=(2,), output_len=3, warmup=0
        )
        result = load.run_benchmark(config, "spawned", log=lines.append)
    assert result["levels"][0]["completed"] == 2
    assert process is not None and process.returncode is not None  # stopped by SIGTERM
    assert server.process is None
    assert any("waiting for the server" in line for line in lines)
    assert any(line.startswith("server ready") for line in lines)


def _alive(pid: int) -> bool:
    """Running (a zombie that nobody reaped yet is dead for this purpose)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_stopping_a_server_kills_children_that_left_its_group(tmp_path: Path) -> None:
    # Like hearth's engine core: a child in a session of its own outlives a SIGTERM to the
    # server's process group unless it is found (and killed) as a descendant.
    port, pid_file = free_port(), tmp_path / "child.pid"
    script = (
        "import runpy, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
        " start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        f"sys.argv = ['fake', '--port', '{port}']\n"
        f"runpy.run_path({fake_openai.__file__!r}, run_name='__main__')\n"
    )
    lines: list[str] = []
    server = SpawnedServer([sys.executable, "-c", script], port, tmp_path / "log", log=lines.append)
    with server:
        child = int(pid_file.read_text())
        assert _alive(child)
    assert not _alive(child)
    assert "the server left processes behind; killed them" in lines


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
    assert stats.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert stats.percentile([float(i) for i in range(101)], 99) == pytest.approx(99.0)
    assert stats.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert stats.percentile([7.0], 99) == 7.0
    assert stats.percentile([], 50) is None


def test_random_prompts_are_seeded_and_in_range() -> None:
    a = load.random_prompts(3, 128, 49152, "0:0:1")
    assert a == load.random_prompts(3, 128, 49152, "0:0:1")
    assert a != load.random_prompts(3, 128, 49152, "0:0:16")
    assert all(len(p) == 128 and min(p) >= 1000 and max(p) < 48152 for p in a)


def test_num_prompts_defaults_follow_the_anchors() -> None:
    assert resolve_num_prompts([1, 16], []) == [8, 64]
    assert resolve_num_prompts([1, 4, 16], [5]) == [5, 5, 5]
    assert resolve_num_prompts([1, 16], [3, 7]) == [3, 7]
    with pytest.raises(ValueError):
        resolve_num_prompts([1, 16], [1, 2, 3])


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
    [vllm] = results.merge_results([results.load_results(p) for p in paths])
    assert vllm["label"] == "vllm" and [lv["concurrency"] for lv in vllm["levels"]] == [1, 16]
    assert vllm["levels"][0]["itl_p50_ms"] == 93.0 and vllm["levels"][1]["ttft_p99_ms"] == 15200.0

    ours = {
        "label": "hearth",
        "levels": [{"concurrency": 16, "output_throughput": 116.0, "ttft_p50_ms": 3800.0}],
    }
    [ratio] = compare.compare_ratios(ours, vllm)
    assert (ratio["sweep"], ratio["concurrency"], ratio["baseline"]) == ("concurrency", 16, "vllm")
    assert (ratio["output_throughput"], ratio["ttft_p50"], ratio["itl_p50"]) == (2.0, 0.5, None)
    assert ratio["counts"] is True
    row = report.format_ratios(ours, vllm).splitlines()[1].split()
    assert row == ["c=16", "2.00x", "0.50x", "-", "yes", "vllm"]


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
    [level] = stats.merge_repeats(runs)
    assert level["completed"] == 5 and level["repeats"] == 3
    assert level["output_throughput"] == 3.0
    assert level["ttft_p50_ms"] == 5.5  # median of the repeats that measured it
