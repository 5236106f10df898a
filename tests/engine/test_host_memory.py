"""The CPU KV cache's budget never exceeds what the host or container has left
(engine/host_memory.py): the arithmetic, the parsing of /proc/meminfo and both cgroup
layouts (on written copies of those files), and the real host's figure."""

from __future__ import annotations

from pathlib import Path

from engine.host_memory import CPU_RESERVE_MIN, available_bytes, cpu_kv_budget_bytes

GIB = 1 << 30


def test_the_budget_is_the_default_or_what_is_needed_until_memory_runs_short() -> None:
    assert cpu_kv_budget_bytes(100 * GIB, 20 * GIB, 4 * GIB) == (4 * GIB, False)
    assert cpu_kv_budget_bytes(GIB, 20 * GIB, 4 * GIB) == (GIB, False)  # every sequence fits
    assert cpu_kv_budget_bytes(100 * GIB, None, 4 * GIB) == (4 * GIB, False)  # unknown
    # 3 GiB left: the reserve (1 GiB, more than a tenth) stays free, the cache takes the rest.
    assert cpu_kv_budget_bytes(100 * GIB, 3 * GIB, 4 * GIB) == (2 * GIB, True)
    # 4.4 GiB left: a tenth is less than the minimum reserve.
    budget, capped = cpu_kv_budget_bytes(100 * GIB, int(4.4 * GIB), 4 * GIB)
    assert capped and budget == int(4.4 * GIB) - CPU_RESERVE_MIN
    # 40 GiB left and a budget asked that large: a tenth (4 GiB) is the reserve.
    assert cpu_kv_budget_bytes(100 * GIB, 40 * GIB, 40 * GIB) == (36 * GIB, True)
    assert cpu_kv_budget_bytes(100 * GIB, GIB // 2, 4 * GIB) == (0, True)  # nothing left


def _meminfo(tmp_path: Path, available_kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(
        f"MemTotal:       24683784 kB\nMemFree:         1000000 kB\n"
        f"MemAvailable:   {available_kib} kB\nBuffers:          123 kB\n"
    )
    return path


def test_available_memory_is_the_smaller_of_the_host_and_the_cgroup_headroom(
    tmp_path: Path,
) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{8 * GIB}\n")
    (v2 / "memory.current").write_text(f"{6 * GIB}\n")
    (v2 / "memory.stat").write_text(f"anon {4 * GIB}\ninactive_file {2 * GIB}\n")
    # working set 6 - 2 = 4 GiB of an 8 GiB limit: 4 GiB left, less than the host's 16
    assert available_bytes(_meminfo(tmp_path, 16 * 2**20), v2) == 4 * GIB
    assert available_bytes(_meminfo(tmp_path, 2**20), v2) == GIB  # the host is the limit
    (v2 / "memory.max").write_text("max\n")  # no container limit
    assert available_bytes(_meminfo(tmp_path, 16 * 2**20), v2) == 16 * GIB

    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{10 * GIB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{9 * GIB}\n")
    (v1 / "memory" / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {3 * GIB}\n")
    assert available_bytes(_meminfo(tmp_path, 16 * 2**20), v1) == 4 * GIB
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
    assert available_bytes(_meminfo(tmp_path, 16 * 2**20), v1) == 16 * GIB
    assert available_bytes(tmp_path / "absent", tmp_path / "absent") is None


def test_this_host_reports_a_plausible_figure() -> None:
    total = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    available = available_bytes()
    assert available is not None and 0 < available <= total
