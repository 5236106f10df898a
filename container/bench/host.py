"""The host a run was measured on: CPU model and the ISA extensions that decide CPU speed.

Figures from different x86 hosts do not compare: vLLM's CPU build and hearth's kernels both
pick code paths by what the CPU has (AVX2 only, AVX-512, AVX512-BF16/VNNI, AMX), and on an
AVX2-only host bf16 was measured 6.5x slower than fp32 in prefill (anchors/README.md). So
every report names the host. Read from /proc/cpuinfo, else from `lscpu`; nothing needs root.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

# The extensions worth naming, in the order a report lists them.
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """CPU model, logical CPU count and flags from /proc/cpuinfo's text (first CPU's entry)."""
    model, flags, cpus = None, "", 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "processor":
            cpus += 1
        elif key == "model name" and model is None:
            model = value
        elif key == "flags" and not flags:
            flags = value
    return {"cpu_model": model, "logical_cpus": cpus or None, "flags": set(flags.split())}


def parse_lscpu(text: str) -> dict[str, Any]:
    """The same three facts from `lscpu`'s `Key: value` output."""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    cpus = fields.get("CPU(s)", "")
    return {
        "cpu_model": fields.get("Model name") or None,
        "logical_cpus": int(cpus) if cpus.isdigit() else None,
        "flags": set(fields.get("Flags", "").split()),
    }


def isa_class(flags: set[str]) -> str:
    """The widest matrix/vector path the host offers, as a short name for tables."""
    if {"amx_tile", "amx_bf16"} <= flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX-512 + BF16"
    if "avx512f" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    return "pre-AVX2"


def _read_cpu(cpuinfo: Path) -> tuple[dict[str, Any], str]:
    try:
        info = parse_cpuinfo(cpuinfo.read_text())
        if info["cpu_model"] or info["flags"]:
            return info, str(cpuinfo)
    except OSError:
        pass
    lscpu = shutil.which("lscpu")
    if lscpu:
        try:
            done = subprocess.run(
                [lscpu], capture_output=True, text=True, timeout=10, env={"LC_ALL": "C"}
            )
            return parse_lscpu(done.stdout), "lscpu"
        except (OSError, subprocess.SubprocessError):
            pass
    return {"cpu_model": None, "logical_cpus": None, "flags": set()}, "unknown"


def detect_host(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, Any]:
    """What results.json records under "host"; JSON-ready."""
    info, source = _read_cpu(Path(cpuinfo))
    flags: set[str] = info["flags"]
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu_model": info["cpu_model"] or platform.processor() or None,
        "logical_cpus": info["logical_cpus"] or os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "isa": [flag for flag in ISA_FLAGS if flag in flags],
        "isa_class": isa_class(flags),
        "source": source,
        "machine": platform.machine(),
        "kernel": platform.release(),
        # Other load on the host skews every figure: the load average when the run began.
        "loadavg_at_start": load,
    }


def describe_host(host: dict[str, Any]) -> str:
    """One line for stdout and the Markdown report."""
    missing = [
        flag
        for flag in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni")
        if flag not in host.get("isa", [])
    ]
    amx = any(flag.startswith("amx") for flag in host.get("isa", []))
    parts = [
        f"{host.get('cpu_model') or 'unknown CPU'}",
        f"{host.get('logical_cpus')} logical CPUs",
        f"{host.get('isa_class')} ({' '.join(host.get('isa', [])) or 'no listed ISA flag'}"
        + (f"; no {' '.join(missing)}" if missing else "")
        + ("" if amx else "; no amx")
        + ")",
    ]
    if host.get("loadavg_at_start") is not None:
        parts.append("load average at start " + " ".join(map(str, host["loadavg_at_start"])))
    return ", ".join(parts)
