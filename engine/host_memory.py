"""How much memory a CPU engine may still commit, and the KV cache's share of it.

The CPU KV cache is allocated at start-up but committed only as blocks are written
(`zeros_on_touch`), so a budget the host can't hold does not fail
at start: it fails under load, when the kernel's OOM killer ends the engine in the middle
of serving. vLLM-CPU takes a fixed 4 GiB (``VLLM_CPU_KVCACHE_SPACE``) whatever is left;
hearth takes the same default, but never more than what the host, or the container's
memory limit, still has after the weights are loaded, less a reserve for everything a
step and the API workers allocate beside the cache.

Available memory is the smaller of the kernel's ``MemAvailable`` and the cgroup's headroom
(v2 ``memory.max`` / v1 ``memory.limit_in_bytes``, less the working set: usage without
the page cache the kernel can drop, as the kubelet counts it). The files are parameters so
the parsing is tested on written copies.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = [
    "CPU_RESERVE_MIN",
    "available_bytes",
    "cpu_kv_budget_bytes",
    "keep_freed_heap_for_reuse",
    "return_freed_heap",
    "zeros_on_touch",
]

CPU_RESERVE_MIN = 1 << 30
"""Bytes left free beside the KV cache at least (a tenth of what is available where that is
more): the API workers and grammar compilers, a step's activations and logits, the
allocator's slack."""

_NO_LIMIT = 1 << 60
"""cgroup v1 writes an unlimited limit as a page-rounded 2^63 - 1."""


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return 0
    return 0


def _cgroup_headroom(cgroup: Path) -> int | None:
    """The container's memory limit less its working set, or None without a limit."""
    for limit_file, usage_file, stat_key in (
        ("memory.max", "memory.current", "inactive_file"),  # v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_inactive_file"),
    ):
        limit = _read_int(cgroup / limit_file)
        usage = _read_int(cgroup / usage_file)
        if limit is None or usage is None or limit >= _NO_LIMIT:
            continue
        stat = cgroup / Path(limit_file).parent / "memory.stat"
        working_set = max(0, usage - _stat(stat, stat_key))
        return max(0, limit - working_set)
    return None


def available_bytes(
    meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Bytes this process may still commit: the smaller of the host's ``MemAvailable`` and
    the cgroup's headroom; None where neither can be read (not Linux)."""
    found = [b for b in (_meminfo_available(meminfo), _cgroup_headroom(cgroup)) if b is not None]
    return min(found) if found else None


def cpu_kv_budget_bytes(needed: int, available: int | None, default: int) -> tuple[int, bool]:
    """The CPU KV cache's bytes: `default` (vLLM-CPU's 4 GiB), or `needed` (every sequence
    at its full length) when that is less, but no more than `available` less the reserve.
    Returns the budget and whether the available memory is what capped it."""
    budget = min(default, needed)
    if available is None:
        return budget, False
    usable = max(0, available - max(CPU_RESERVE_MIN, available // 10))
    return (usable, True) if usable < budget else (budget, False)


def _libc(name: str) -> Callable[..., int] | None:
    """The C library's function `name` (int arguments), or None where it has none (not
    glibc)."""
    import ctypes

    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def return_freed_heap() -> bool:
    """Hand the free pages of the C heap back to the kernel (glibc's `malloc_trim(0)`);
    False where there is no such call (another C library).

    Why, once the weights are loaded: gguf-py dequantizes a GGUF's tensors in numpy, whose
    mid-sized temporaries land on the heap (glibc raises its mmap threshold to 32 MiB once a
    big block is freed) between blocks that stay, so freeing them shrinks nothing: after an
    8 B Q4_K_M load 0.9 GiB of freed memory stayed resident (anonymous 6.09 GiB, 5.17 GiB
    after the trim), counted as used when the KV cache's budget is taken and by the OOM
    killer."""
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


STEP_HEAP_KEEP = 256 << 20
"""Free bytes at the top of the C heap kept for the next step rather than returned to the
kernel (glibc's ``M_TRIM_THRESHOLD``)."""
STEP_HEAP_BLOCK_MAX = 32 << 20
"""Blocks up to this size come from the heap, larger ones get a mapping of their own
(``M_MMAP_THRESHOLD``; 32 MiB is the most glibc accepts on 64-bit hosts)."""


def keep_freed_heap_for_reuse(keep: int = STEP_HEAP_KEEP) -> bool:
    """Let the C heap keep what a step frees for the next step (glibc's `mallopt`); False
    where there is no such call (another C library) or it refuses the values.

    Why: a step allocates and frees the same large tensors every time (a batch's logits,
    their scaled copy and probabilities: 12.6 MB each for 64 rows of a 49,152-token
    vocabulary). Under glibc's own thresholds (trim at twice the largest block freed) the
    heap gave them back to the kernel at each free, so every step faulted their pages in
    again, each zeroed by the kernel: ~4,200 page faults a step for 64 sampled rows, the
    sampler alone 12.7 ms instead of 4.5 (docs/performance.md). Called once the weights are
    loaded, after `return_freed_heap` has given back what loading left behind: the heap
    then holds at most `keep` bytes it does not use."""
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(m_trim_threshold, keep)) and bool(
        mallopt(m_mmap_threshold, STEP_HEAP_BLOCK_MAX)
    )


def zeros_on_touch(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zero tensor whose CPU memory is committed only as it is written, page by page.

    On CPU it is a private anonymous mapping: the kernel hands out a zero page on the first
    write to each, so a 4 GiB KV cache costs RAM only for the blocks in use, where
    `torch.zeros` would write (and commit) every byte at start-up.

    The mapping refuses transparent huge pages (``MADV_NOHUGEPAGE``). With them (numpy.zeros,
    which this was, asks for them on every array of 4 MiB or more; the kernel's ``always``
    mode gives them unasked) the first write into a 2 MiB region zeroes and commits all of
    it: the first request's few blocks in each layer's keys and values committed ~240 MB
    for the default model, and in a Firecracker VM (this project's CI hosts; AWS Lambda),
    where memory the guest touches for the first time costs ~13 ms per MB, its first step
    took 3.2 s instead of 0.08 s. Attention reads whole blocks, so decode steps measured no
    slower on 4 KiB pages (docs/performance.md, "The KV cache on 4 KiB pages").
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(
        -1,
        nbytes,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype).view(shape)  # the tensor keeps `pages` mapped
