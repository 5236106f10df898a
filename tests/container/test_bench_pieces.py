"""Tests of the benchmark package's pieces: sweeps, statistics, ratios, report, host, flags,
and a whole `--spawn-server --compare --sandwich` run with fake servers standing in for
hearth and vLLM. No assertion here depends on how fast anything ran.
"""

from __future__ import annotations

import argparse
import json
import stat
import sys
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from container.bench import anchor, cli, compare, host, load, report, stats
from container.bench.args import COMPARE_VLLM, add_bench_parser, build_config, validate
from container.bench.config import BenchConfig, LevelSpec, default_num_prompts
from container.bench.session import BASELINE, ServerPlan, run_session, sandwich
from tests.container import fake_openai
from tests.container.fake_openai import MODEL, FakeServer

# --------------------------------------------------------------------------- sweeps


def test_levels_cover_both_sweeps_in_order() -> None:
    config = BenchConfig(
        base_url="http://x",
        model="m",
        concurrencies=(1, 4),
        prompt_lens=(128, 4096),
        prompt_len_concurrency=16,
    )
    assert [(s.sweep, s.concurrency, s.input_len, s.num_prompts) for s in config.levels] == [
        ("concurrency", 1, 128, 8),
        ("concurrency", 4, 128, 16),
        ("prompt-len", 16, 128, 64),
        ("prompt-len", 16, 4096, 64),
    ]
    assert [s.x for s in config.levels] == [1, 4, 128, 4096]
    assert config.max_total_len == 4096 + 128
    assert [lv["sweep"] for lv in config.public()["levels"]] == ["concurrency"] * 2 + [
        "prompt-len"
    ] * 2


def test_quick_sends_one_wave_per_level() -> None:
    full = [default_num_prompts(c) for c in (1, 4, 16, 64, 128)]
    quick = [default_num_prompts(c, quick=True) for c in (1, 4, 16, 64, 128)]
    assert full == [8, 16, 64, 128, 256]
    assert quick == [4, 4, 16, 64, 128]
    config = BenchConfig(base_url="x", model="m", prompt_lens=(1024,), quick=True)
    assert [s.num_prompts for s in config.levels] == [*quick, 16]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"concurrencies": (), "prompt_lens": ()}, "nothing to run"),
        ({"concurrencies": (0,)}, "concurrency"),
        ({"prompt_lens": (0,)}, "lengths"),
        ({"vocab_size": 100}, "vocab size"),
        ({"concurrencies": (1, 2), "num_prompts": (1, 2, 3)}, "one per concurrency level"),
    ],
)
def test_bad_configs_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BenchConfig(base_url="x", model="m", **overrides)


# --------------------------------------------------------------------------- statistics


def test_summary_pools_gaps_and_leaves_failures_out() -> None:
    spec = LevelSpec("prompt-len", 2, 1024, 3, 3)
    ok = stats.RequestResult(ok=True, ttft_s=0.5, itl_s=[0.1, 0.3], e2e_s=0.9, output_tokens=3)
    ok2 = stats.RequestResult(ok=True, ttft_s=1.5, itl_s=[0.2, 0.2], e2e_s=1.9, output_tokens=3)
    bad = stats.RequestResult(error="HTTP 503: busy")
    level = stats.summarize_level(spec, [ok, ok2, bad], duration_s=2.0)
    assert (level["completed"], level["failed"], level["counts"]) == (2, 1, False)
    assert (level["sweep"], level["input_len"]) == ("prompt-len", 1024)
    assert level["ttft_p50_ms"] == pytest.approx(1000.0)
    assert level["itl_p50_ms"] == pytest.approx(200.0)  # pooled: 100, 200, 200, 300
    assert level["tpot_mean_ms"] == pytest.approx(200.0)  # (900-500)/2 and (1900-1500)/2
    assert level["output_throughput"] == pytest.approx(3.0)  # 6 tokens in 2 s
    assert level["total_input_tokens"] == 2048 and level["first_error"] == "HTTP 503: busy"
    assert stats.summarize_level(spec, [ok, ok2], 2.0)["counts"] is True


def test_merged_repeats_count_only_when_every_repeat_did() -> None:
    good = {"concurrency": 4, "sweep": "concurrency", "completed": 4, "failed": 0, "counts": True}
    bad = {**good, "completed": 3, "failed": 1, "counts": False}
    [level] = stats.merge_repeats([[good], [bad]])
    assert (level["completed"], level["failed"], level["counts"]) == (7, 1, False)
    assert level["sweep"] == "concurrency" and level["concurrency"] == 4


# --------------------------------------------------------------------------- ratios


def _level(x: int, tps: float, ttft: float, itl: float, **extra: Any) -> dict[str, Any]:
    level = {
        "sweep": "concurrency",
        "concurrency": x,
        "input_len": 128,
        "completed": 8,
        "failed": 0,
        "counts": True,
        "output_throughput": tps,
        "ttft_p50_ms": ttft,
        "itl_p50_ms": itl,
        **extra,
    }
    level["num_prompts"] = level["completed"] + level["failed"]
    return level


def test_sandwich_passes_merge_to_their_median() -> None:
    one = {"label": "h-1", "levels": [_level(16, 100.0, 300.0, 50.0)]}
    two = {"label": "h-2", "levels": [_level(16, 120.0, 200.0, 40.0)]}
    merged = compare.median_of_passes([one, two], "h")
    assert merged["passes"] == ["h-1", "h-2"]
    [level] = merged["levels"]
    assert (level["output_throughput"], level["ttft_p50_ms"], level["completed"]) == (
        110.0,
        250.0,
        16,
    )


def test_best_vllm_per_level_prefers_levels_that_count() -> None:
    fp32 = {"label": "vllm-float32", "levels": [_level(1, 20.0, 1, 1), _level(16, 140.0, 1, 1)]}
    bf16 = {
        "label": "vllm-bfloat16",
        "levels": [
            _level(1, 30.0, 1, 1),
            _level(16, 200.0, 1, 1, failed=3, counts=False),
        ],
    }
    best = compare.best_per_level([fp32, bf16], "best vllm")
    assert [(lv["concurrency"], lv["source"]) for lv in best["levels"]] == [
        (1, "vllm-bfloat16"),
        (16, "vllm-float32"),  # bf16 was faster there, but had failures
    ]
    ours = {"label": "hearth", "levels": [_level(1, 60.0, 1, 2), _level(16, 280.0, 1, 2)]}
    ratios = compare.compare_ratios(ours, best)
    assert [(r["baseline"], r["output_throughput"]) for r in ratios] == [
        ("vllm-bfloat16", 2.0),
        ("vllm-float32", 2.0),
    ]
    lines = report.format_ratios(ours, best).splitlines()
    assert lines[0].split() == [
        "level",
        "out",
        "tok/s",
        "TTFT",
        "p50",
        "ITL",
        "p50",
        "counts",
        "vs",
    ]
    assert lines[1].split() == ["c=1", "2.00x", "1.00x", "2.00x", "yes", "vllm-bfloat16"]
    assert lines[2].split() == ["c=16", "2.00x", "1.00x", "2.00x", "yes", "vllm-float32"]


def test_ratios_of_failed_levels_do_not_count() -> None:
    ours = {"label": "hearth", "levels": [_level(64, 100.0, 1, 1, failed=2, counts=False)]}
    other = {"label": "vllm", "levels": [_level(64, 50.0, 2, 1)]}
    [ratio] = compare.compare_ratios(ours, other)
    assert ratio["counts"] is False and ratio["output_throughput"] == 2.0
    assert report.format_ratios(ours, other).splitlines()[1].split() == [
        "c=64",
        "2.00x",
        "0.50x",
        "1.00x",
        "no",
        "(failures)",
        "vllm",
    ]


def test_prompt_length_levels_line_up_by_input_length() -> None:
    def pl(n: int, tps: float) -> dict[str, Any]:
        return {**_level(16, tps, 1, 1), "sweep": "prompt-len", "input_len": n}

    ours = {"label": "a", "levels": [pl(128, 10.0), pl(4096, 4.0), _level(16, 9.0, 1, 1)]}
    other = {"label": "b", "levels": [pl(4096, 2.0), _level(16, 3.0, 1, 1)]}
    ratios = compare.compare_ratios(ours, other)
    assert [(r["sweep"], r["input_len"], r["output_throughput"]) for r in ratios] == [
        ("prompt-len", 4096, 2.0),
        ("concurrency", 128, 3.0),
    ]
    rows = report.format_ratios(ours, other).splitlines()[1:]
    assert [row.split()[:2] for row in rows] == [["in=4096", "c=16"], ["c=16", "3.00x"]]


# --------------------------------------------------------------------------- report


AVX512_CPUINFO = """\
processor\t: 0
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni
processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni
"""


def _two_sweep_result(label: str, failed: int = 0) -> dict[str, Any]:
    return {
        "label": label,
        "config": {"model": "smollm2", "output_len": 128, "seed": 0},
        "levels": [
            _level(1, 20.0, 100.0, 40.0, output_len=128),
            _level(16, 150.0, 900.0, 90.0, output_len=128, failed=failed, counts=not failed),
            {**_level(16, 100.0, 3000.0, 95.0, output_len=128), "sweep": "prompt-len"},
            {
                **_level(16, 60.0, 9000.0, 99.0, output_len=128),
                "sweep": "prompt-len",
                "input_len": 4096,
            },
        ],
    }


def test_table_has_a_section_per_sweep_and_flags_failures() -> None:
    text = report.format_table([_two_sweep_result("hearth", failed=2), _two_sweep_result("vllm")])
    lines = text.splitlines()
    assert lines[0] == "concurrency sweep: 128 in / 128 out"
    assert lines[1].split()[:3] == ["label", "conc", "ok/n"]
    assert [line.split()[:3] for line in lines[2:6]] == [
        ["hearth", "1", "8/8"],
        ["vllm", "1", "8/8"],
        ["hearth", "16", "8/10!"],
        ["vllm", "16", "8/8"],
    ]
    # The sweep with a failed level does not count as a whole, and says so under its table.
    assert lines[6] == "! hearth: 2 request(s) failed in the concurrency sweep; it does not count"
    assert lines[8] == "prompt-len sweep: c=16, 128 out"
    assert lines[9].split()[:2] == ["label", "in"]
    assert [line.split()[1] for line in lines[10:14]] == ["128", "128", "4096", "4096"]
    assert lines[14] == "(latencies in ms)" and "does not count" in lines[-1]


def test_outputs_name_the_host_and_hold_the_ratios(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(AVX512_CPUINFO)
    the_host = host.detect_host(cpuinfo)
    ours, other = _two_sweep_result("hearth"), _two_sweep_result("vllm-float32", failed=1)
    paths = report.write_outputs(ours, [other], tmp_path, the_host, [(ours, other)])
    assert [p.name for p in paths] == ["results.json", "results.md", "results.svg"]
    saved = json.loads(paths[0].read_text())
    assert saved["host"]["cpu_model"] == "AMD EPYC 9R14"
    assert saved["host"]["isa_class"] == "AVX-512 + BF16"
    [pair] = saved["ratios"]
    assert (pair["ours"], pair["baseline"]) == ("hearth", "vllm-float32")
    assert [r["counts"] for r in pair["levels"]] == [True, False, True, True]
    markdown = paths[1].read_text()
    assert "- host: AMD EPYC 9R14, 2 logical CPUs, AVX-512 + BF16" in markdown
    assert "## concurrency sweep" in markdown and "## prompt-len sweep" in markdown
    assert "| vllm-float32 | 16 | 8/9! |" in markdown
    assert "## Ratios hearth / vllm-float32; out tok/s: higher is better" in markdown
    assert "| c=16 | 1.00x | 1.00x | 1.00x | no (failures) | vllm-float32 |" in markdown
    svg = ET.parse(paths[2]).getroot()
    rects = [el for el in svg.iter() if el.tag.endswith("rect") and el.get("height")]
    # 2 sweeps x 3 panels x (2 + 2 levels x 2 servers) bars, plus background and legend.
    bars = [r for r in rects if r.get("fill") not in ("white",) and r.get("width") != "12"]
    assert len(bars) == 2 * 3 * 4
    assert sum(r.get("fill-opacity") == "0.3" for r in bars) == 3  # the failed level, 3 panels


# --------------------------------------------------------------------------- host


def test_cpuinfo_and_lscpu_give_the_same_facts() -> None:
    from_cpuinfo = host.parse_cpuinfo(AVX512_CPUINFO)
    lscpu = "Architecture: x86_64\nCPU(s): 2\nModel name: AMD EPYC 9R14\nFlags: avx2 avx512f fma"
    from_lscpu = host.parse_lscpu(lscpu)
    assert from_cpuinfo["cpu_model"] == from_lscpu["cpu_model"] == "AMD EPYC 9R14"
    assert from_cpuinfo["logical_cpus"] == from_lscpu["logical_cpus"] == 2
    assert {"avx2", "avx512f", "fma"} <= from_cpuinfo["flags"] & from_lscpu["flags"]


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "AMX"),
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX-512 + BF16"),
        ({"avx2", "avx512f"}, "AVX-512"),
        ({"avx2", "fma"}, "AVX2"),
        ({"sse4_2"}, "pre-AVX2"),
    ],
)
def test_isa_class_names_the_widest_path(flags: set[str], expected: str) -> None:
    assert host.isa_class(flags) == expected


def test_host_line_says_what_is_missing(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nmodel name : Some CPU\nflags : fpu avx avx2 fma\n")
    found = host.detect_host(cpuinfo)
    assert found["isa"] == ["avx2", "fma"] and found["source"] == str(cpuinfo)
    line = host.describe_host(found)
    assert line.startswith("Some CPU, 1 logical CPUs, AVX2 (avx2 fma; no avx512f")
    assert "no amx" in line


# --------------------------------------------------------------------------- flags


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hearth")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_defaults_are_issue_7s_sweeps() -> None:
    args = _parse([])
    config = build_config(args, "http://x", "m")
    assert config.concurrencies == (1, 4, 16, 64, 128)
    assert config.prompt_lens == (128, 1024, 4096) and config.prompt_len_concurrency == 16
    assert (config.input_len, config.output_len, config.quick) == (128, 128, False)
    assert args.compare == [] and args.compare_dtypes == "float32" and not args.sandwich


def test_compare_alone_means_vllm_and_with_a_file_means_the_file() -> None:
    args = _parse(["--compare", "--compare", "old.json", "--compare-dtypes", "float32,bfloat16"])
    assert args.compare == [COMPARE_VLLM, "old.json"]
    assert cli.parse_dtypes(args.compare_dtypes) == ["float32", "bfloat16"]


def test_sweeps_flag_selects_sweeps() -> None:
    only_len = build_config(_parse(["--sweeps", "prompt-len", "--quick"]), "x", "m")
    assert only_len.concurrencies == () and [s.num_prompts for s in only_len.levels] == [16] * 3
    with pytest.raises(ValueError, match="--sweeps"):
        build_config(_parse(["--sweeps", "latency"]), "x", "m")


def test_vllm_comparison_needs_spawned_hearth_and_the_anchor(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="need --spawn-server"):
        validate(_parse(["--compare"]))
    with pytest.raises(ValueError, match="need --spawn-server"):
        validate(_parse(["--sandwich"]))
    with pytest.raises(ValueError, match=r"setup-vllm-cpu\.sh"):
        validate(_parse(["--spawn-server", "--compare", "--anchor-dir", str(tmp_path)]))


def test_vllm_is_started_as_serve_vllm_cpu_sh_does(tmp_path: Path) -> None:
    command = anchor.vllm_command(tmp_path, 8100, "bfloat16", 4224, ["--enforce-eager"])
    assert command[:3] == [
        str(tmp_path / "vllm-venv/bin/vllm"),
        "serve",
        str(tmp_path / anchor.MODEL_SUBDIR),
    ]
    text = " ".join(command)
    assert "--host 127.0.0.1 --port 8100 --served-model-name smollm2" in text
    assert "--max-model-len 4224 --dtype bfloat16 --enforce-eager" in text
    assert "--max-model-len 2048" in " ".join(anchor.vllm_command(tmp_path, 1, "float32", 256))
    env = anchor.vllm_env()
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" in env


# --------------------------------------------------------------------------- passes


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer()
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_each_pass_draws_fresh_prompts(fake_server: FakeServer) -> None:
    config = BenchConfig(
        base_url=fake_server.base_url,
        model=MODEL,
        concurrencies=(2,),
        num_prompts=(2,),
        input_len=8,
        output_len=2,
        prompt_lens=(8,),
        prompt_len_concurrency=2,
        prompt_len_num_prompts=2,
        warmup=0,
    )
    for pass_key in ("0", "1"):
        load.run_benchmark(config, "fake", log=lambda _: None, pass_key=pass_key)
    prompts = [tuple(body["prompt"]) for body in fake_server.behaviour.requests]
    # 2 passes x 2 sweeps x 2 requests, all 8 tokens long, no two alike: the 8-token level
    # of the prompt-length sweep does not reuse the concurrency sweep's prompts either.
    assert len(prompts) == 8 and len(set(prompts)) == 8


def test_sandwich_order() -> None:
    subject = ServerPlan(label="hearth", base_url="http://h")
    baselines = [ServerPlan(label=f"vllm-{d}", role=BASELINE) for d in ("fp32", "bf16")]
    assert [p.label for p in sandwich(subject, baselines, again=True)] == [
        "hearth-1",
        "vllm-fp32",
        "vllm-bf16",
        "hearth-2",
    ]
    assert [p.label for p in sandwich(subject, baselines, again=False)] == [
        "hearth",
        "vllm-fp32",
        "vllm-bf16",
    ]


def test_a_server_that_fails_to_start_ends_the_session(tmp_path: Path) -> None:
    def measure(url: str, plan: ServerPlan, index: int) -> dict[str, Any]:
        return {"label": plan.label, "levels": []}

    plans = [
        ServerPlan(label="ok", base_url="http://unused"),
        ServerPlan(label="broken", command=lambda port: [sys.executable, "-c", "exit(3)"]),
        ServerPlan(label="never", base_url="http://unused"),
    ]
    results, error = run_session(plans, measure, tmp_path, 30.0, log=lambda _: None)
    assert [r["label"] for r in results] == ["ok"]
    assert error is not None and error.startswith("broken: the server exited with code 3")


def _fake_anchor(tmp_path: Path, events: Path) -> Path:
    """An anchor dir whose `vllm` is the fake server (it ignores vLLM's other arguments)."""
    home = tmp_path / "anchor"
    (home / anchor.MODEL_SUBDIR).mkdir(parents=True)
    (home / anchor.MODEL_SUBDIR / "config.json").write_text("{}")
    binary = anchor.vllm_binary(home)
    binary.parent.mkdir(parents=True)
    binary.write_text(
        f"#!/bin/sh\nexec {sys.executable} {fake_openai.__file__} --name vllm "
        f'--events {events} "$@"\n'
    )
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return home


def test_compare_sandwich_runs_one_server_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    events = tmp_path / "events.txt"

    def fake_hearth(port: int, server_args: list[str], max_model_len: int | None) -> list[str]:
        script = [sys.executable, fake_openai.__file__, "--port", str(port)]
        return [*script, "--name", "hearth", "--events", str(events), f"--ctx={max_model_len}"]

    monkeypatch.setattr(cli, "serve_command", fake_hearth)
    argv = ["--spawn-server", "--compare", "--sandwich", "--compare-dtypes", "float32,bfloat16"]
    argv += ["--anchor-dir", str(_fake_anchor(tmp_path, events)), "--server-timeout", "60"]
    argv += ["--concurrency", "1", "2", "--num-prompts", "2", "--input-len", "8"]
    argv += ["--prompt-lens", "8", "32", "--prompt-len-concurrency", "2"]
    argv += ["--prompt-len-num-prompts", "2", "--output-len", "3", "--warmup", "0"]
    out_dir = tmp_path / "out"
    parser = argparse.ArgumentParser(prog="hearth")
    cli.add_bench_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *argv, "--output-dir", str(out_dir)])
    code = args.func(args)
    captured = capsys.readouterr()
    print(captured.out, captured.err)
    assert code == 0

    lines = events.read_text().splitlines()
    # Strictly start, stop, start, stop...: no server ever started while another ran.
    assert [line.split()[:2] for line in lines] == [
        ["start", "hearth"],
        ["stop", "hearth"],
        ["start", "vllm"],
        ["stop", "vllm"],
        ["start", "vllm"],
        ["stop", "vllm"],
        ["start", "hearth"],
        ["stop", "hearth"],
    ]
    assert lines[0].endswith("--ctx=2048")
    assert lines[2].endswith("--max-model-len 2048 --dtype float32")
    assert lines[4].endswith("--dtype bfloat16")

    saved = json.loads((out_dir / "results.json").read_text())
    labels = [saved["label"], *(r["label"] for r in saved["compare"])]
    assert labels == ["hearth-1", "vllm-float32", "vllm-bfloat16", "hearth-2"]
    assert [r["server"]["dtype"] for r in saved["compare"][:2]] == ["float32", "bfloat16"]
    assert all(r["server"]["ready_s"] is not None for r in [saved, *saved["compare"]])
    assert all("loadavg_at_start" in r["server"] for r in [saved, *saved["compare"]])
    assert [(r["ours"], r["baseline"]) for r in saved["ratios"]] == [
        ("hearth", "vllm-float32"),
        ("hearth", "vllm-bfloat16"),
        ("hearth", "best vllm"),
        ("hearth-2", "hearth-1"),  # drift of the host between the two hearth passes
    ]
    assert all(len(r["levels"]) == 4 for r in saved["ratios"])  # c=1, c=2, in=8, in=32
    assert saved["host"]["isa_class"] in ("AMX", "AVX-512 + BF16", "AVX-512", "AVX2", "pre-AVX2")
    assert "ratios hearth / best vllm (hearth = median of hearth-1, hearth-2)" in captured.out
    assert any(line.startswith("in=32 c=2 ") for line in captured.out.splitlines())
    assert "host: " in captured.out
    for name in ("hearth-1", "vllm-float32", "vllm-bfloat16", "hearth-2"):
        assert (out_dir / f"server-{name}.log").exists()
