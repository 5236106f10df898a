"""Variant selection and the compiled-library cache of `kernels.cpu.build`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernels.cpu import build


def test_host_runs_its_highest_variant_and_can_be_forced_down() -> None:
    isa = build.host_isa()
    if not isa.supported:
        pytest.skip(f"no AVX2 on this host ({isa.cpu})")
    assert isa.variant == isa.supported[-1]
    assert list(isa.supported) == [v for v in build.VARIANTS if v in isa.supported]
    for variant in isa.supported:
        assert build.host_isa(variant).variant == variant


def test_forcing_a_variant_the_host_lacks_is_refused() -> None:
    missing = [v for v in build.VARIANTS if v not in build.host_isa().supported]
    with pytest.raises(ValueError, match="not supported"):
        build.host_isa("sse2")  # never a variant
    if not missing:
        pytest.skip("host supports every variant")
    with pytest.raises(ValueError, match="not supported"):
        build.host_isa(missing[0])


def test_a_selected_downgrade_is_honoured_only_when_supported() -> None:
    isa = build.host_isa()
    if not isa.supported:
        pytest.skip("no AVX2 on this host")
    try:
        assert build.select_variant("avx2").variant == "avx2"
        assert build.host_isa().variant == "avx2"
        with pytest.raises(ValueError, match="--cpu-isa bogus"):
            build.select_variant("bogus")
        assert build.select_variant("auto").variant == isa.supported[-1]
    finally:
        build.select_variant("auto")


def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int) -> Path:
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(mode)
    build.set_cache_dir(cache)
    monkeypatch.setattr(build._selection, "cache_dir", cache)  # restored after the test
    return cache


def test_a_cache_dir_others_can_write_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a shared cache another user could plant a library: it is never loaded."""
    _cache(tmp_path, monkeypatch, 0o777)
    planted = build.library_path("avx2")
    planted.write_bytes(b"not a library")
    planted.chmod(0o644)
    with pytest.raises(build.UntrustedCacheError, match="HEARTH_KERNEL_CACHE_DIR"):
        build.build("avx2")


def test_a_cached_library_others_can_write_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cache(tmp_path, monkeypatch, 0o700)
    planted = build.library_path("avx2")
    planted.write_bytes(b"not a library")
    planted.chmod(0o666)
    with pytest.raises(build.UntrustedCacheError, match="writable by others"):
        build.build("avx2")
    planted.chmod(0o644)  # ours and private: the cached file is used as is (no rebuild)
    assert build.build("avx2") == planted
    assert planted.read_bytes() == b"not a library"


def test_variants_the_host_lacks_still_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Code for an ISA the host lacks compiles (it just cannot run here); on a host that
    has them all, the highest variant (every ISA flag at once) is compiled afresh."""
    if os.uname().machine not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    _cache(tmp_path, monkeypatch, 0o700)
    lacking = [v for v in build.VARIANTS if v not in build.host_isa().supported]
    for variant in lacking or [build.VARIANTS[-1]]:
        out = build.build(variant, quiet=True)
        assert out.is_file() and out.parent == tmp_path / "cache" and build.is_trusted(out)
