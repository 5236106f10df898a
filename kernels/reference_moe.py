"""The torch reference of the sparse mixture-of-experts op, and the token grouping it shares.

A MoE layer sends each token to its ``top_k`` experts and sums their outputs weighted by
the router. Computing that token by token would run ``T * top_k`` tiny matmuls; here the
step's tokens are grouped *per expert* once (one sort), so each expert runs one matmul
over all the rows routed to it (``index_select``), and its rows are added back into the
output (``index_add_``). The Python loop is over experts, never over tokens.

`moe_combine` is that grouping with the expert computation left open: the reference
(`fused_moe`) computes an expert from the stacked weights with ``F.linear``, and the
engine's expert layers (``engine/layers/moe.py``) pass their own per-expert `Linear`
modules, so every linear method runs the experts without a second copy of the routing.

Numerics follow transformers' eager experts (``MixtralExperts.forward``): each expert's
output multiplied by its routing weight (float32 when the router keeps float32 weights,
as Mixtral does), cast to the activations' dtype, and a token's k outputs summed (the
same bits as transformers' ``index_add_`` for k = 2; within rounding for larger k). Kept apart from ``kernels/reference.py`` so the MoE op stays one
concept in one file; it must not import triton either.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "fused_moe", "moe_combine", "silu_and_mul", "swiglu_oai"]

ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]
"""``expert_fn(e, x_e)``: expert ``e``'s output ``[n, H]`` for its routed rows ``[n, H]``."""


def moe_combine(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert_fn: ExpertFn,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` for every token ``t``.

    x: [T, H]; topk_weights: [T, k] (float32 or the activations' dtype); topk_ids: [T, k]
    int. Returns [T, H] in x's dtype. Experts that no token picked are not called.
    """
    num_tokens, top_k = topk_ids.shape
    hidden = x.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)  # [T*k]: token t's j-th choice at slot t*k + j
    order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert
    # NOTE: one host sync per layer for the group sizes; the grouped-GEMM kernel
    # (kernels/triton/fused_moe.py) needs none.
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    flat_weights = topk_weights.reshape(-1)
    # PERF: each slot's weighted output is copied into its own row and the k rows of a
    # token summed once, instead of `index_add_` into [T, H]: torch's parallel index_add_
    # cost ~20 ms per call on a busy 2-core host (its OpenMP barrier), index_copy_ 10 us.
    # The sum is the same: with k = 2, a + b either way (floating addition commutes).
    per_slot = x.new_empty((num_tokens * top_k, hidden))  # [T*k, H]; every slot is written
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start : start + count]  # [n] slots routed to this expert
        start += count
        h = expert_fn(expert, x.index_select(0, slots // top_k))  # [n, H]
        h = h * flat_weights.index_select(0, slots).unsqueeze(1)
        per_slot.index_copy_(0, slots, h.to(x.dtype))
    return per_slot.view(num_tokens, top_k, hidden).sum(dim=1)  # [T, H]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[n, 2 * I]`` gate/up output (gate rows first), on the
    strided ``gate`` view, as transformers' experts compute it (``chunk(2)``; unlike the
    dense MLP, whose gate is a contiguous tensor of its own)."""
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]) * gate_up[..., d:]


def swiglu_oai(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of a ``[n, 2 * I]`` gate/up output (gate rows first):
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate,
    limit)``, as transformers' ``GptOssExperts._apply_gate``."""
    d = gate_up.shape[-1] // 2
    gate = gate_up[..., :d].clamp(max=limit)
    up = gate_up[..., d:].clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "swiglu_oai": swiglu_oai,
}
"""The experts' gated activations by name (``FusedMoE.activation``)."""


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """The gated experts of a MoE layer over stacked weights.

    x: [T, H]; w13: [E, 2 * I, H] (each expert's gate rows, then its up rows); w2: [E, H,
    I]; optional biases b13: [E, 2 * I], b2: [E, H]; topk_weights, topk_ids: [T, k].
    Returns [T, H]: for each token the routing-weighted sum of ``w2[e] @ act(w13[e] @ x)``
    over its experts ``e`` (`ACTIVATIONS`). The Triton grouped GEMM
    (``kernels.triton.fused_moe``) computes the same.
    """
    act = ACTIVATIONS[activation]

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        h = act(F.linear(xe, w13[e], None if b13 is None else b13[e]))
        return F.linear(h, w2[e], None if b2 is None else b2[e])

    return moe_combine(x, topk_weights, topk_ids, w13.shape[0], expert)
