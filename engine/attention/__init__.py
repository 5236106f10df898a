"""Attention backends, one chosen at start-up (docs/architecture.md, "Backends").

- `PagedAttentionBackend` (`paged.py`): the `kernels` ops — Triton on CUDA (with CUDA
  graphs for decode steps), the torch reference on CPU (the exact mode).
- `CpuAttentionBackend` (`cpu.py`): the C kernel of the CPU fast path, which reads the
  paged cache in place one query tile at a time.

A backend builds the step's `AttentionMetadata` itself (`build_metadata`), so what it
needs is prepared once per step, before the forward.
"""

from __future__ import annotations

from engine.attention.base import AttentionBackend
from engine.attention.cpu import CpuAttentionBackend
from engine.attention.paged import PagedAttentionBackend

__all__ = ["AttentionBackend", "CpuAttentionBackend", "PagedAttentionBackend"]
