"""Kernel tests: Triton kernels run in the interpreter on CPU, compiled on a GPU.

``TRITON_INTERPRET`` is read when triton (and each ``@triton.jit`` function) is imported,
so it is set here, before any test module of this directory imports triton. On a machine
with CUDA it is left unset, so the same tests run the compiled kernels on the GPU.

Triton may already be imported by the time this file runs: pytest collects ``tests/``
directory by directory, and ``transformers`` (e.g. ``from transformers import
AutoTokenizer`` in an engine test) imports triton. Triton's Python modules are then
re-imported in interpreter mode; its C extension stays loaded, which is safe. Setting
``TRITON_INTERPRET=1`` in ``tests/conftest.py`` or the environment avoids the re-import.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch  # importing torch does not import triton

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_TRITON_KERNEL_MODULES = (
    "kernels.triton.activation",
    "kernels.triton.fused_moe",
    "kernels.triton.kv_cache",
    "kernels.triton.lora",
    "kernels.triton.paged_attention",
    "kernels.triton.rms_norm",
    "kernels.triton.rotary",
)


def _triton_is_interpreted() -> bool:
    import triton.language as tl

    return type(tl.sum).__name__ == "InterpretedFunction"


REIMPORTED = False
if HAS_TRITON and INTERPRET and "triton" in sys.modules and not _triton_is_interpreted():
    REIMPORTED = True
    warnings.warn(
        "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1; "
        "re-importing triton's Python modules in interpreter mode",
        stacklevel=1,
    )
    for _name in list(sys.modules):
        if (
            (_name == "triton" or _name.startswith("triton.")) and not _name.startswith("triton._C")
        ) or _name in _TRITON_KERNEL_MODULES:
            del sys.modules[_name]
    import triton  # noqa: F401

# Where the Triton tests put their tensors: CPU under the interpreter, else the GPU.
TRITON_DEVICE = "cpu" if INTERPRET else ("cuda" if HAS_CUDA else None)


@pytest.fixture
def triton_device() -> str:
    """Device for Triton-vs-reference tests; skips where the kernels cannot run."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if TRITON_DEVICE is None:
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    return TRITON_DEVICE


@pytest.fixture
def use_backend() -> Iterator[Callable[[str], str]]:
    """``use_backend(mode)`` selects a kernel backend as the engine does at start-up; the
    backend selected before the test is restored after it."""
    from kernels import registry

    saved = registry.selected_backend()
    yield registry.select_backend
    registry.select_backend(saved)


@pytest.fixture
def force_triton(use_backend: Callable[[str], str], triton_device: str) -> str:
    """Route the public ``kernels`` API to Triton for the duration of a test."""
    use_backend("triton")
    return triton_device


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REIMPORTED:
        terminalreporter.write_line(
            "tests/kernels: triton had been imported without TRITON_INTERPRET=1 and was "
            "re-imported in interpreter mode; set TRITON_INTERPRET=1 in tests/conftest.py "
            "(when CUDA is absent) to avoid this."
        )
