"""The kernel ops the model code calls, behind one dispatch point.

Each public function picks an implementation per call:

* ``HEARTH_KERNELS=torch``: always the torch reference (``kernels.reference``).
* ``HEARTH_KERNELS=triton``: always the Triton kernel, also for CPU tensors, which needs
  ``TRITON_INTERPRET=1`` set before triton is imported (that is how the tests run them).
* unset / ``auto``: Triton when the tensor is on CUDA and triton is importable, else the
  torch reference, which is the CPU production path.

Triton modules are imported lazily, on the first call that needs them, so importing
``kernels`` costs nothing and works where triton is not installed.

The Triton kernels live in ``kernels.triton`` (one module per op), so no submodule
shares a name with a public function of this package.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from kernels import reference
from kernels.metadata import AttentionMetadata

# The cos/sin cache is built once per model, on any device, so it has no Triton version:
# the one definition is the reference's, exported as is.
from kernels.reference import build_cos_sin_cache

__all__ = [
    "AttentionMetadata",
    "build_cos_sin_cache",
    "fused_add_rms_norm",
    "kernel_backend",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv_cache",
]

_ENV = "HEARTH_KERNELS"


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernel_backend(t: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: the implementation a call on ``t`` would use now."""
    mode = os.environ.get(_ENV, "auto").strip().lower()
    if mode == "torch":
        return "torch"
    if mode == "triton":
        if not _triton_importable():
            raise RuntimeError(f"{_ENV}=triton but triton is not installed")
        if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"{_ENV}=triton on a {t.device.type} tensor needs TRITON_INTERPRET=1 "
                "set before triton is imported"
            )
        return "triton"
    if mode not in ("", "auto"):
        raise ValueError(f"{_ENV} must be 'torch', 'triton' or 'auto', not {mode!r}")
    return "triton" if t.is_cuda and _triton_importable() else "torch"


def _use_triton(t: torch.Tensor) -> bool:
    return kernel_backend(t) == "triton"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``[T, H] -> [T, H]``, transformers ``LlamaRMSNorm`` semantics."""
    if _use_triton(x):
        from kernels.triton.rms_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; inputs are not modified."""
    if _use_triton(x):
        from kernels.triton.rms_norm import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of ``query [T, H, D]`` and ``key [T, KV, D]`` (``rotate_half`` style)."""
    if _use_triton(query):
        from kernels.triton.rotary import rotary_embedding_triton

        return rotary_embedding_triton(positions, query, key, cos_sin_cache)
    return reference.rotary_embedding(positions, query, key, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[T, 2 * I] -> [T, I]``: ``silu(x[:, :I]) * x[:, I:]``."""
    if _use_triton(x):
        from kernels.triton.activation import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return reference.silu_and_mul(x)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """In place: token t's K/V goes to flat cache slot ``slot_mapping[t]``; slots < 0 skipped."""
    if _use_triton(key):
        from kernels.triton.kv_cache import write_kv_cache_triton

        write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``[T, num_heads, head_dim]`` attention of a decode + prefill step over the paged cache."""
    if _use_triton(query):
        from kernels.triton.paged_attention import paged_attention_triton

        return paged_attention_triton(query, k_cache, v_cache, meta, scale)
    return reference.paged_attention(query, k_cache, v_cache, meta, scale)
