"""Build (once) and locate the C kernels of the CPU fast path, by the host's ISA.

The library is compiled by the system C compiler at `make setup` and at image build
(`python -m kernels.cpu.build`), into a cache keyed by the source, the flags and the
compiler, so the engine only ever loads a finished file. If the file is missing at engine
start (a new cache directory), the engine compiles it then, before it reports ready:
about a second, never on a request path.

Variants, lowest to highest: ``avx2`` (AVX2 + FMA + F16C, x86-64-v3), ``avx512``
(x86-64-v4: AVX-512 F/BW/DQ/VL, 32 vector registers), ``avx512_vnni`` (that + VNNI int8
dot products + BF16) and ``amx`` (that + AMX-INT8/BF16 tiles). The host runs the highest
one it has; a lower one can be forced (`select_variant`, from ``--cpu-isa``) so
each is testable on a higher host. Every variant compiles on any x86 host (`python -m
kernels.cpu.build --variant amx` works on an AVX2 machine); it only runs where the CPU has
the ISA. Hosts without AVX2 use the torch path; `host_isa()` says what the host has and
which variant runs.

Each variant is one shared library built from five C files: `hearth_cpu.c` (fp32
accumulation) with the flags it always had, `hearth_q8.c` (int8 activations) with
``-ffp-contract=off`` on top, since its results must be bitwise the same in every variant,
`hearth_attention_f32.c` (the AVX2 build's float32 prefill attention, bitwise
`hearth_cpu.c`'s loops: ``-ffp-contract=off`` too; an empty shell in the AVX-512 builds;
the two share `hearth_kv.h`),
`hearth_bf16.c` (bfloat16 linears: AMX-BF16 tiles, or AVX512-BF16 in ``avx512_vnni``) and
`hearth_attention_bf16.c` (bfloat16 prefill attention, the same two units); the last two
are empty shells below ``avx512_vnni``.
A cached library is only loaded if it and its directory belong to this user (or root)
and nobody else can write them.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("hearth_cpu.c")
Q8_SOURCE = Path(__file__).with_name("hearth_q8.c")
BF16_SOURCE = Path(__file__).with_name("hearth_bf16.c")
ATTENTION_BF16_SOURCE = Path(__file__).with_name("hearth_attention_bf16.c")
ATTENTION_F32_SOURCE = Path(__file__).with_name("hearth_attention_f32.c")
SAMPLING_SOURCE = Path(__file__).with_name("hearth_sampling.c")
KV_HEADER = Path(__file__).with_name("hearth_kv.h")
"""Included by hearth_cpu.c and both attention files: part of the build's key."""

_V4 = ["-march=x86-64-v4", "-mf16c", "-mfma"]
_VNNI = [*_V4, "-mavx512vnni", "-mavx512bf16"]
_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": _V4,
    "avx512_vnni": _VNNI,
    "amx": [*_VNNI, "-mamx-tile", "-mamx-int8", "-mamx-bf16"],
}
VARIANTS = ("avx2", "avx512", "avx512_vnni", "amx")
"""Lowest to highest."""
_NEEDS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
}
_NEEDS["avx512_vnni"] = _NEEDS["avx512"] | {"avx512_vnni", "avx512_bf16"}
_NEEDS["amx"] = _NEEDS["avx512_vnni"] | {"amx_tile", "amx_int8", "amx_bf16"}
_BASE_FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-fopenmp", "-fno-math-errno"]
_Q8_FLAGS = ["-ffp-contract=off"]
_LINK_FLAGS = ["-shared", "-fopenmp"]
_REPORTED = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq")
_EXTRA = ("avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")


@dataclass(frozen=True, slots=True)
class HostISA:
    """What the CPU offers and which kernel variant hearth runs on it."""

    cpu: str
    flags: tuple[str, ...]
    """The ISA extensions among those hearth cares about."""
    variant: str | None
    """One of `VARIANTS` | None (no fast path: the torch kernels run)."""
    supported: tuple[str, ...] = ()
    """Every variant this host can run, lowest first."""

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


def host_isa(forced: str | None = None) -> HostISA:
    """What the host has and the variant it runs: the highest it supports, or `forced`.

    `forced` must be a variant the host supports (ValueError otherwise). Without it, the
    variant `select_variant` chose (``--cpu-isa``) runs, else the highest.
    """
    return _host_isa(forced, None if forced else _selection.variant)


@dataclass
class _Selection:
    """What the engine chose at start-up (``--cpu-isa``, ``--kernel-cache-dir``): the
    settings are read by container/settings.py and handed here, never read here."""

    variant: str | None = None
    cache_dir: Path | None = None


_selection = _Selection()


def select_variant(name: str) -> HostISA:
    """Make `name` (``auto`` or a variant the host supports) the default of `host_isa()`;
    raises ValueError naming ``--cpu-isa`` for one the host lacks."""
    if name == "auto":
        _selection.variant = None
        return host_isa()
    try:
        isa = host_isa(name)
    except ValueError as exc:
        raise ValueError(f"--cpu-isa {name}: {exc}") from exc
    _selection.variant = name
    return isa


def set_cache_dir(path: str | Path | None) -> None:
    """Where compiled libraries are cached (``--kernel-cache-dir``; None: the default)."""
    _selection.cache_dir = Path(path) if path else None


@functools.cache
def _host_isa(forced: str | None, env: str | None) -> HostISA:
    model, flags = _cpuinfo()
    have = tuple(f for f in (*_REPORTED, *_EXTRA) if f in flags)
    supported: tuple[str, ...] = ()
    if platform.machine() in ("x86_64", "AMD64"):
        supported = tuple(v for v in VARIANTS if _NEEDS[v] <= flags)
    variant = supported[-1] if supported else None
    if forced is not None:
        if forced not in supported:
            raise ValueError(
                f"CPU kernel variant {forced!r} is not supported by this host "
                f"(supported: {', '.join(supported) or 'none'})"
            )
        variant = forced
    elif env in supported:
        variant = env
    return HostISA(model, have, variant, supported)


def cache_dir() -> Path:
    if _selection.cache_dir is not None:
        return _selection.cache_dir
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
    digest.update(Q8_SOURCE.read_bytes())
    digest.update(BF16_SOURCE.read_bytes())
    digest.update(ATTENTION_BF16_SOURCE.read_bytes())
    digest.update(ATTENTION_F32_SOURCE.read_bytes())
    digest.update(SAMPLING_SOURCE.read_bytes())
    digest.update(KV_HEADER.read_bytes())
    digest.update(" ".join([*_BASE_FLAGS, *_FLAGS[variant], *_Q8_FLAGS, *_LINK_FLAGS]).encode())
    digest.update(_compiler_version(cc).encode())
    return cache_dir() / f"libhearth_cpu-{variant}-{digest.hexdigest()[:16]}.so"


def is_trusted(path: Path) -> bool:
    """Owned by us (or root) and writable by nobody else, like the model cache's check
    (`engine/model_resolver.py`): in a shared cache another local user could otherwise
    plant a library for us to load and run."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return st.st_uid in (os.geteuid(), 0) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


class UntrustedCacheError(RuntimeError):
    """The cached library or its directory could be written by another user."""


def _check_trusted(out: Path) -> None:
    for path in (out.parent, out):
        if path.exists() and not is_trusted(path):
            raise UntrustedCacheError(
                f"refusing to use {path}: not owned by this user or writable by others; "
                "set --kernel-cache-dir (HEARTH_KERNEL_CACHE_DIR) to a private directory"
            )


def _run_all(commands: list[list[str]]) -> None:
    """Run independent compiler commands, as many at once as the host has cores (the five
    translation units of a variant took ~12 s one after another on a 2-vCPU host); the
    first failure is raised as `subprocess.CalledProcessError` once all have ended."""
    from concurrent.futures import ThreadPoolExecutor

    def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=max(1, min(len(commands), os.cpu_count() or 1))) as pool:
        done = list(pool.map(run, commands))
    for proc in done:
        proc.check_returncode()


def build(variant: str, *, quiet: bool = False) -> Path:
    """Compile `variant` unless its cached build exists; returns the library path.

    Writes to a temp file and renames it into place, so concurrent starts never load a
    half-written library. Raises `UntrustedCacheError` if the cache directory or the
    cached file is not this user's alone.
    """
    if variant not in _FLAGS:
        raise ValueError(f"unknown CPU kernel variant {variant!r} (known: {', '.join(VARIANTS)})")
    out = library_path(variant)
    _check_trusted(out)
    if out.is_file():
        return out
    out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_trusted(out)
    cc = _compiler()
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
    os.close(fd)
    if not quiet:
        print(f"hearth: compiling CPU kernels ({variant}) -> {out}", file=sys.stderr, flush=True)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".objs-") as objs:
            obj_cpu, obj_q8 = Path(objs) / "cpu.o", Path(objs) / "q8.o"
            obj_bf16, obj_att = Path(objs) / "bf16.o", Path(objs) / "attention_bf16.o"
            obj_att32, obj_sampling = Path(objs) / "attention_f32.o", Path(objs) / "sampling.o"
            objects = [
                str(o) for o in (obj_cpu, obj_q8, obj_bf16, obj_att, obj_att32, obj_sampling)
            ]
            flags = [*_BASE_FLAGS, *_FLAGS[variant]]
            _run_all(
                [
                    [cc, *flags, "-c", str(SOURCE), "-o", str(obj_cpu)],
                    [cc, *flags, *_Q8_FLAGS, "-c", str(Q8_SOURCE), "-o", str(obj_q8)],
                    [cc, *flags, "-c", str(BF16_SOURCE), "-o", str(obj_bf16)],
                    [cc, *flags, "-c", str(ATTENTION_BF16_SOURCE), "-o", str(obj_att)],
                    [cc, *flags, *_Q8_FLAGS, "-c", str(ATTENTION_F32_SOURCE), "-o", str(obj_att32)],
                    [cc, *flags, "-c", str(SAMPLING_SOURCE), "-o", str(obj_sampling)],
                ]
            )
            _run_all([[cc, *_LINK_FLAGS, *objects, "-o", tmp, "-lm"]])
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise RuntimeError(f"compiling the CPU kernels ({variant}) failed:\n{exc.stderr}") from exc
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
        help="variant(s) to build (default: the one this host runs; any variant compiles on any x86 "
        "host, e.g. an image build may ask for all)",
    )
    parser.add_argument(
        "--cache-dir", help="where to cache the libraries (default: ~/.cache/hearth/kernels)"
    )
    args = parser.parse_args(argv)
    set_cache_dir(args.cache_dir)
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
