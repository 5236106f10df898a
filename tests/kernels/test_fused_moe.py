"""The sparse MoE op: the torch reference against a token-by-token oracle, and the Triton
grouped GEMM (in the interpreter on CPU, compiled on a GPU) against the reference.

Shapes cover what the kernel's blocking must get right: an expert no token picked, an
expert with more rows than one ``BLOCK_M`` block, widths that are not powers of two or
multiples of the tiles, biases, both gated activations, float32 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.reference_moe import ACTIVATIONS, fused_moe


def _case(
    num_tokens: int,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
    seed: int,
    bias: bool = False,
    skew: bool = False,
) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if skew:  # expert 0 never chosen, expert 1 chosen by every token
        logits[:, 0] = -1e4
        logits[:, 1] = 1e4
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return {
        "x": torch.randn(num_tokens, hidden, generator=gen),
        "w13": 0.2 * torch.randn(num_experts, 2 * inter, hidden, generator=gen),
        "w2": 0.2 * torch.randn(num_experts, hidden, inter, generator=gen),
        "topk_weights": weights / weights.sum(-1, keepdim=True),
        "topk_ids": ids,
        "b13": torch.randn(num_experts, 2 * inter, generator=gen) if bias else None,
        "b2": torch.randn(num_experts, hidden, generator=gen) if bias else None,
    }


def _token_by_token(case: dict[str, torch.Tensor | None], activation: str) -> torch.Tensor:
    """float64, one token and one choice at a time: no grouping, no sort."""
    x, w13, w2 = (case[k].double() for k in ("x", "w13", "w2"))  # type: ignore[union-attr]
    b13, b2 = case["b13"], case["b2"]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(case["topk_weights"][t], case["topk_ids"][t], strict=True):  # type: ignore[index]
            e = int(e)
            h = F.linear(x[t], w13[e], None if b13 is None else b13[e].double())
            h = ACTIVATIONS[activation](h)
            y = F.linear(h, w2[e], None if b2 is None else b2[e].double())
            out[t] += float(w) * y
    return out


CASES = [
    # (tokens, hidden, inter, experts, top_k, bias, skew, activation)
    pytest.param(7, 32, 24, 4, 2, False, False, "silu", id="small-top2"),
    pytest.param(1, 48, 40, 8, 2, False, False, "silu", id="one-token-decode"),
    pytest.param(37, 40, 24, 6, 3, False, True, "silu", id="unused-expert-and-big-group"),
    pytest.param(9, 32, 16, 4, 2, True, False, "swiglu_oai", id="bias-swiglu-oai"),
]


@pytest.mark.parametrize(("t", "h", "i", "e", "k", "bias", "skew", "act"), CASES)
def test_reference_matches_token_by_token(t, h, i, e, k, bias, skew, act) -> None:
    case = _case(t, h, i, e, k, seed=t, bias=bias, skew=skew)
    got = fused_moe(**case, activation=act)  # type: ignore[arg-type]
    torch.testing.assert_close(got.double(), _token_by_token(case, act), atol=1e-5, rtol=1e-5)


def test_reference_calls_only_routed_experts() -> None:
    from kernels.reference_moe import moe_combine

    case = _case(12, 16, 8, 5, 2, seed=3, skew=True)
    called: list[int] = []

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        called.append(e)
        return xe

    moe_combine(case["x"], case["topk_weights"], case["topk_ids"], 5, expert)  # type: ignore[arg-type]
    assert called == sorted(set(case["topk_ids"].flatten().tolist()))  # type: ignore[union-attr]
    assert 0 not in called and 1 in called


def test_align_by_expert_groups_every_slot_once(triton_device: str) -> None:
    from kernels.triton.fused_moe import align_by_expert

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]], device=triton_device)
    slots, block_expert = align_by_expert(ids, num_experts=5, block_m=4)
    n = ids.numel()
    real = slots[slots < n]
    assert sorted(real.tolist()) == list(range(n))  # every (token, choice) exactly once
    flat = ids.flatten()
    for b, expert in enumerate(block_expert.tolist()):
        block = slots[4 * b : 4 * b + 4]
        block = block[block < n]
        if expert == 5:  # past the last group: only padding
            assert block.numel() == 0
        else:
            assert (flat[block] == expert).all()
    assert 4 not in block_expert.tolist()  # expert 4 has no rows: no block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "h", "i", "e", "k", "bias", "skew", "act"), CASES)
def test_triton_matches_reference(
    force_triton: str, dtype: torch.dtype, t, h, i, e, k, bias, skew, act
) -> None:
    case = _case(t, h, i, e, k, seed=t, bias=bias, skew=skew)
    moved = {
        name: None
        if v is None
        else v.to(
            force_triton, dtype if v.is_floating_point() and name != "topk_weights" else v.dtype
        )
        for name, v in case.items()
    }
    args = [moved[n] for n in ("x", "w13", "w2", "topk_weights", "topk_ids", "b13", "b2")]
    assert kernels.kernel_backend(moved["x"]) == "triton"  # type: ignore[arg-type]
    got = kernels.fused_moe(*args, act)
    assert got.dtype == dtype and got.shape == (t, h)
    want = fused_moe(
        **{n: None if v is None else v.cpu() for n, v in moved.items()}, activation=act
    )
    if dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
    else:  # a few bf16 steps: the interpreter rounds toward zero, the GPU to nearest
        err = (got.cpu().float() - want.float()).abs().max().item()
        assert err <= 0.04 * max(1.0, want.float().abs().max().item()), err


def test_triton_handles_an_empty_step(force_triton: str) -> None:
    case = _case(0, 16, 16, 4, 2, seed=0)
    moved = {n: None if v is None else v.to(force_triton) for n, v in case.items()}
    args = [moved[n] for n in ("x", "w13", "w2", "topk_weights", "topk_ids")]
    assert kernels.fused_moe(*args).shape == (0, 16)
