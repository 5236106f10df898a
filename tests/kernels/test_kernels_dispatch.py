"""The ``kernels`` dispatch point: backend choice, lazy triton import, life without triton."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kernels
from kernels import reference

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter (so sys.modules starts clean) from the repo root."""
    import os

    full_env = {
        k: v for k, v in os.environ.items() if k not in ("HEARTH_KERNELS", "TRITON_INTERPRET")
    }
    full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_import_and_cpu_calls_do_not_import_triton() -> None:
    out = _run(
        """
        import sys, torch, kernels
        from kernels.testing import make_step
        x = torch.randn(3, 8)
        kernels.rms_norm(x, torch.ones(8), 1e-6)
        kernels.silu_and_mul(x)
        step = make_step([(5, 1), (7, 7)], 4, 8)
        kc = torch.randn(8, 4, 1, 8)
        kernels.paged_attention(torch.randn(8, 2, 8), kc, kc, step.meta, 0.3)
        print("triton" in sys.modules)
        """
    )
    assert out == "False"


def test_works_without_triton_installed() -> None:
    out = _run(
        """
        import sys
        sys.modules["triton"] = None  # any `import triton` now raises ImportError
        import os, torch, kernels
        x = torch.randn(3, 8)
        cache = kernels.build_cos_sin_cache(8, 16, 10000.0, torch.float32)
        q, k = kernels.rotary_embedding(torch.arange(3), x.view(3, 1, 8), x.view(3, 1, 8), cache)
        assert kernels.kernel_backend(x) == "torch"
        os.environ["HEARTH_KERNELS"] = "triton"
        try:
            kernels.rms_norm(x, torch.ones(8), 1e-6)
        except RuntimeError as e:
            print("refused:", e)
        """
    )
    assert out.startswith("refused:") and "not installed" in out


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.zeros(1)
    monkeypatch.delenv("HEARTH_KERNELS", raising=False)
    assert kernels.kernel_backend(cpu) == "torch"
    monkeypatch.setenv("HEARTH_KERNELS", "torch")
    assert kernels.kernel_backend(cpu) == "torch"
    monkeypatch.setenv("HEARTH_KERNELS", "auto")
    assert kernels.kernel_backend(cpu) == "torch"
    monkeypatch.setenv("HEARTH_KERNELS", "cuda-please")
    with pytest.raises(ValueError, match="HEARTH_KERNELS"):
        kernels.kernel_backend(cpu)


def test_forced_triton_on_cpu_needs_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("HEARTH_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.kernel_backend(torch.zeros(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_picks_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.delenv("HEARTH_KERNELS", raising=False)
    assert kernels.kernel_backend(torch.zeros(1, device="cuda")) == "triton"


def test_public_functions_survive_triton_import(triton_device: str) -> None:
    """Importing every Triton module leaves the public functions of ``kernels`` callable."""
    import kernels.triton.paged_attention
    import kernels.triton.rms_norm

    assert callable(kernels.rms_norm) and callable(kernels.paged_attention)
    x = torch.randn(2, 8)
    torch.testing.assert_close(
        kernels.rms_norm(x, torch.ones(8), 1e-6), reference.rms_norm(x, torch.ones(8), 1e-6)
    )


def test_reexports() -> None:
    from kernels.metadata import AttentionMetadata

    assert kernels.AttentionMetadata is AttentionMetadata
    for name in kernels.__all__:
        assert callable(getattr(kernels, name)), name
