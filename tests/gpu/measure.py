"""What the device check measures: engine-vs-transformers parity, throughput, roofline.

Each function takes a model directory and plain numbers and returns a JSON-able dict; the
orchestration (sections, time budget, report) is in ``tests/gpu/check.py``.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.cuda_graphs import CudaGraphRunner, EagerCapture, capture_sizes
from engine.messages import AddRequest
from engine.sampling_params import SamplingParams
from kernels import AttentionMetadata
from kernels.metadata import SeqSpan

CLEAR_MARGIN = 0.1
"""Logit gap between transformers' first and second choice for a position to count as clear."""


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_engine(
    model_dir: str, device: str, dtype: str, graphs: bool, max_num_seqs: int, max_model_len: int
) -> EngineCore:
    """An in-process engine core. On CPU "graphs" attaches the CUDA-graph runner with the
    eager stand-in, so the dry run goes through the same hook, buffers and padding."""
    config = EngineConfig(
        model=model_dir,
        device=device,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=2048,
        enforce_eager=not graphs,
        gpu_memory_utilization=0.25,
        kv_cache_memory=None if device.startswith("cuda") else 64 << 20,
        enable_prefix_caching=False,
    )
    core = EngineCore(config, progress=lambda _msg: None)
    if graphs and not device.startswith("cuda"):
        runner = core.runner
        stand_in = CudaGraphRunner(
            core.model,
            runner.attention,
            runner.block_size,
            core.max_model_len,
            capture_sizes(max_num_seqs),
            torch.device(device),
            EagerCapture(),
        )
        stand_in.capture_all()
        runner.cuda_graphs = stand_in
    return core


def engine_generate(
    core: EngineCore, prompts: list[list[int]], max_tokens: int, ban_eos: bool = False
) -> tuple[list[list[int]], list[float]]:
    """Greedy outputs of all prompts run as one continuous batch, and each step's seconds.

    EOS never ends a sequence; ``ban_eos`` also masks it out of the choice, as
    transformers' ``min_new_tokens`` does, so both sides pick from the same tokens."""
    if ban_eos:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        admission = core.add_request(
            AddRequest(request_id=f"r{i}", prompt_token_ids=ids, params=params)
        )
        assert admission.accepted, admission.message
        outs[f"r{i}"] = []
    step_s: list[float] = []
    while core.has_work():
        t0 = time.perf_counter()
        results = core.step()  # ends in the sampler's .tolist(): the step is finished
        step_s.append(time.perf_counter() - t0)
        for _, out in results:
            outs[out.request_id].extend(out.new_token_ids)
    return [outs[f"r{i}"] for i in range(len(prompts))], step_s


def hf_model(model_dir: str, device: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device)
    return model.eval()


def release() -> None:
    """Free what the last engine or transformers model held, before the next one sizes
    its KV cache from the free memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def hf_greedy(
    model: Any, prompts: list[list[int]], max_tokens: int, device: str
) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Ids from 4 up: 0..3 are the test tokenizer's special tokens.
    return torch.randint(4, vocab, (num, length), generator=gen).tolist()


def greedy_parity(
    model_dir: str,
    device: str,
    num_prompts: int,
    prompt_len: int,
    max_tokens: int,
    graphs: bool,
    max_model_len: int,
) -> dict[str, Any]:
    """fp32 (TF32 off) engine greedy tokens against transformers' generate: identical?"""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    core = make_engine(model_dir, device, "float32", graphs, max(num_prompts, 4), max_model_len)
    prompts = random_prompts(num_prompts, prompt_len, core.vocab_size, seed=1)
    ours, _ = engine_generate(core, prompts, max_tokens, ban_eos=True)
    replays = core.runner.cuda_graphs.num_replays if core.runner.cuda_graphs else 0
    del core
    release()
    ref_model = hf_model(model_dir, device, torch.float32)
    theirs = hf_greedy(ref_model, prompts, max_tokens, device)
    del ref_model
    release()
    first_diff = [
        next((j for j, (a, b) in enumerate(zip(o, t, strict=True)) if a != b), None)
        for o, t in zip(ours, theirs, strict=True)
    ]
    return {
        "identical": ours == theirs,
        "num_prompts": num_prompts,
        "new_tokens": max_tokens,
        "graph_replays": replays,
        "first_difference_per_prompt": first_diff,
    }


def _prefill_meta(
    core: EngineCore, lens: list[int], tables: list[list[int]], block_size: int
) -> AttentionMetadata:
    slots = [
        tables[i][p // block_size] * block_size + p % block_size
        for i, n in enumerate(lens)
        for p in range(n)
    ]
    spans = [SeqSpan(0, n, t) for n, t in zip(lens, tables, strict=True)]
    return core.runner.attention.build_metadata(spans, slots, block_size, core.device)


def teacher_forced_bf16(
    model_dir: str,
    device: str,
    num_seqs: int,
    prompt_len: int,
    new_tokens: int,
    graphs: bool,
    max_model_len: int,
) -> dict[str, Any]:
    """bf16: transformers' greedy continuation is fed to both sides; per position, top-1
    agreement and KL(transformers || hearth) of the next-token distributions. hearth's
    side runs one batched prefill, then batched decode steps (through the CUDA graphs
    when the engine captured them)."""
    ref_model = hf_model(model_dir, device, torch.bfloat16)
    prompts = random_prompts(num_seqs, prompt_len, ref_model.config.vocab_size, seed=2)
    conts = hf_greedy(ref_model, prompts, new_tokens, device)
    full = torch.tensor([p + c for p, c in zip(prompts, conts, strict=True)], device=device)
    with torch.inference_mode():
        ref_logits = ref_model(full[:, :-1]).logits[:, prompt_len - 1 :].float()  # [B, N, V]
    del ref_model
    release()

    core = make_engine(model_dir, device, "bfloat16", graphs, max(num_seqs, 4), max_model_len)
    model, runner, bs = core.model, core.runner, core.runner.block_size
    per_seq = -(-(prompt_len + new_tokens) // bs)
    # Sequence i owns cache blocks 1 + i * per_seq ...; the engine's own allocator is idle.
    table_rows = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(num_seqs)]
    assert table_rows[-1][-1] < core.model_info.num_kv_blocks
    ours = []
    with torch.inference_mode():
        meta = _prefill_meta(core, [prompt_len] * num_seqs, table_rows, bs)
        ids = full[:, :prompt_len].reshape(-1)
        pos = torch.arange(prompt_len, device=device).repeat(num_seqs)
        hidden = model(ids, pos, meta)
        last = torch.arange(1, num_seqs + 1, device=device) * prompt_len - 1
        ours.append(model.compute_logits(hidden[last]))
        for t in range(new_tokens - 1):
            p = prompt_len + t
            step_ids = full[:, p].tolist()
            slots = [row[p // bs] * bs + p % bs for row in table_rows]
            blocks = [row[: p // bs + 1] for row in table_rows]
            hidden = None
            if runner.cuda_graphs is not None:
                hidden = runner.cuda_graphs.run(step_ids, [p] * num_seqs, slots, blocks)
            if hidden is None:
                hidden = _eager_decode(core, step_ids, p, slots, blocks)
            ours.append(model.compute_logits(hidden))
    replays = runner.cuda_graphs.num_replays if runner.cuda_graphs else 0
    del core, model, runner
    release()
    mine = torch.stack(ours, dim=1)  # [B, N, V]
    agree = mine.argmax(-1) == ref_logits.argmax(-1)  # [B, N]
    top1 = agree.float().mean().item()
    # Random weights give flat distributions with near-ties that bf16 rounding can flip;
    # agreement where transformers' top two logits are CLEAR_MARGIN apart tells those
    # apart from real errors.
    top2 = ref_logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > CLEAR_MARGIN
    top1_clear = agree[clear].float().mean().item() if bool(clear.any()) else None
    log_p = torch.log_softmax(ref_logits, -1)
    log_q = torch.log_softmax(mine, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    return {
        "top1_agreement": top1,
        "top1_agreement_clear_margin": top1_clear,
        "clear_margin_positions": int(clear.sum()),
        "kl_nats_per_token": kl,
        "positions": num_seqs * new_tokens,
        "graph_replays": replays,
    }


def _eager_decode(
    core: EngineCore, ids: list[int], pos: int, slots: list[int], blocks: list[list[int]]
) -> torch.Tensor:
    dev = core.device
    spans = [SeqSpan(pos, 1, b) for b in blocks]
    meta = core.runner.attention.build_metadata(spans, slots, core.runner.block_size, dev)
    ids_t = torch.tensor(ids, dtype=torch.int64, device=dev)
    pos_t = torch.full((len(ids),), pos, dtype=torch.int64, device=dev)
    return core.model(ids_t, pos_t, meta)


def copy_bandwidth(device: str, num_bytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * num_bytes / statistics.median(times)


def decode_bytes(core: EngineCore, batch: int, mean_context: int) -> int:
    """Bytes one decode step must read: every weight once, plus each sequence's KV."""
    model = core.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    elem = torch.empty((), dtype=core.dtype).element_size()
    kv_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * elem
    return weights + batch * mean_context * kv_per_token


def engine_throughput(
    core: EngineCore, concurrency: list[int], in_len: int, out_len: int, bandwidth: float
) -> list[dict[str, Any]]:
    rows = []
    engine_generate(core, random_prompts(2, in_len, core.vocab_size, seed=9), 4)  # warm-up
    for c in concurrency:
        prompts = random_prompts(c, in_len, core.vocab_size, seed=c)
        t0 = time.perf_counter()
        outs, step_s = engine_generate(core, prompts, out_len)
        total = time.perf_counter() - t0
        assert all(len(o) == out_len for o in outs)
        # The last half of the steps are pure decodes of all c sequences.
        decode_s = statistics.median(step_s[len(step_s) // 2 :])
        floor_s = decode_bytes(core, c, in_len + out_len // 2) / bandwidth
        weights_s = decode_bytes(core, 0, 0) / bandwidth
        rows.append(
            {
                "concurrency": c,
                "output_tok_s": c * out_len / total,
                "decode_step_ms": decode_s * 1e3,
                "roofline_step_ms": floor_s * 1e3,
                "roofline_fraction": floor_s / decode_s,
                "step_over_weight_read": decode_s / weights_s,
            }
        )
    return rows


def hf_throughput(
    model_dir: str, device: str, concurrency: list[int], in_len: int, out_len: int
) -> list[dict[str, Any]]:
    """transformers' static-batch generate: c prompts of equal length, out_len tokens each."""
    model = hf_model(
        model_dir, device, torch.bfloat16 if device.startswith("cuda") else torch.float32
    )
    rows = []
    hf_greedy(model, random_prompts(1, 8, model.config.vocab_size, seed=3), 2, device)
    for c in concurrency:
        x = torch.tensor(random_prompts(c, in_len, model.config.vocab_size, seed=c), device=device)
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=out_len,
                min_new_tokens=out_len,
                pad_token_id=0,
            )
        _sync(device)
        rows.append({"concurrency": c, "output_tok_s": c * out_len / (time.perf_counter() - t0)})
    del model
    release()
    return rows
