"""Triton ``silu(gate) * up`` over the fused gate/up projection output.

The silu is rounded to the activations' dtype before the multiply, the point where
transformers' eager ``act_fn(gate_proj(x)) * up_proj(x)`` rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["silu_and_mul_triton"]


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    d,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dt), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """``[T, 2 * I] -> [T, I]``."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2 * I], got {tuple(x.shape)}"
    assert x.stride(1) == 1, "last dim must be contiguous"
    num_tokens, two_d = x.shape
    d = two_d // 2
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or d == 0:
        return out
    block = min(triton.next_power_of_2(d), 1024)
    grid = (num_tokens, triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), d, BLOCK=block, num_warps=4)
    return out
