"""CPU micro-benchmark of the torch reference attention (the CPU production path).

Shape: SmolLM2-135M (9 heads, 3 KV heads, head_dim 64), block size 16; a decode batch of
16 sequences with ~256 tokens of context, and one 512-token prefill. Every figure is one
layer's call with the step's plan already cached in ``meta.reference_plan`` (the model calls
attention 30 times per step with one ``meta``), except the ``plan build`` lines.

Besides the production functions in ``kernels.reference`` it times the alternative
formulations that were considered, so the choice can be re-checked on other hardware.
On a shared 2-core machine single figures are noisy: each line is the median of several
interleaved rounds, and only ratios measured in one run mean anything.

    python -m tools.bench_reference [--dtype float32|bfloat16] [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import reference
from kernels.metadata import AttentionMetadata
from kernels.reference_plan import reference_plan
from tests.kernels.cases import make_step

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
GROUP = NUM_HEADS // NUM_KV_HEADS


def _time_ms(fn: Callable[[], object], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def _bench(cases: dict[str, Callable[[], object]], rounds: int, iters: int) -> dict[str, float]:
    """Median over ``rounds`` of interleaved timings (interleaving spreads machine noise)."""
    for fn in cases.values():  # warm-up: allocator thresholds, thread pools, lazy inits
        _time_ms(fn, 3)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            samples[name].append(_time_ms(fn, iters))
    return {name: statistics.median(v) for name, v in samples.items()}


# --------------------------------------------------------------------- decode candidates


@dataclass(frozen=True)
class Inputs:
    """One layer's attention call: what every candidate formulation is given."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float

    def production(self) -> torch.Tensor:
        return reference.paged_attention(self.q, self.k_cache, self.v_cache, self.meta, self.scale)


Candidates = dict[str, Callable[[], torch.Tensor]]


def decode_candidates(x: Inputs) -> Candidates:
    """Each returns ``[B, num_heads, hd]``; all include their own K/V gather."""
    q, k_cache, v_cache, scale = x.q, x.k_cache, x.v_cache, x.scale
    b = q.shape[0]
    plan = reference_plan(x.meta, BLOCK_SIZE, k_cache.dtype).decode
    assert plan is not None
    add_mask, block_ids = plan.mask, plan.block_ids
    bool_mask = add_mask == 0
    length = add_mask.shape[-1]
    pos = torch.arange(length)
    table = block_ids.view(b, -1)
    slots = (table[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    k_flat = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    v_flat = v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)

    def gather() -> tuple[torch.Tensor, torch.Tensor]:
        return (
            reference._gather_blocks(k_cache, block_ids, b),
            reference._gather_blocks(v_cache, block_ids, b),
        )

    def group_rows_additive() -> torch.Tensor:
        k, v = gather()
        qg = q.view(b, NUM_KV_HEADS, GROUP, HEAD_DIM)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=add_mask, scale=scale)
        return o.reshape(b, NUM_HEADS, HEAD_DIM)

    def group_rows_bool() -> torch.Tensor:
        k, v = gather()
        qg = q.view(b, NUM_KV_HEADS, GROUP, HEAD_DIM)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=bool_mask, scale=scale)
        return o.reshape(b, NUM_HEADS, HEAD_DIM)

    def slot_gather_group_rows() -> torch.Tensor:
        k = k_flat.index_select(0, slots).view(b, length, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = v_flat.index_select(0, slots).view(b, length, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        qg = q.view(b, NUM_KV_HEADS, GROUP, HEAD_DIM)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=add_mask, scale=scale)
        return o.reshape(b, NUM_HEADS, HEAD_DIM)

    def enable_gqa() -> torch.Tensor:
        k, v = gather()
        o = F.scaled_dot_product_attention(
            q[:, :, None], k, v, attn_mask=add_mask, scale=scale, enable_gqa=True
        )
        return o.reshape(b, NUM_HEADS, HEAD_DIM)

    def repeat_kv() -> torch.Tensor:
        k, v = gather()
        k = k.repeat_interleave(GROUP, dim=1)
        v = v.repeat_interleave(GROUP, dim=1)
        o = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=add_mask, scale=scale)
        return o.reshape(b, NUM_HEADS, HEAD_DIM)

    def matmul_softmax() -> torch.Tensor:
        k, v = gather()
        qg = q.view(b, NUM_KV_HEADS, GROUP, HEAD_DIM)
        s = torch.matmul(qg, k.transpose(-1, -2)).float() * scale + add_mask
        p = torch.softmax(s, dim=-1).to(v.dtype)
        return torch.matmul(p, v).reshape(b, NUM_HEADS, HEAD_DIM)

    return {
        "production (reference.paged_attention)": x.production,
        "  gather only (2 x index_select of blocks)": gather,
        "block gather + group-as-rows SDPA, additive mask": group_rows_additive,
        "block gather + group-as-rows SDPA, bool mask": group_rows_bool,
        "slot gather + group-as-rows SDPA, additive mask": slot_gather_group_rows,
        "block gather + SDPA enable_gqa=True": enable_gqa,
        "block gather + repeat_interleave K/V + SDPA": repeat_kv,
        "block gather + matmul/softmax/matmul": matmul_softmax,
    }


# --------------------------------------------------------------------- prefill candidates


def prefill_candidates(x: Inputs) -> Candidates:
    """A lone 512-token chunk without prefix; each returns ``[n, num_heads, hd]``."""
    q, k_cache, v_cache, scale = x.q, x.k_cache, x.v_cache, x.scale
    n = q.shape[0]
    n_blk = -(-n // BLOCK_SIZE)
    block_ids = x.meta.prefill_block_tables[0, :n_blk].long()
    qs = q.view(1, n, NUM_HEADS, HEAD_DIM).transpose(1, 2)  # [1, H, n, hd]

    def gather() -> tuple[torch.Tensor, torch.Tensor]:
        k = reference._gather_blocks(k_cache, block_ids, 1)[:, :, :n]
        v = reference._gather_blocks(v_cache, block_ids, 1)[:, :, :n]
        return k, v

    def causal_gqa() -> torch.Tensor:
        k, v = gather()
        o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(n, NUM_HEADS, HEAD_DIM)

    def causal_repeat() -> torch.Tensor:
        k, v = gather()
        k = k.repeat_interleave(GROUP, dim=1)
        v = v.repeat_interleave(GROUP, dim=1)
        o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)
        return o.transpose(1, 2).reshape(n, NUM_HEADS, HEAD_DIM)

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    add_mask = torch.zeros(n, n, dtype=q.dtype).masked_fill_(~causal, float("-inf"))
    group_mask = add_mask.repeat(GROUP, 1)  # rows: (group member, query)

    def masked_gqa() -> torch.Tensor:
        k, v = gather()
        o = F.scaled_dot_product_attention(
            qs, k, v, attn_mask=add_mask, scale=scale, enable_gqa=True
        )
        return o.transpose(1, 2).reshape(n, NUM_HEADS, HEAD_DIM)

    def masked_group_rows() -> torch.Tensor:
        k, v = gather()
        qg = q.view(1, n, NUM_KV_HEADS, GROUP, HEAD_DIM).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(1, NUM_KV_HEADS, GROUP * n, HEAD_DIM)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=group_mask, scale=scale)
        o = o.view(1, NUM_KV_HEADS, GROUP, n, HEAD_DIM).permute(0, 3, 1, 2, 4)
        return o.reshape(n, NUM_HEADS, HEAD_DIM)

    return {
        "production (reference.paged_attention)": x.production,
        "is_causal SDPA, enable_gqa=True": causal_gqa,
        "is_causal SDPA, repeat_interleave K/V": causal_repeat,
        "additive causal mask SDPA, enable_gqa=True": masked_gqa,
        "additive causal mask SDPA, group-as-rows": masked_group_rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    num_blocks = 1024
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, dtype {args.dtype}, "
        f"heads {NUM_HEADS}/{NUM_KV_HEADS}, head_dim {HEAD_DIM}, block {BLOCK_SIZE}"
    )

    # 16 decodes, context 240..272 (mean ~256)
    dec_lens = torch.randint(240, 273, (16,), generator=gen).tolist()
    step = make_step([(s, 1) for s in dec_lens], BLOCK_SIZE, num_blocks, generator=gen)
    q = torch.randn(16, NUM_HEADS, HEAD_DIM, dtype=dtype)
    cands = decode_candidates(Inputs(q, k_cache, v_cache, step.meta, scale))
    ref = cands["block gather + repeat_interleave K/V + SDPA"]().float()
    print(f"\ndecode: 16 sequences, context {min(dec_lens)}..{max(dec_lens)}; ms per layer call")
    for name, ms in _bench(cands, args.rounds, args.iters).items():
        err_s = ""
        if "gather only" not in name:
            err_s = f"   max|diff| {(cands[name]().float() - ref).abs().max():.1e}"
        print(f"  {ms:7.3f}  {name}{err_s}")
    t0 = time.perf_counter()
    for _ in range(20):
        step.meta.reference_plan = None
        reference_plan(step.meta, BLOCK_SIZE, dtype)
    print(f"  {(time.perf_counter() - t0) / 20 * 1e3:7.3f}  plan build (once per step)")

    # one 512-token prefill, no cached prefix
    n = 512
    step = make_step([(n, n)], BLOCK_SIZE, num_blocks, generator=gen)
    q = torch.randn(n, NUM_HEADS, HEAD_DIM, dtype=dtype)
    cands = prefill_candidates(Inputs(q, k_cache, v_cache, step.meta, scale))
    ref = cands["is_causal SDPA, repeat_interleave K/V"]().float()
    print(f"\nprefill: one {n}-token chunk, no cached prefix; ms per layer call")
    for name, ms in _bench(cands, args.rounds, max(1, args.iters // 4)).items():
        err = (cands[name]().float() - ref).abs().max()
        print(f"  {ms:7.3f}  {name}   max|diff| {err:.1e}")

    # the general (masked) path: the same 512 queries as a chunk after a 256-token prefix,
    # and a mixed step of 16 decodes + that chunk.
    print("\ngeneral paths; ms per layer call (plan cached)")
    cases: Candidates = {}
    chunk = make_step([(256 + n, n)], BLOCK_SIZE, num_blocks, generator=gen)
    cases[f"prefill chunk {n} after a 256-token prefix (masked SDPA)"] = Inputs(
        q, k_cache, v_cache, chunk.meta, scale
    ).production
    two = make_step([(300, 300), (212, 212)], BLOCK_SIZE, num_blocks, generator=gen)
    cases["two prefills 300 + 212 tokens, padded batch (masked SDPA)"] = Inputs(
        q, k_cache, v_cache, two.meta, scale
    ).production
    mixed = make_step([(s, 1) for s in dec_lens] + [(n, n)], BLOCK_SIZE, num_blocks, generator=gen)
    qm = torch.randn(16 + n, NUM_HEADS, HEAD_DIM, dtype=dtype)
    cases[f"mixed step: 16 decodes + {n}-token prefill"] = Inputs(
        qm, k_cache, v_cache, mixed.meta, scale
    ).production
    for name, ms in _bench(cases, args.rounds, max(1, args.iters // 4)).items():
        print(f"  {ms:7.3f}  {name}")


if __name__ == "__main__":
    main()
