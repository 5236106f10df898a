"""A tiny-MoE engine step against the same-size dense steps, on the paged cache, no HTTP.

    python -m tools.bench_moe_step [--batch 1 8 32] [--prompt-len 64] [--steps 8] [--threads N]

Builds (random weights, no checkpoint) a Mixtral of ``--experts`` experts, top
``--top-k``, expert width ``--inter``, and two Mistral models of the same attention and
depth: *dense-active*, MLP width ``top_k * inter`` (the same multiply-adds per token as
the MoE), and *dense-total*, width ``experts * inter`` (the same MLP weights). For each
model it prints the median decode step (ms) at each batch size, with the prefill of
``--prompt-len`` tokens per sequence, for the MoE layer's method (``expert-linears``
on CPU, the one the engine picks; ``--method grouped-gemm`` runs ``kernels.fused_moe``,
Triton on CUDA). The MoE's overhead over dense-active is the routing and the per-expert
grouping (one sort and one host sync per layer on CPU); its saving against dense-total is
the experts it does not compute. Figures on a shared host are comparable within one run
only; on a busy one, ``--threads 1`` keeps OpenMP barriers out of the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from transformers import MistralConfig, MixtralConfig

from engine.layers.moe import EXPERT_LINEARS, GROUPED_GEMM, use_moe_method
from engine.models.llama import MistralForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from tests.engine.test_llama_parity import PagedRunner


def _shape(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "vocab_size": 1024,
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 128),
        "head_dim": 64,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
    }


def _random(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fill every parameter (the experts' are views of the stacked weights) with small
    random values: uninitialised memory could hold NaNs, whose arithmetic is slower."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _time_model(
    model: torch.nn.Module, batch: int, prompt_len: int, steps: int, device: str
) -> tuple[float, float]:
    """(prefill seconds of `batch` prompts in one step, median decode step ms)."""
    block = 16
    blocks = batch * ((prompt_len + steps + block) // block + 1) + 8
    runner = PagedRunner(model, block_size=block, num_blocks=blocks, device=device)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(1, 1024, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    seqs = [f"s{i}" for i in range(batch)]
    t0 = time.perf_counter()
    rows = runner.step(list(zip(seqs, prompts, strict=True)))
    prefill = time.perf_counter() - t0
    times: list[float] = []
    for _ in range(steps):
        work = [(s, [int(r.argmax())]) for s, r in zip(seqs, rows, strict=True)]
        t0 = time.perf_counter()
        rows = runner.step(work)
        times.append(time.perf_counter() - t0)
    return prefill, statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_moe_step", description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--inter", type=int, default=256)
    parser.add_argument("--method", choices=["expert-linears", "grouped-gemm"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads (default: torch's, all cores)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shape = _shape(args)
    moe_cfg = MixtralConfig(
        **shape, intermediate_size=args.inter, num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )  # fmt: skip
    models: dict[str, torch.nn.Module] = {
        f"moe {args.experts}x{args.inter} top-{args.top_k}": MixtralForCausalLM(
            moe_cfg, torch.float32, device
        ),
        f"dense-active {args.top_k * args.inter}": MistralForCausalLM(
            MistralConfig(**shape, intermediate_size=args.top_k * args.inter), torch.float32, device
        ),
        f"dense-total {args.experts * args.inter}": MistralForCausalLM(
            MistralConfig(**shape, intermediate_size=args.experts * args.inter),
            torch.float32,
            device,
        ),
    }
    method = {"expert-linears": EXPERT_LINEARS, "grouped-gemm": GROUPED_GEMM}.get(args.method or "")
    for model in models.values():
        _random(model, seed=0)
        if method is not None:
            use_moe_method(model, method)
    print(
        f"float32 on {device}, {torch.get_num_threads()} threads; hidden {args.hidden}, "
        f"{args.layers} layers, prompt {args.prompt_len} tokens, median of {args.steps} decode "
        f"steps; MoE method {args.method or 'expert-linears'}"
    )
    print(f"{'model':<28} {'params':>8} " + " ".join(f"{'b=' + str(b):>18}" for b in args.batch))
    with torch.no_grad():
        for name, model in models.items():
            _time_model(model, 1, 8, 2, args.device)  # warm-up
            cells = []
            for b in args.batch:
                prefill, decode = _time_model(model, b, args.prompt_len, args.steps, args.device)
                cells.append(f"{decode:7.2f} ms {prefill * 1e3:6.0f} pf")
            n = sum(p.numel() for p in model.parameters()) / 1e6
            print(f"{name:<28} {n:>7.2f}M " + " ".join(f"{c:>18}" for c in cells))
    print("cells: median decode step (ms), then the prefill step of all prompts (ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
