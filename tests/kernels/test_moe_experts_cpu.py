"""The CPU fast path's one-call MoE experts (`kernels/cpu/ops.py` `moe_experts`, C
`hearth_moe_experts`) against the torch reference of the MoE op on the same weights
(`kernels.reference_moe.fused_moe` on the dequantized blocks) and against the expert-by-
expert path it replaces (`moe_combine` over `ops.linear`); a token's output does not depend
on the batch, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kernels.cpu import ops
from kernels.reference_moe import fused_moe, moe_combine, silu_and_mul

pytestmark = pytest.mark.skipif(not ops.available(), reason="host has no AVX2: no C kernels here")

H, INTER, EXPERTS, TOP_K = 64, 32, 6, 2


def _q8_0(rows: int, cols: int, gen: torch.Generator) -> tuple[ops.PackedWeight, torch.Tensor]:
    """A random Q8_0 weight packed, and its dequantized values."""
    raw = ops.quantize_q8_0(torch.randn(rows, cols, generator=gen).numpy() * 0.2)
    dense = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float32))
    return ops.pack("q8_0", raw), dense


@pytest.fixture(scope="module")
def layer() -> tuple[ops.PackedExperts, torch.Tensor, torch.Tensor, list, list]:
    """The packed experts; their gate/up and down values stacked (``[E, 2I, H]``,
    ``[E, H, I]``); each expert's packed gate/up and down."""
    gen = torch.Generator().manual_seed(0)
    gate_up, gate_up_values = zip(*[_q8_0(2 * INTER, H, gen) for _ in range(EXPERTS)], strict=True)
    down, down_values = zip(*[_q8_0(H, INTER, gen) for _ in range(EXPERTS)], strict=True)
    packed = ops.PackedExperts.of(list(gate_up), list(down))
    return packed, torch.stack(gate_up_values), torch.stack(down_values), list(gate_up), list(down)


def _routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=gen)
    logits = torch.randn(t, EXPERTS, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
    return x, weights, ids


def test_the_layer_is_the_reference_moe_on_the_blocks_values(layer) -> None:
    packed, w13, w2, _, _ = layer
    x, weights, ids = _routing(9, seed=1)
    assert set(ids.reshape(-1).tolist()) == set(range(EXPERTS))  # every expert runs
    got = ops.moe_experts(x, weights, ids, packed)
    want = fused_moe(x.double(), w13.double(), w2.double(), weights.double(), ids)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_the_layer_is_the_expert_by_expert_path(layer) -> None:
    """The same grouping and GEMMs as the Python loop it replaces; only the activation's
    exp (the C kernel's, not torch's) may round differently."""
    packed, _, _, gate_up, down = layer
    x, weights, ids = _routing(12, seed=2)

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        return ops.linear(silu_and_mul(ops.linear(xe, gate_up[e])), down[e])

    want = moe_combine(x, weights, ids, EXPERTS, expert)
    torch.testing.assert_close(ops.moe_experts(x, weights, ids, packed), want, atol=1e-6, rtol=1e-5)


def test_a_tokens_output_does_not_depend_on_the_batch(layer) -> None:
    packed = layer[0]
    x, weights, ids = _routing(16, seed=3)
    batched = ops.moe_experts(x, weights, ids, packed)
    for t in (0, 7, 15):
        alone = ops.moe_experts(x[t : t + 1], weights[t : t + 1], ids[t : t + 1], packed)
        assert torch.equal(alone[0], batched[t])


def test_experts_of_other_shapes_are_refused(layer) -> None:
    _, _, _, gate_up, down = layer
    with pytest.raises(ValueError, match="other shapes or kinds"):
        ops.PackedExperts.of(gate_up, [*down[:-1], gate_up[0]])


@pytest.mark.parametrize("renorm", [True, False])
def test_the_block_routes_as_the_torch_router_then_runs_the_experts(layer, renorm) -> None:
    """`moe_block` from the router's logits (strided rows, as a column range of a wider
    output): each token's experts are the softmax's top k (transformers' router), its weights
    those probabilities (renormalised over the k, or not) to float32 rounding, and the rest
    is `moe_experts` on them; a token's result alone is its result in the batch, bitwise."""
    packed = layer[0]
    gen = torch.Generator().manual_seed(8)
    t = 11
    x = torch.randn(t, H + 16, generator=gen)[:, 16:]
    logits = torch.randn(t, EXPERTS + 3, generator=gen)[:, :EXPERTS]
    probs = torch.softmax(logits, -1)
    weights, ids = probs.topk(TOP_K, dim=-1)
    if renorm:
        weights = weights / weights.sum(-1, keepdim=True)
    got = ops.moe_block(x, logits, packed, TOP_K, renorm)
    want = ops.moe_experts(x.contiguous(), weights, ids, packed)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for r in (0, 5, 10):
        assert torch.equal(
            ops.moe_block(x[r : r + 1], logits[r : r + 1], packed, TOP_K, renorm)[0], got[r]
        )
    with pytest.raises(ValueError, match="logits must be"):
        ops.moe_block(x, logits[:, :4], packed, TOP_K, renorm)
