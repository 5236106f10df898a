"""Triton batched LoRA: shrink then expand, one program per token (S-LoRA's BGMV).

Each token reads the A/B of its own slot (``token_slots[t]``; -1, the base model, adds
nothing), so one launch serves every adapter of the step. The buffers are the
reference's (``kernels/reference_lora.py``): ranks padded with zeros to ``R``, which the
sums take in without changing them. Accumulation is float32; the output keeps ``y``'s
dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference_lora import LoRAStack, LoRAStep

__all__ = ["add_lora_triton", "lora_expand_triton", "lora_shrink_triton"]


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    h_ptr,
    k,
    stride_x,
    stride_a_slot,
    stride_a_shard,
    stride_a_rank,
    stride_h_tok,
    stride_h_shard,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    shard = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    rmask = ranks < R
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        a_base = a_ptr + slot * stride_a_slot + shard * stride_a_shard
        for k0 in range(0, k, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            kmask = cols < k
            xv = tl.load(x_ptr + tok * stride_x + cols, mask=kmask, other=0.0).to(tl.float32)
            a = tl.load(
                a_base + ranks[:, None] * stride_a_rank + cols[None, :],
                mask=rmask[:, None] & kmask[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_R, BLOCK_K]
            acc += tl.sum(a * xv[None, :], axis=1)
    dt = h_ptr.dtype.element_ty
    tl.store(h_ptr + tok * stride_h_tok + shard * stride_h_shard + ranks, acc.to(dt), mask=rmask)


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    h_ptr,
    b_ptr,
    slots_ptr,
    scales_ptr,
    row_shard_ptr,
    n,
    num_shards,
    stride_y,
    stride_h_tok,
    stride_h_shard,
    stride_b_slot,
    stride_b_row,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if slot >= 0:
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rows < n
        ranks = tl.arange(0, BLOCK_R)
        rmask = ranks < R
        shard = tl.load(row_shard_ptr + rows, mask=nmask, other=0).to(tl.int64)  # [BLOCK_N]
        hv = tl.load(
            h_ptr + tok * stride_h_tok + shard[:, None] * stride_h_shard + ranks[None, :],
            mask=nmask[:, None] & rmask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_R]: each row's shard's low-rank vector
        b = tl.load(
            b_ptr + slot * stride_b_slot + rows[:, None] * stride_b_row + ranks[None, :],
            mask=nmask[:, None] & rmask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_R]
        scale = tl.load(scales_ptr + slot * num_shards + shard, mask=nmask, other=0.0)
        delta = tl.sum(b * hv, axis=1) * scale
        y = tl.load(y_ptr + tok * stride_y + rows, mask=nmask, other=0.0).to(tl.float32)
        dt = y_ptr.dtype.element_ty
        tl.store(y_ptr + tok * stride_y + rows, (y + delta).to(dt), mask=nmask)


def _check(stack: LoRAStack, step: LoRAStep, x_or_y: torch.Tensor) -> None:
    assert stack.lora_a.is_contiguous() and stack.lora_b.is_contiguous(), "stacks are contiguous"
    assert stack.scales.is_contiguous() and stack.scales.dtype == torch.float32
    assert step.token_slots.dtype == torch.int32 and step.token_slots.numel() == x_or_y.shape[0]
    assert x_or_y.dim() == 2 and x_or_y.stride(1) == 1, "last dim must be contiguous"


def lora_shrink_triton(x: torch.Tensor, stack: LoRAStack, step: LoRAStep) -> torch.Tensor:
    """``[T, in] -> [T, S, R]`` (float32)."""
    _check(stack, step, x)
    _, num_shards, max_rank, k = stack.lora_a.shape
    assert x.shape[1] == k, f"x has {x.shape[1]} columns, the stack {k}"
    h = torch.zeros((x.shape[0], num_shards, max_rank), dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return h
    a = stack.lora_a
    _lora_shrink_kernel[(x.shape[0], num_shards)](
        x, a, step.token_slots, h, k,
        x.stride(0), a.stride(0), a.stride(1), a.stride(2), h.stride(0), h.stride(1),
        R=max_rank, BLOCK_R=triton.next_power_of_2(max_rank),
        BLOCK_K=min(triton.next_power_of_2(k), 128), num_warps=4,
    )  # fmt: skip
    return h


def lora_expand_triton(
    y: torch.Tensor, h: torch.Tensor, stack: LoRAStack, step: LoRAStep
) -> torch.Tensor:
    """``y += (h @ B.T) * scale`` per token's slot, in place; returns ``y``."""
    _check(stack, step, y)
    _, n, max_rank = stack.lora_b.shape
    assert y.shape[1] == n, f"y has {y.shape[1]} columns, the stack {n}"
    if y.shape[0] == 0:
        return y
    b = stack.lora_b
    block_n = min(triton.next_power_of_2(n), 128)
    _lora_expand_kernel[(y.shape[0], triton.cdiv(n, block_n))](
        y, h, b, step.token_slots, stack.scales, stack.row_shard, n, stack.scales.shape[1],
        y.stride(0), h.stride(0), h.stride(1), b.stride(0), b.stride(1),
        R=max_rank, BLOCK_R=triton.next_power_of_2(max_rank), BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return y


def add_lora_triton(
    y: torch.Tensor, x: torch.Tensor, stack: LoRAStack, step: LoRAStep
) -> torch.Tensor:
    """The reference's `add_lora` on the GPU: one shrink and one expand launch."""
    if not step.groups:
        return y
    return lora_expand_triton(y, lora_shrink_triton(x, stack, step), stack, step)
