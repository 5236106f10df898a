"""The kernel backend, chosen once per process.

``--kernels`` / ``HEARTH_KERNELS`` is read by ``container/settings.py`` like every other
setting and reaches the engine as ``EngineConfig.kernels``; the engine core calls
`select_backend` with it at start-up (docs/architecture.md, "Where each rule lives").
Choosing here, once, means a bad value fails at start-up naming the variable, the choice
is logged once, and a kernel call only does the cheap per-tensor check of `backend_for`.
A process that never calls `select_backend` (a benchmark script, a test) runs ``auto``.

* ``torch``: always the torch reference (``kernels.reference``).
* ``triton``: always the Triton kernels, also for CPU tensors, which needs
  ``TRITON_INTERPRET=1`` set before triton is imported (that is how the tests run them).
* ``auto``: Triton when the tensor is on CUDA and triton is importable, else the torch
  reference, which is the CPU production path.

This module must not import triton: only ``find_spec`` asks whether it is there.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

__all__ = [
    "BACKENDS",
    "ENV",
    "backend_for",
    "backend_for_device",
    "select_backend",
    "selected_backend",
]

logger = logging.getLogger("hearth.kernels")

ENV = "HEARTH_KERNELS"
"""The variable (and ``--kernels`` flag) that sets the backend; named in every error."""
BACKENDS = ("auto", "torch", "triton")


@functools.cache
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


@dataclass(frozen=True, slots=True)
class _Choice:
    mode: str
    """One of `BACKENDS`."""
    interpret: bool
    """``TRITON_INTERPRET=1`` was set when the backend was chosen: forced Triton may run
    on CPU tensors (triton reads the variable at import, so a later change is moot)."""


_choice = _Choice("auto", interpret=False)


def select_backend(mode: str) -> str:
    """Validate ``mode`` and make it the backend of every later kernel call; returns it.

    Raises ValueError for an unknown mode and RuntimeError for ``triton`` without triton,
    both naming ``HEARTH_KERNELS``, so a bad setting stops the engine at start-up."""
    global _choice
    name = mode.strip().lower()
    if name not in BACKENDS:
        allowed = ", ".join(BACKENDS)
        raise ValueError(f"{ENV} (--kernels) must be one of {allowed}, not {mode!r}")
    if name == "triton" and not triton_importable():
        raise RuntimeError(f"{ENV}=triton but triton is not installed")
    _choice = _Choice(name, interpret=os.environ.get("TRITON_INTERPRET") == "1")
    logger.info("kernel backend: %s%s", name, _describe(name))
    return name


def _describe(mode: str) -> str:
    if mode == "auto":
        where = "Triton on CUDA tensors" if triton_importable() else "triton not installed"
        return f" ({where}, torch reference otherwise)"
    if mode == "triton" and _choice.interpret:
        return " (Triton interpreter allowed for CPU tensors)"
    return ""


def selected_backend() -> str:
    """The mode last passed to `select_backend` (``auto`` when none was)."""
    return _choice.mode


def backend_for(t: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: the implementation a kernel call on ``t`` uses."""
    choice = _choice
    if choice.mode == "auto":
        return "triton" if t.is_cuda and triton_importable() else "torch"
    if choice.mode == "torch":
        return "torch"
    if not t.is_cuda and not choice.interpret:
        raise RuntimeError(
            f"{ENV}=triton on a {t.device.type} tensor needs TRITON_INTERPRET=1 "
            "set before triton is imported"
        )
    return "triton"


def backend_for_device(device: torch.device) -> str:
    """`backend_for` a tensor on ``device``: what the start-up log and /version report."""
    return backend_for(torch.empty(0, device=device))
