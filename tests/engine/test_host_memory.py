"""The CPU KV cache's budget never exceeds what the host or container has left
(engine/host_memory.py): the arithmetic, the parsing of /proc/meminfo and both cgroup
layouts (on written copies of those files), and the real host's figure; and the freed heap
handed back after loading."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_freed_heap_memory_goes_back_to_the_kernel() -> None:
    """1 MiB temporaries freed between 4 KiB arrays that stay (as gguf-py's dequantization
    leaves them) keep ~300 MiB resident until `return_freed_heap`. A fresh interpreter: the
    heap's layout must be this test's alone."""
    code = """
import numpy as np
from engine.host_memory import return_freed_heap
def anon():
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    return int(status["RssAnon"].split()[0]) / 1024
big = np.ones(8 << 20, np.uint8); del big  # glibc raises its mmap threshold past 1 MiB
kept, temporaries = [], []
for _ in range(300):
    temporaries.append(np.ones(1 << 20, np.uint8))
    kept.append(np.ones(4096, np.uint8))
del temporaries
before = anon()
assert return_freed_heap()
print(before, anon())
"""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc_trim: this host's C library is not glibc")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    before, after = map(float, done.stdout.split())
    assert before > 250 and after < before - 200, (before, after)


def test_a_steps_freed_tensors_serve_the_next_step_without_page_faults() -> None:
    """After `keep_freed_heap_for_reuse`, a step that allocates and frees a batch's scaled
    logits, probabilities and a copy (12.6 MB each) faults no pages in: the heap keeps
    them. Under glibc's own thresholds it returned them to the kernel at each free (9,184
    faults a step in 4 of 5 processes here, each a page the kernel zeroes). Fresh
    interpreters, three: the heap's settings must be this test's alone."""
    code = """
import resource, torch
from engine.host_memory import keep_freed_heap_for_reuse, return_freed_heap
torch.set_num_threads(1)
logits = torch.randn(64, 49152)
del logits  # glibc now takes blocks this size from the heap, trimming past twice it
logits = torch.randn(64, 49152)
return_freed_heap()  # as the engine does once its weights are loaded, then
assert keep_freed_heap_for_reuse()
def step():  # three alive at once, as in the sampler: logits / t, probabilities, the cut
    scaled = logits / 0.8
    probs = scaled.softmax(-1)
    kept = probs.clone()
    return float(kept[0, 0])
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults)[10])
"""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's mallopt: this host's C library is not glibc")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for _ in range(3):  # glibc's own thresholds fault ~9,200 pages a step in most processes
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        median_faults = float(done.stdout)  # the heap may still grow once: the median step
        assert median_faults < 50, median_faults  # of the ~9,200 pages a step allocates


def _mapping_of(address: int) -> dict[str, str]:
    """This process's /proc/self/smaps entry for the mapping that holds `address`."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # "start-end perms offset dev inode [path]"
            start, end = (int(x, 16) for x in head.split("-"))
            entry = {} if start <= address < end else None
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
            if key == "VmFlags":
                return entry
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/smaps (Linux)")
def test_the_kv_pool_commits_only_the_4_kib_pages_written() -> None:
    """A 64 MiB pool is zero, writable, and commits a 4 KiB page per scattered write: it is
    advised off transparent huge pages (VmFlags `nh`), whose first write would commit (and,
    in a Firecracker VM, slowly fault in) a whole 2 MiB each."""
    import torch

    from engine.host_memory import zeros_on_touch

    shape = (16, 4096, 256)  # 64 MiB of float32
    pool = zeros_on_touch(shape, torch.float32, torch.device("cpu"))
    assert pool.shape == shape and pool.dtype == torch.float32
    mapping = _mapping_of(pool.data_ptr())
    assert "nh" in mapping["VmFlags"].split(), mapping["VmFlags"]
    assert int(mapping["Rss"].split()[0]) == 0  # nothing committed yet
    for layer in range(16):
        pool[layer, layer * 200, 7] = float(layer + 1)
    mapping = _mapping_of(pool.data_ptr())
    assert int(mapping["Rss"].split()[0]) <= 16 * 4, mapping["Rss"]  # KiB: one page a write
    assert int(mapping["AnonHugePages"].split()[0]) == 0
    assert float(pool.sum()) == sum(range(1, 17))  # the rest still reads as zero
    assert zeros_on_touch((0, 4), torch.int8, torch.device("cpu")).shape == (0, 4)
