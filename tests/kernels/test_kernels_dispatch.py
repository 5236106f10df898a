"""The ``kernels`` dispatch point: the backend chosen once, lazy triton import, life without
triton."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Callable
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
        from tests.kernels.cases import make_step
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
        import torch, kernels
        x = torch.randn(3, 8)
        cache = kernels.build_cos_sin_cache(8, 16, 10000.0, torch.float32)
        q, k = kernels.rotary_embedding(torch.arange(3), x.view(3, 1, 8), x.view(3, 1, 8), cache)
        assert kernels.kernel_backend(x) == "torch"
        try:
            kernels.select_backend("triton")
        except RuntimeError as e:
            print("refused:", e)
        """
    )
    assert out.startswith("refused:") and "not installed" in out and "HEARTH_KERNELS" in out


def test_environment_set_before_start_up_is_honoured() -> None:
    """``HEARTH_KERNELS`` in the environment of a fresh process reaches the kernels the
    way the engine core hands it over: settings -> ``EngineConfig.kernels`` ->
    ``select_backend`` (which ``EngineCore`` calls first thing)."""
    out = _run(
        """
        import torch, kernels
        from container.settings import configs_from_env
        engine_config, _ = configs_from_env()
        print(engine_config.kernels, kernels.select_backend(engine_config.kernels))
        print(kernels.selected_backend(), kernels.kernel_backend(torch.zeros(1)))
        """,
        HEARTH_KERNELS="Torch",
    )
    assert out.splitlines() == ["torch torch", "torch torch"]


def test_invalid_environment_value_fails_naming_the_variable() -> None:
    from container.settings import configs_from_env

    with pytest.raises(SystemExit, match="HEARTH_KERNELS"):
        configs_from_env({"HEARTH_KERNELS": "cuda-please"})


def test_backend_selection(use_backend: Callable[[str], str]) -> None:
    cpu = torch.zeros(1)
    use_backend("auto")
    assert kernels.kernel_backend(cpu) == "torch"
    for mode in ("torch", "auto", " AUTO "):
        use_backend(mode)
        assert kernels.kernel_backend(cpu) == "torch"
    assert kernels.selected_backend() == "auto"
    with pytest.raises(ValueError, match=r"HEARTH_KERNELS .*auto, torch, triton"):
        use_backend("cuda-please")
    assert kernels.selected_backend() == "auto", "a refused value leaves the choice alone"


def test_selection_is_logged_once(
    use_backend: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hearth.kernels")
    use_backend("torch")
    for _ in range(3):
        kernels.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)
    assert [r.getMessage() for r in caplog.records] == ["kernel backend: torch"]


def test_forced_triton_on_cpu_needs_interpreter(
    monkeypatch: pytest.MonkeyPatch, use_backend: Callable[[str], str]
) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    use_backend("triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.kernel_backend(torch.zeros(1))


def test_the_reported_backend_is_the_one_that_runs(
    monkeypatch: pytest.MonkeyPatch, use_backend: Callable[[str], str]
) -> None:
    """The exact mode's description (start-up log, /version) names the kernels that run,
    not always "torch"."""
    from engine.backends import _exact
    from kernels.registry import backend_for_device

    cpu = torch.device("cpu")
    assert "torch kernels (cpu)" in _exact(torch.float32, cpu, "torch").description
    assert backend_for_device(cpu) == "torch"
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "triton kernels (cpu)" in _exact(torch.float32, cpu, "triton").description
    assert backend_for_device(cpu) == kernels.kernel_backend(torch.zeros(1)) == "triton"
    use_backend("auto")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_picks_triton_on_cuda(use_backend: Callable[[str], str]) -> None:
    pytest.importorskip("triton")
    use_backend("auto")
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
