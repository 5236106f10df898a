"""Prompt log-probabilities from the whole engine (scheduler, paged cache, chunked
prefill, prefix cache, preemption) equal transformers' `log_softmax` of its own logits on
the same SmolLM2 weights, in fp32, within 1e-4 per token; the top-k alternatives match."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.messages import AddRequest, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TOL = 1e-4
TOP_K = 5
SHARED = "You are a careful assistant. Answer every question truthfully and briefly. " * 5

TEXTS = [
    "Hello, how are you?",
    "The capital of France is Paris.",
    "Question: What is 2 + 2?\nAnswer: 4",
    "def add(a, b):\n    return a + b\n",
    "Quelle est la capitale de l'Allemagne ? Berlin.",
    "请用中文介绍一下长城。",
    " ".join(f"Item {i}: a line of a long list." for i in range(30)),
    SHARED + "Why is the sky blue?",
    SHARED + "Why do cats purr?",
]


@pytest.fixture(scope="module")
def prompts(model_smollm2_dir: str) -> list[list[int]]:
    tok = Tokenizer(model_smollm2_dir)
    out = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    rng = random.Random(7)
    out.append([rng.randrange(49152) for _ in range(37)])  # token ids, not text
    out.append([1])  # a one-token prompt has nothing to score
    return out


@pytest.fixture(scope="module")
def hf_model(smollm2_hf_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32)
    return model.eval()


_REFERENCE_CACHE: dict[tuple[int, ...], object] = {}


def reference(hf_model, ids: list[int]):
    """transformers' log-softmax over the vocabulary for every prompt position: [L-1, V]."""
    import torch

    key = tuple(ids)
    if key not in _REFERENCE_CACHE:
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
            _REFERENCE_CACHE[key] = torch.log_softmax(logits, dim=-1)
    return _REFERENCE_CACHE[key]


def check_against_reference(
    entries: list[TokenLogprob | None], ids: list[int], ref, k: int
) -> float:
    """Assert every entry matches the reference; returns the largest log-prob difference."""
    import torch

    assert len(entries) == len(ids)
    assert entries[0] is None
    scored = entries[1:]
    assert all(e is not None for e in scored)
    assert [e.token_id for e in scored] == ids[1:]
    if not scored:
        return 0.0
    targets = torch.tensor(ids[1:]).unsqueeze(1)
    expected = ref.gather(1, targets)  # [L-1, 1]
    got = torch.tensor([[e.logprob] for e in scored])
    worst = float((got - expected).abs().max())
    assert worst <= TOL
    # Rank: 1 + tokens strictly more likely, allowing near-ties either way.
    ranks = torch.tensor([e.rank for e in scored])
    assert bool(((ref > expected + TOL).sum(1) + 1 <= ranks).all())
    assert bool((ranks <= (ref > expected - TOL).sum(1) + 1).all())
    assert all(len(e.top) == k for e in scored)
    if k:
        ref_top = ref.topk(k + 1, dim=-1)
        top_ids = torch.tensor([[t for t, _ in e.top] for e in scored])
        top_lps = torch.tensor([[lp for _, lp in e.top] for e in scored])
        # Each alternative's logprob is transformers' for that id, in transformers' order.
        assert float((top_lps - ref.gather(1, top_ids)).abs().max()) <= TOL
        assert float((top_lps - ref_top.values[:, :k]).abs().max()) <= TOL
        # The same ids, except where the k-th and (k+1)-th are a near-tie.
        clear = (ref_top.values[:, k - 1] - ref_top.values[:, k]) > TOL
        same = top_ids.sort(1).values == ref_top.indices[:, :k].sort(1).values
        assert bool(same.all(1)[clear].all())
    return worst


def score(core, prompts: list[list[int]], tag: str, **params) -> dict[str, RequestOutput]:
    """Admit all prompts at once, run to the end; the first output of each request."""
    params.setdefault("max_tokens", 1)
    sp = SamplingParams(temperature=0.0, prompt_logprobs=TOP_K, **params)
    firsts: dict[str, RequestOutput] = {}
    for i, ids in enumerate(prompts):
        admission = core.add_request(
            AddRequest(request_id=f"{tag}-{i}", prompt_token_ids=ids, params=sp)
        )
        assert admission.accepted, admission.message
    while core.has_work():
        for _, out in core.step():
            firsts.setdefault(out.request_id, out)
    assert core.block_manager.num_used_blocks == 0
    return firsts


@pytest.fixture(scope="module")
def core(model_smollm2_dir: str):
    from engine.core import EngineCore

    # --quantization gguf: the file's exact weights in float32 (on AMX / AVX512-BF16 hosts the default
    # gguf-bf16 rounds operands to bfloat16, ~1e-2 nat: above this test's bound).
    return EngineCore(
        EngineConfig(
            model=model_smollm2_dir, quantization="gguf", max_model_len=2048, max_num_seqs=32
        )
    )


@pytest.fixture(scope="module")
def chunked_core(model_smollm2_dir: str):
    from engine.core import EngineCore

    # A 40-token budget: long prompts are scored over many chunks, interleaved.
    return EngineCore(
        EngineConfig(
            model=model_smollm2_dir,
            quantization="gguf",
            max_model_len=2048,
            max_num_batched_tokens=40,
        )
    )


def test_batch_matches_transformers(core, prompts, hf_model) -> None:
    outs = score(core, prompts, "batch")
    worst = 0.0
    for i, ids in enumerate(prompts):
        out = outs[f"batch-{i}"]
        assert out.prompt_logprobs is not None
        worst = max(
            worst,
            check_against_reference(out.prompt_logprobs, ids, reference(hf_model, ids), TOP_K),
        )
    print(f"\nbatch of {len(prompts)} prompts: max |hearth - transformers| = {worst:.2e}")


def test_chunked_prefill_matches_transformers(chunked_core, prompts, hf_model) -> None:
    assert max(len(p) for p in prompts) > 8 * 40
    outs = score(chunked_core, prompts, "chunked")
    worst = 0.0
    for i, ids in enumerate(prompts):
        entries = outs[f"chunked-{i}"].prompt_logprobs
        assert entries is not None
        worst = max(worst, check_against_reference(entries, ids, reference(hf_model, ids), TOP_K))
    print(f"\nchunked (budget 40): max |hearth - transformers| = {worst:.2e}")


def test_cached_prefix_is_recomputed_for_scoring(core, prompts, hf_model) -> None:
    bm = core.block_manager
    bm.reset_prefix_cache()
    # A plain request fills the cache with the shared system prefix...
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    core.add_request(AddRequest(request_id="warm", prompt_token_ids=prompts[7], params=plain))
    while core.has_work():
        core.step()
    # ...a scoring request with the same prefix must not take it from there...
    out = score(core, [prompts[8]], "pc")["pc-0"]
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs is not None
    check_against_reference(out.prompt_logprobs, prompts[8], reference(hf_model, prompts[8]), TOP_K)
    # ...and plain requests still hit the cache afterwards.
    core.add_request(AddRequest(request_id="after", prompt_token_ids=prompts[8], params=plain))
    cached = []
    while core.has_work():
        cached += [o.num_cached_tokens for _, o in core.step()]
    assert cached[0] > 0


def test_max_tokens_zero_scores_only(core, prompts, hf_model) -> None:
    outs = score(core, prompts[:3], "zero", max_tokens=0)
    for i, ids in enumerate(prompts[:3]):
        out = outs[f"zero-{i}"]
        assert out.new_token_ids == [] and out.finish_reason == "length"
        assert out.prompt_logprobs is not None
        check_against_reference(out.prompt_logprobs, ids, reference(hf_model, ids), TOP_K)


def test_zero_alternatives_and_generation_after_scoring(core, prompts, hf_model) -> None:
    ids = prompts[1]
    sp = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0, ignore_eos=True)
    core.add_request(AddRequest(request_id="gen", prompt_token_ids=ids, params=sp))
    outs = []
    while core.has_work():
        outs += [o for _, o in core.step()]
    assert outs[0].prompt_logprobs is not None
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert sum(len(o.new_token_ids) for o in outs) == 4
    check_against_reference(outs[0].prompt_logprobs, ids, reference(hf_model, ids), 0)


def test_preemption_scores_each_token_once(model_smollm2_dir, prompts, hf_model) -> None:
    from engine.core import EngineCore

    # A pool too small for everything at once: sequences are preempted mid-scoring and
    # recomputed; every prompt token still gets exactly one, correct, entry.
    small = EngineCore(
        EngineConfig(
            model=model_smollm2_dir,
            quantization="gguf",
            num_kv_blocks=20,
            max_num_batched_tokens=64,
        )
    )
    batch = [p for p in prompts if len(p) < 150]
    assert sum(len(p) + 16 for p in batch) > 20 * 16
    outs = score(small, batch, "preempt", max_tokens=16, ignore_eos=True)
    assert small.scheduler.num_preemptions > 0
    for i, ids in enumerate(batch):
        entries = outs[f"preempt-{i}"].prompt_logprobs
        assert entries is not None
        check_against_reference(entries, ids, reference(hf_model, ids), TOP_K)


def test_bad_prompt_logprobs_refused(core) -> None:
    for params in (
        SamplingParams(max_tokens=-1),
        SamplingParams(max_tokens=1, prompt_logprobs=-1),
        SamplingParams(max_tokens=1, prompt_logprobs=10**6),
    ):
        admission = core.add_request(
            AddRequest(request_id="bad", prompt_token_ids=[1, 2, 3], params=params)
        )
        assert not admission.accepted and admission.error_kind == "invalid"
    assert not core.has_work()


def test_max_tokens_zero_without_prompt_logprobs_prefills_only(core) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=0)
    core.add_request(AddRequest(request_id="prefill", prompt_token_ids=[1, 2, 3], params=sp))
    outs = []
    while core.has_work():
        outs += [o for _, o in core.step()]
    assert [(o.new_token_ids, o.finish_reason, o.prompt_logprobs) for o in outs] == [
        ([], "length", None)
    ]
    assert core.block_manager.num_used_blocks == 0
