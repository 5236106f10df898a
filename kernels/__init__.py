"""The kernel ops the model code calls, behind one dispatch point.

Each public op is the torch reference's function (its signature and docstring, in
``kernels.reference``) wrapped so that a call runs the backend ``kernels.registry`` picks
for the op's leading tensor: the Triton kernel (``kernels.triton``, one module per op) or
the reference itself. The backend is chosen once per process (`select_backend`); a call
only checks that tensor's device.

Triton modules are imported lazily, on the first call that needs them, so importing
``kernels`` costs nothing and works where triton is not installed.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from kernels import reference, reference_lora, reference_moe
from kernels.metadata import AttentionMetadata
from kernels.reference import build_cos_sin_cache
from kernels.reference_lora import LoRAGroup, LoRAStack, LoRAStep
from kernels.registry import backend_for, select_backend, selected_backend

__all__ = [
    "AttentionMetadata",
    "LoRAGroup",
    "LoRAStack",
    "LoRAStep",
    "add_lora",
    "build_cos_sin_cache",
    "embedding",
    "fused_add_rms_norm",
    "fused_moe",
    "gelu_tanh_and_mul",
    "head_rms_norm",
    "kernel_backend",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "select_backend",
    "selected_backend",
    "silu_and_mul",
    "write_kv_cache",
]

_Op = TypeVar("_Op", bound=Callable[..., Any])


def kernel_backend(t: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: the implementation a call on ``t`` would use now."""
    return backend_for(t)


def _triton_op(module: str, name: str) -> Callable[..., Any]:
    # Looked up on every call (a sys.modules hit), not cached: the kernel tests re-import
    # the Triton modules in interpreter mode, and a cached function would be the old one.
    return cast(Callable[..., Any], getattr(importlib.import_module(module), name))


def _dispatched(torch_op: _Op, triton_module: str, triton_name: str, arg: int = 0) -> _Op:
    """``torch_op`` as a public op: positional argument ``arg`` is the tensor whose
    device decides the backend, and ``triton_module.triton_name`` (same signature) is the
    Triton version. The signature lives once, in the reference, so the two cannot drift
    apart from the public one."""

    @functools.wraps(torch_op)
    def op(*args: Any, **kwargs: Any) -> Any:
        if backend_for(args[arg]) == "triton":
            return _triton_op(triton_module, triton_name)(*args, **kwargs)
        return torch_op(*args, **kwargs)

    return cast(_Op, op)


embedding = reference.embedding
"""No Triton version: a gather is one torch op on any device."""
rms_norm = _dispatched(reference.rms_norm, "kernels.triton.rms_norm", "rms_norm_triton")
fused_add_rms_norm = _dispatched(
    reference.fused_add_rms_norm, "kernels.triton.rms_norm", "fused_add_rms_norm_triton"
)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int) -> torch.Tensor:
    """RMSNorm over each head of ``x`` (``[T, heads * hd]``; q or k, whose rows may be a
    strided view of the fused qkv output) with the head-wide ``weight`` → ``[T, heads * hd]``:
    `rms_norm` over rows of one head each (Qwen3's and Gemma 3's q / k norms)."""
    return rms_norm(x.reshape(-1, x.shape[-1] // heads), weight, eps).view(x.shape[0], -1)


rotary_embedding = _dispatched(
    reference.rotary_embedding, "kernels.triton.rotary", "rotary_embedding_triton", arg=1
)
silu_and_mul = _dispatched(
    reference.silu_and_mul, "kernels.triton.activation", "silu_and_mul_triton"
)
gelu_tanh_and_mul = reference.gelu_tanh_and_mul
"""No Triton version: one torch elementwise op on any device (Gemma's MLP)."""
write_kv_cache = _dispatched(
    reference.write_kv_cache, "kernels.triton.kv_cache", "write_kv_cache_triton"
)
paged_attention = _dispatched(
    reference.paged_attention, "kernels.triton.paged_attention", "paged_attention_triton"
)
add_lora = _dispatched(reference_lora.add_lora, "kernels.triton.lora", "add_lora_triton")
"""Batched LoRA of one linear layer (shrink, expand): see ``kernels/reference_lora.py``."""
fused_moe = _dispatched(reference_moe.fused_moe, "kernels.triton.fused_moe", "fused_moe_triton")
