"""The device check's CPU dry run: the same script, tiny models and counts, Triton in the
interpreter, the CUDA-graph hook through its eager stand-in. It keeps ``make gpu-check``
from rotting between GPU runs; it measures nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # starts a real server
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU stand-in")
def test_gpu_check_dry_run_writes_its_report(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu.check", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    secs = result["sections"]
    assert result["dry_run"] is True
    assert list(secs) == ["env", "kernels", "parity", "throughput", "server", "cpu"]
    assert all(s["status"] == "ok" for s in secs.values()), secs
    assert secs["env"]["copy_bandwidth_gb_s"] > 0
    assert secs["kernels"]["failures"] == secs["kernels"]["errors"] == 0
    models = {k: v for k, v in secs["parity"].items() if isinstance(v, dict)}
    assert list(models) == ["tiny-llama"]
    for model in models.values():
        assert model["fp32_greedy_eager"]["identical"]
        assert model["fp32_greedy_graphs"]["identical"]
        assert model["fp32_greedy_graphs"]["graph_replays"] > 0  # the hook really replayed
        assert model["bf16_teacher_forced"]["top1_agreement"] >= 0.99
    tp = secs["throughput"]
    assert [r["concurrency"] for r in tp["graphs"]["rows"]] == [1, 2]
    assert all(r["output_tok_s"] > 0 for r in tp["eager"]["rows"] + tp["transformers"])
    assert secs["server"]["chat_status"] == secs["server"]["stream_status"] == 200
    assert secs["server"]["stream_equals_chat"]
    from kernels.cpu.build import host_isa

    cpu = secs["cpu"]
    assert cpu["variants"] == list(host_isa().supported) and cpu["cores"] >= 1
    assert cpu["tests"] > 0 and cpu["failures"] == cpu["errors"] == 0
    report = (tmp_path / "gpu-check.md").read_text()
    assert "| throughput | ok |" in report and f"CPU: {host_isa().cpu}" in report
