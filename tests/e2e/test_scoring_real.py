"""Scoring through the real server (gunicorn + uvicorn workers + engine core + SmolLM2):
echoed prompt logprobs, `max_tokens` 0, vLLM's `prompt_logprobs`, and a multiple-choice
run shaped exactly like lm-evaluation-harness's `local-completions` loglikelihood
requests, all checked against transformers' log-softmax on the same weights (fp32).

The multiple-choice task is tests/eval/mc_questions.jsonl (24 questions x 4 choices),
the same file docs/evaluation.md runs the real `lm_eval` CLI on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.tokenizer import Tokenizer
from tests.e2e.clients import TIMEOUT, client
from tests.e2e.server import Server

# NOTE: the module's first test also starts the shared server (minutes on a busy
# 2-core host, and pytest-timeout counts fixture setup), hence the longer limit.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MODEL = "smollm2"
TOL = 1e-4
MC_FILE = Path(__file__).resolve().parents[1] / "eval" / "mc_questions.jsonl"
SHARED = "You are a careful assistant. Answer every question truthfully and briefly. " * 5


@pytest.fixture(scope="module")
def hf_model(smollm2_hf_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(model_smollm2_dir: str) -> Tokenizer:
    return Tokenizer(model_smollm2_dir)


def reference(hf_model, ids: list[int]):
    """transformers' log-softmax for every prompt position after the first: [L-1, V]."""
    import torch

    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1)


def complete(server: Server, **body: Any) -> dict[str, Any]:
    r = httpx.post(server.v1 + "/completions", json={"model": MODEL, **body}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


# -- lm-evaluation-harness's loglikelihood requests -------------------------------------
def encode_pair(tok: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair`: trailing spaces move to the continuation, the whole is
    encoded once and split where the context's own encoding ends."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


def continuation_logprobs(hf_model, requests: list[tuple[list[int], int]]) -> list[float]:
    """transformers' summed logprob of each continuation (tokens from ctxlen on), in
    right-padded batches (a causal model's real positions never see the padding)."""
    import torch

    sums: list[float] = []
    for start in range(0, len(requests), 24):
        batch = requests[start : start + 24]
        width = max(len(ids) for ids, _ in batch)
        x = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(x)
        for row, (ids, _) in enumerate(batch):
            x[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        with torch.inference_mode():
            logprobs = torch.log_softmax(hf_model(x, attention_mask=mask).logits.float(), dim=-1)
        for row, (ids, ctxlen) in enumerate(batch):
            sums.append(sum(float(logprobs[row, t - 1, ids[t]]) for t in range(ctxlen, len(ids))))
    return sums


def lm_eval_payload(prompts: list[list[int]]) -> dict[str, Any]:
    """`LocalCompletionsAPI._create_payload(generate=False)`, byte for byte."""
    return {
        "model": MODEL,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }


def lm_eval_parse(out: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """`LocalCompletionsAPI.parse_logprobs`: the continuation's summed logprob (the last,
    generated token dropped) and whether every continuation token was the top one."""
    res = []
    for choice, ctxlen in zip(
        sorted(out["choices"], key=lambda c: c["index"]), ctxlens, strict=True
    ):
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(lp == max(top.values()) for lp, top in zip(logprobs, tops, strict=True))
        res.append((sum(logprobs), greedy))
    return res


def test_lm_eval_multiple_choice_matches_transformers(
    invariant_server, tokenizer, hf_model
) -> None:
    docs = [json.loads(line) for line in MC_FILE.read_text().splitlines()]
    assert len(docs) >= 20 and all(len(d["choices"]) == 4 for d in docs)
    requests = []
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"
        for choice in doc["choices"]:
            ctx, cont = encode_pair(tokenizer, context, f" {choice}")
            requests.append((ctx + cont, len(ctx)))
    results: list[tuple[float, bool]] = []
    for start in range(0, len(requests), 48):  # many prompts per request
        batch = requests[start : start + 48]
        out = complete(invariant_server, **lm_eval_payload([ids for ids, _ in batch]))
        assert len(out["choices"]) == len(batch)
        results += lm_eval_parse(out, [ctxlen for _, ctxlen in batch])

    expected = continuation_logprobs(hf_model, requests)
    ours, theirs, worst = [], [], 0.0
    for q in range(len(docs)):
        got = [results[q * 4 + c][0] for c in range(4)]
        want = expected[q * 4 : q * 4 + 4]
        for c in range(4):
            worst = max(worst, abs(got[c] - want[c]))
            assert got[c] == pytest.approx(want[c], abs=1e-3), (q, c)
        ours.append(max(range(4), key=lambda c: got[c]))
        theirs.append(max(range(4), key=lambda c: want[c]))
    assert ours == theirs
    accuracy = sum(p == d["answer"] for p, d in zip(ours, docs, strict=True)) / len(docs)
    print(
        f"\n{len(docs)} questions: same picks as transformers, max |sum diff| {worst:.2e}, acc {accuracy:.3f}"
    )


# -- the wire shapes, through the openai SDK ---------------------------------------------
def check_entries(tokens: list[int], token_logprobs: list, tops: list, ref, k: int) -> float:
    assert token_logprobs[0] is None and tops[0] is None
    worst = 0.0
    for pos in range(1, len(tokens)):
        expected = float(ref[pos - 1, tokens[pos]])
        worst = max(worst, abs(token_logprobs[pos] - expected))
        assert token_logprobs[pos] == pytest.approx(expected, abs=TOL)
        # k alternatives plus the token itself (fewer when it is among them, or texts collide).
        assert len(tops[pos]) <= k + 1
        assert max(tops[pos].values()) == pytest.approx(float(ref[pos - 1].max()), abs=TOL)
    return worst


def test_echo_logprobs_max_tokens_zero_through_the_sdk(invariant_server, tokenizer, hf_model):
    sdk = client(invariant_server)
    texts = ["The capital of France is Paris.", "def add(a, b):\n    return a + b\n"]
    ids_prompt = tokenizer.encode(
        "Question: What do bees make?\nAnswer: honey", add_special_tokens=False
    )
    for prompt in [*texts, ids_prompt]:
        ids = (
            prompt
            if isinstance(prompt, list)
            else tokenizer.encode(prompt, add_special_tokens=False)
        )
        reply = sdk.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=5, max_tokens=0, temperature=0
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "length"
        assert choice.text == (prompt if isinstance(prompt, str) else tokenizer.decode(ids))
        lp = choice.logprobs
        assert lp.tokens == [tokenizer.decode([t]) for t in ids]
        check_entries(ids, lp.token_logprobs, lp.top_logprobs, reference(hf_model, ids), 5)
        assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 0


def test_prompt_logprobs_after_a_prefix_cache_hit(invariant_server, tokenizer, hf_model):
    sdk = client(invariant_server)
    # A plain request puts the shared prefix in the cache...
    sdk.completions.create(model=MODEL, prompt=SHARED + "Why is the sky blue?", max_tokens=1)
    prompt = SHARED + "Why do cats purr?"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    # ...the scoring request with the same prefix still gets every position right.
    reply = sdk.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    entries = (reply.choices[0].model_extra or {})["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    ref = reference(hf_model, ids)
    for pos in range(1, len(ids)):
        position = entries[pos]
        own = position[str(ids[pos])]
        assert own["logprob"] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=TOL)
        assert own["decoded_token"] == tokenizer.decode([ids[pos]])
        top3 = sorted(((v["rank"], int(k)) for k, v in position.items() if v["rank"] <= 3))
        assert [r for r, _ in top3][-1] <= 3 and len(position) in (3, 4)
        for _, tid in top3:
            assert position[str(tid)]["logprob"] == pytest.approx(float(ref[pos - 1, tid]), abs=TOL)
    chat = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    chat_entries = (chat.model_extra or {})["prompt_logprobs"]
    assert chat_entries[0] is None and chat.usage.prompt_tokens == len(chat_entries)


def test_streamed_echo_logprobs_equal_the_non_streamed(invariant_server) -> None:
    sdk = client(invariant_server)
    body = {"model": MODEL, "prompt": ["Hello there", "One two three"], "echo": True}
    body.update(logprobs=2, max_tokens=3, temperature=0)
    whole = sdk.completions.create(**body)
    chunks = list(sdk.completions.create(**body, stream=True))
    for choice in whole.choices:
        parts = [c for chunk in chunks for c in chunk.choices if c.index == choice.index]
        assert "".join(p.text for p in parts) == choice.text
        streamed = [t for p in parts for t in p.logprobs.token_logprobs]
        assert streamed[0] is None and choice.logprobs.token_logprobs[0] is None
        assert streamed[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=TOL)
        assert [t for p in parts for t in p.logprobs.tokens] == choice.logprobs.tokens
