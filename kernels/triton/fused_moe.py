"""Triton grouped GEMM over experts: the sparse MoE op on the GPU (vLLM's ``fused_moe``).

One launch multiplies every routed row by its expert's weight. The step's ``T * top_k``
(token, expert) pairs are first sorted by expert and each expert's group is padded to a
multiple of ``BLOCK_M`` (`align_by_expert`), so a row block of the grid belongs to one
expert: the program loads that expert's weight tiles once for ``BLOCK_M`` rows, and the
grid covers all experts at once (a grouped GEMM) instead of one launch per expert.

The op is two such GEMMs around the gated activation:

1. ``h = act(x[token] @ w13[e].T + b13[e])`` for every (token, expert) pair: rows of x
   are gathered by token inside the kernel, no gathered copy of x is made;
2. ``y = (h @ w2[e].T + b2[e]) * routing_weight`` (rounded to the activations' dtype
   before the weight multiply, where the torch reference rounds);

then the ``top_k`` rows of each token are summed. Everything stays on the device and the
buffers are sized from the shapes alone (an upper bound on the padded length), so there
is no host sync and the op can be captured in a CUDA graph. The torch reference is
``kernels.reference_moe.fused_moe``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference_moe import ACTIVATIONS

__all__ = ["align_by_expert", "fused_moe_triton"]

BLOCK_M = 16
"""Rows per program: ``tl.dot`` needs at least 16; a decode step routes few rows per
expert, so a larger block would mostly compute padding."""


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (token, choice) slots grouped by expert, each group padded to ``block_m``.

    Returns ``sorted_slots`` [num_blocks * block_m] (a flat slot ``t * k + j``, or ``T *
    k`` for padding) and ``block_expert`` [num_blocks] (the expert of each row block, or
    ``num_experts`` for blocks past the last group). ``num_blocks`` is the bound
    ``cdiv(T * k + E * (block_m - 1), block_m)``, so no size is read back to the host.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)  # [N = T*k]
    num_slots = flat.numel()
    device = flat.device
    num_blocks = triton.cdiv(num_slots + num_experts * (block_m - 1), block_m)
    # NOTE: not torch.bincount: on CUDA it reads the largest id back to size its output.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] rows per expert
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_ends = padded.cumsum(0)
    padded_starts = padded_ends - padded
    starts = counts.cumsum(0) - counts
    experts, order = torch.sort(flat, stable=True)  # slots grouped by expert
    rank = torch.arange(num_slots, device=device) - starts[experts]  # place within its group
    sorted_slots = torch.full((num_blocks * block_m,), num_slots, dtype=torch.int64, device=device)
    sorted_slots[padded_starts[experts] + rank] = order
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)  # E past the end
    return sorted_slots, block_expert


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    bias_ptr,
    c_ptr,
    weights_ptr,
    sorted_slots_ptr,
    block_expert_ptr,
    num_slots,
    num_experts,
    n,
    k,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bias_e,
    stride_cm,
    TOP_K: tl.constexpr,
    ROWS_BY_TOKEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``c[slot] = a[row(slot)] @ b[e].T (+ bias[e]) (* weight[slot])`` for the BLOCK_M
    slots of one row block (all of expert ``e``) and BLOCK_N output columns.
    ``ROWS_BY_TOKEN``: a row of ``a`` per token (``row = slot // TOP_K``), else per slot."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < num_experts:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(sorted_slots_ptr + offs_m)  # [BM] int64
        valid = slots < num_slots
        if ROWS_BY_TOKEN:
            rows = slots // TOP_K
        else:
            rows = slots
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        b_base = b_ptr + expert * stride_be
        for k0 in range(0, k, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k
            a = tl.load(
                a_ptr + rows[:, None] * stride_am + offs_k[None, :],
                mask=valid[:, None] & mask_k[None, :],
                other=0.0,
            )  # [BM, BK]
            b = tl.load(
                b_base + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                mask=mask_n[None, :] & mask_k[:, None],
                other=0.0,
            )  # [BK, BN]
            if FP32_DOT:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        dt = c_ptr.dtype.element_ty
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=mask_n, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]  # one rounding, as addmm
        if MUL_WEIGHT:
            w = tl.load(weights_ptr + slots, mask=valid, other=0.0).to(tl.float32)
            acc = acc.to(dt).to(tl.float32) * w[:, None]
        tl.store(
            c_ptr + slots[:, None] * stride_cm + offs_n[None, :],
            acc.to(dt),
            mask=valid[:, None] & mask_n[None, :],
        )


def _interpreted() -> bool:
    return type(tl.sum).__name__ == "InterpretedFunction"


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    sorted_slots: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    rows_by_token: bool,
    weights: torch.Tensor | None,
) -> None:
    num_experts, n, k = w.shape
    assert w.stride(2) == 1 and a.stride(1) == 1 and out.stride(1) == 1, "rows must be contiguous"
    fp32_dot = a.dtype == torch.float32 or (_interpreted() and a.dtype == torch.bfloat16)
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        w,
        bias if bias is not None else w,
        out,
        weights if weights is not None else out,
        sorted_slots,
        block_expert,
        out.shape[0],
        num_experts,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        TOP_K=top_k,
        ROWS_BY_TOKEN=rows_by_token,
        HAS_BIAS=bias is not None,
        MUL_WEIGHT=weights is not None,
        FP32_DOT=fp32_dot,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """Same contract as ``kernels.reference_moe.fused_moe``: [T, H] → [T, H]."""
    assert x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, (
        "x [T, H], w13 [E, 2I, H], w2 [E, H, I]"
    )
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    sorted_slots, block_expert = align_by_expert(topk_ids, num_experts, BLOCK_M)
    num_slots = num_tokens * top_k
    gate_up = torch.empty((num_slots, two_inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, b13, gate_up, sorted_slots, block_expert, top_k, True, None)
    if activation == "silu":
        from kernels.triton.activation import silu_and_mul_triton

        h = silu_and_mul_triton(gate_up)  # [N, I]
    else:  # NOTE: no Triton kernel of its own yet; the elementwise torch ops run on device
        h = ACTIVATIONS[activation](gate_up).contiguous()
    out = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(h, w2, b2, out, sorted_slots, block_expert, top_k, False, weights)
    # [T, k, H] -> [T, H]: each token's k weighted expert outputs
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
