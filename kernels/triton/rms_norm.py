"""Triton RMSNorm and fused residual-add + RMSNorm.

One program per token row, and one kernel for both ops (the fused one adds the residual
first); the whole hidden vector is one block (hidden sizes of the models we serve fit
comfortably in registers), so the row is read once and written once.
The rounding points copy transformers' ``LlamaRMSNorm``: statistics in float32, the
normalised value rounded to the input dtype, then the weight multiply (exact in float32 for
two 16-bit operands, so one final rounding gives the same bits as torch's 16-bit multiply).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fused_add_rms_norm_triton", "rms_norm_triton"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    n_cols,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row of ``rms_norm(x)``, or with ``ADD_RESIDUAL`` of ``rms_norm(x + res)`` that
    also stores ``x + res`` (``res_ptr``/``res_out_ptr`` are unused without it)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # The residual stream lives in the input dtype: round the sum before normalising it.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_config(hidden: int) -> tuple[int, int]:
    block = triton.next_power_of_2(hidden)
    num_warps = min(max(block // 256, 1), 16)
    return block, num_warps


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() == 2, f"x must be [num_tokens, hidden], got {tuple(x.shape)}"
    assert weight.shape == (x.shape[1],), f"weight {tuple(weight.shape)} vs x {tuple(x.shape)}"
    assert x.stride(1) == 1 and weight.stride(0) == 1, "hidden dim must be contiguous"
    assert x.device == weight.device, "x and weight on different devices"


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``[T, H] -> [T, H]``; output dtype follows torch promotion of (x, weight), as in
    transformers where ``weight * normed`` decides it."""
    _check(x, weight)
    num_tokens, hidden = x.shape
    out = torch.empty(
        (num_tokens, hidden), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device
    )
    if num_tokens == 0:
        return out
    block, num_warps = _launch_config(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x,
        x,  # no residual
        weight,
        out,
        out,  # no residual
        x.stride(0),
        0,
        out.stride(0),
        0,
        hidden,
        eps,
        ADD_RESIDUAL=False,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass; inputs are not modified."""
    _check(x, weight)
    assert residual.shape == x.shape, f"residual {tuple(residual.shape)} vs x {tuple(x.shape)}"
    assert residual.stride(1) == 1, "residual hidden dim must be contiguous"
    assert residual.dtype == x.dtype, "x and residual dtypes differ"
    num_tokens, hidden = x.shape
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    out = torch.empty(
        (num_tokens, hidden), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device
    )
    if num_tokens == 0:
        return out, new_residual
    block, num_warps = _launch_config(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual,
        weight,
        out,
        new_residual,
        x.stride(0),
        residual.stride(0),
        out.stride(0),
        new_residual.stride(0),
        hidden,
        eps,
        ADD_RESIDUAL=True,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out, new_residual
