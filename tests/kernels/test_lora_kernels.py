"""Batched LoRA (shrink, expand): the torch reference and the Triton kernel against a
float64 per-token oracle, on a step mixing base tokens and three adapters of different
ranks, some of which leave shards untargeted."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.reference_lora import LoRAStack, LoRAStep, add_lora

SHARD_ROWS = (8, 4, 4)  # a fused q/k/v-like output: three shards
IN_FEATURES = 24
MAX_RANK = 8
RANKS = [[8, 8, 0], [4, 0, 4], [2, 2, 2]]  # per slot, per shard; 0: untargeted
TOKEN_SLOTS = [-1, 0, 2, 0, -1, 1, 2, 2, -1]


def _stack(
    device: str, dtype: torch.dtype, seed: int = 0, in_features: int = IN_FEATURES
) -> LoRAStack:
    g = torch.Generator().manual_seed(seed)
    num_slots, out = len(RANKS), sum(SHARD_ROWS)
    bounds = [0]
    for rows in SHARD_ROWS:
        bounds.append(bounds[-1] + rows)
    a = torch.zeros(num_slots, len(SHARD_ROWS), MAX_RANK, in_features)
    b = torch.zeros(num_slots, out, MAX_RANK)
    scales = torch.zeros(num_slots, len(SHARD_ROWS))
    for slot, ranks in enumerate(RANKS):
        for shard, r in enumerate(ranks):
            if r:
                a[slot, shard, :r] = torch.randn(r, in_features, generator=g)
                b[slot, bounds[shard] : bounds[shard + 1], :r] = torch.randn(
                    SHARD_ROWS[shard], r, generator=g
                )
                scales[slot, shard] = 16.0 / r
    row_shard = torch.repeat_interleave(
        torch.arange(len(SHARD_ROWS), dtype=torch.int32), torch.tensor(SHARD_ROWS)
    )
    return LoRAStack(
        a.to(device, dtype), b.to(device, dtype), scales.to(device), tuple(bounds), RANKS,
        row_shard.to(device), scales.tolist(),
    )  # fmt: skip


def _oracle(y: torch.Tensor, x: torch.Tensor, stack: LoRAStack) -> torch.Tensor:
    """Token by token in float64, from the definition."""
    out = y.double().clone()
    bounds = stack.shard_bounds
    for t, slot in enumerate(TOKEN_SLOTS):
        if slot < 0:
            continue
        for shard, r in enumerate(stack.ranks[slot]):
            if not r:
                continue
            a = stack.lora_a[slot, shard, :r].double()
            b = stack.lora_b[slot, bounds[shard] : bounds[shard + 1], :r].double()
            delta = b @ (a @ x[t].double())
            out[t, bounds[shard] : bounds[shard + 1]] += float(stack.scales[slot, shard]) * delta
    return out


def _inputs(
    device: str, dtype: torch.dtype, in_features: int = IN_FEATURES
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(TOKEN_SLOTS), in_features, generator=g).to(device, dtype)
    y = torch.randn(len(TOKEN_SLOTS), sum(SHARD_ROWS), generator=g).to(device, dtype)
    return x, y


def test_reference_matches_the_per_token_oracle() -> None:
    stack = _stack("cpu", torch.float32)
    x, y = _inputs("cpu", torch.float32)
    expected = _oracle(y, x, stack)
    got = add_lora(y.clone(), x, stack, LoRAStep.build(TOKEN_SLOTS, torch.device("cpu")))
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)


def test_reference_leaves_base_tokens_bit_identical() -> None:
    stack = _stack("cpu", torch.float32)
    x, y = _inputs("cpu", torch.float32)
    got = add_lora(y.clone(), x, stack, LoRAStep.build(TOKEN_SLOTS, torch.device("cpu")))
    base = [t for t, s in enumerate(TOKEN_SLOTS) if s < 0]
    assert torch.equal(got[base], y[base])
    adapted = [t for t, s in enumerate(TOKEN_SLOTS) if s >= 0]
    assert not torch.equal(got[adapted], y[adapted])  # the LoRA term did something


def test_a_step_without_adapter_tokens_changes_nothing() -> None:
    stack = _stack("cpu", torch.float32)
    x, y = _inputs("cpu", torch.float32)
    step = LoRAStep.build([-1] * len(TOKEN_SLOTS), torch.device("cpu"))
    assert torch.equal(add_lora(y.clone(), x, stack, step), y)


def test_reference_is_peft_order_at_the_true_rank() -> None:
    """One adapter group equals ``y + F.linear(F.linear(x, A), B) * scale`` bit for bit:
    what PEFT's lora.Linear computes (the exact mode's token identity rests on it)."""
    stack = _stack("cpu", torch.float32)
    x, y = _inputs("cpu", torch.float32)
    slots = [1] * len(TOKEN_SLOTS)
    got = add_lora(y.clone(), x, stack, LoRAStep.build(slots, torch.device("cpu")))
    lo, hi = stack.shard_bounds[0], stack.shard_bounds[1]
    a, b = stack.lora_a[1, 0, :4], stack.lora_b[1, lo:hi, :4]
    peft = y[:, lo:hi] + torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * 4.0
    assert torch.equal(got[:, lo:hi], peft)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_the_oracle(force_triton: str, dtype: torch.dtype) -> None:
    device = force_triton
    stack = _stack(device, dtype)
    x, y = _inputs(device, dtype)
    step = LoRAStep.build(TOKEN_SLOTS, torch.device(device))
    expected = _oracle(y.cpu(), x.cpu(), _stack("cpu", dtype))
    got = kernels.add_lora(y.clone(), x, stack, step)  # the public op, routed to Triton
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.5, "rtol": 3e-2}
    torch.testing.assert_close(got.cpu().double(), expected, **tol)
    base = [t for t, s in enumerate(TOKEN_SLOTS) if s < 0]
    assert torch.equal(got[base], y[base])


def _cpu_ops():
    ops = pytest.importorskip("kernels.cpu.ops")
    if not ops.available():
        pytest.skip("host has no AVX2: the C kernels do not run here")
    return ops


@pytest.mark.parametrize("in_features", [IN_FEATURES, 576])
def test_the_c_kernel_matches_the_oracle_and_leaves_base_tokens(in_features: int) -> None:
    """`kernels.cpu.ops.add_lora` (the fast path's, `hearth_lora`): within float32 sums
    of the float64 oracle, base tokens untouched bit for bit, input rows strided (a column
    range of a fused output) and 576 columns (past the 16-wide vector loop, with a tail)."""
    ops = _cpu_ops()
    stack = _stack("cpu", torch.float32, in_features=in_features)
    x, y = _inputs("cpu", torch.float32, in_features)
    wide = torch.randn(x.shape[0], in_features + 8)
    wide[:, 3 : 3 + in_features] = x
    step = LoRAStep.build(TOKEN_SLOTS, torch.device("cpu"))
    got = ops.add_lora(y.clone(), wide[:, 3 : 3 + in_features], stack, step)
    torch.testing.assert_close(got.double(), _oracle(y, x, stack), atol=1e-4, rtol=1e-5)
    base = [t for t, s in enumerate(TOKEN_SLOTS) if s < 0]
    assert torch.equal(got[base], y[base])
    assert torch.equal(ops.add_lora(y.clone(), x, stack, LoRAStep.build([-1] * 9, x.device)), y)


def test_the_c_kernel_gives_a_token_the_same_bits_alone_or_batched() -> None:
    ops = _cpu_ops()
    stack = _stack("cpu", torch.float32)
    x, y = _inputs("cpu", torch.float32)
    batched = ops.add_lora(y.clone(), x, stack, LoRAStep.build(TOKEN_SLOTS, x.device))
    for t, slot in enumerate(TOKEN_SLOTS):
        alone = ops.add_lora(
            y[t : t + 1].clone(), x[t : t + 1], stack, LoRAStep.build([slot], x.device)
        )
        assert torch.equal(alone[0], batched[t]), t
