"""Build (once) and locate the C kernels of the CPU fast path, by the host's ISA.

The library is compiled by the system C compiler at `make setup` and at image build
(`python -m kernels.cpu.build`), into a cache keyed by the source, the flags and the
compiler, so the engine only ever loads a finished file. If the file is missing at engine
start (a new cache directory), the engine compiles it then, before it reports ready:
about a second, never on a request path.

Variants: ``avx512`` (x86-64-v4: AVX-512 F/BW/DQ/VL, 32 vector registers) on hosts that
have it, else ``avx2`` (AVX2 + FMA + F16C, x86-64-v3). Hosts with neither use the torch
path; `host_isa()` says what the host has and which variant runs.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("hearth_cpu.c")

_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-march=x86-64-v4", "-mf16c", "-mfma"],
}
_BASE_FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno"]
_REPORTED = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq")
_EXTRA = ("avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")


@dataclass(frozen=True, slots=True)
class HostISA:
    """What the CPU offers and which kernel variant hearth runs on it."""

    cpu: str
    flags: tuple[str, ...]
    """The ISA extensions among those hearth cares about."""
    variant: str | None
    """``avx512`` | ``avx2`` | None (no fast path: the torch kernels run)."""

    def describe(self) -> str:
        isa = " ".join(self.flags) or "none of avx2/avx512"
        return f"{self.cpu} [{isa}] -> kernels: {self.variant or 'torch (no AVX2)'}"


def _cpuinfo() -> tuple[str, set[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), set()
    model, flags = platform.machine(), set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == platform.machine():
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


@functools.cache
def host_isa() -> HostISA:
    model, flags = _cpuinfo()
    have = tuple(f for f in (*_REPORTED, *_EXTRA) if f in flags)
    variant: str | None = None
    if platform.machine() in ("x86_64", "AMD64"):
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "f16c", "fma"} <= flags:
            variant = "avx512"
        elif {"avx2", "fma", "f16c"} <= flags:
            variant = "avx2"
    forced = os.environ.get("HEARTH_CPU_VARIANT")
    if forced in _FLAGS and (forced == "avx2" and variant is not None):
        variant = forced  # a diagnostic downgrade (avx512 host running the avx2 build)
    return HostISA(model, have, variant)


def cache_dir() -> Path:
    root = os.environ.get("HEARTH_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hearth" / "kernels"


def _compiler() -> str:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or "cc"


@functools.cache
def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


def library_path(variant: str) -> Path:
    """Where the build of `variant` for this source, flags and compiler lives."""
    cc = _compiler()
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(" ".join([*_BASE_FLAGS, *_FLAGS[variant]]).encode())
    digest.update(_compiler_version(cc).encode())
    return cache_dir() / f"libhearth_cpu-{variant}-{digest.hexdigest()[:16]}.so"


def build(variant: str, *, quiet: bool = False) -> Path:
    """Compile `variant` unless its cached build exists; returns the library path.

    Writes to a temp file and renames it into place, so concurrent starts never load a
    half-written library.
    """
    out = library_path(variant)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cc = _compiler()
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cc, *_BASE_FLAGS, *_FLAGS[variant], str(SOURCE), "-o", tmp, "-lm"]
    if not quiet:
        print(f"hearth: compiling CPU kernels ({variant}) -> {out}", file=sys.stderr, flush=True)
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise RuntimeError(f"compiling {SOURCE.name} failed:\n{exc.stderr}") from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernels.cpu.build",
        description="Compile hearth's CPU kernels for this host (cached; run at setup and image build).",
    )
    parser.add_argument(
        "--variant",
        action="append",
        choices=sorted(_FLAGS),
        help="variant(s) to build (default: the one this host runs; an image build may ask for both)",
    )
    args = parser.parse_args(argv)
    isa = host_isa()
    print(f"host: {isa.describe()}")
    variants = args.variant or ([isa.variant] if isa.variant else [])
    if not variants:
        print("no AVX2 on this host: the engine will use the torch kernels")
        return 0
    for variant in variants:
        print(f"{variant}: {build(variant, quiet=True)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
