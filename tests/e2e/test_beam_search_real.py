"""vLLM's `use_beam_search` through a real `hearth serve` (a tiny random-weight Llama,
float32): the `n` choices are the beams a reference search over transformers' own
log-probabilities finds (vLLM's algorithm: 2 x width candidates a beam and step, an EOS
candidate closes its beam, the width best others go on, the final ranking by cumulative
logprob over length ** length_penalty), in that order, for completions and chat, streamed
or not; what the search cannot honour is a 400 naming the field."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from engine.tokenizer import Tokenizer
from tests.e2e.clients import client
from tests.e2e.server import Server, start_server
from tests.engine.tiny_models import save_servable_tiny

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def beam_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[torch.nn.Module, Tokenizer, Server]]:
    directory = tmp_path_factory.mktemp("tiny-llama")
    hf = save_servable_tiny("llama-gqa-tied", directory).eval()
    server = start_server(
        tmp_path_factory.mktemp("beam-logs"), str(directory), "--served-model-name", "tiny",
        "--max-model-len", "128",
    )  # fmt: skip
    yield hf, Tokenizer(directory), server
    server.stop()


@torch.no_grad()
def reference_beams(
    hf: torch.nn.Module,
    prompt: list[int],
    width: int,
    max_tokens: int,
    eos_ids: set[int],
    length_penalty: float = 1.0,
) -> list[list[int]]:
    """vLLM's `beam_search` over transformers' logprobs: the generated tokens of the
    `width` best beams, best first."""

    def score(tokens: list[int], cum: float, ended: bool) -> float:
        return cum / (max(len(tokens) - ended, 1) ** length_penalty)

    open_beams: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    closed: list[tuple[list[int], float, bool]] = []
    for _ in range(max_tokens):
        if not open_beams:
            break
        candidates = []
        for tokens, cum in open_beams:
            logits = hf(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, dim=-1).topk(2 * width)
            for lp, tid in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                if tid in eos_ids:
                    closed.append(([*tokens, tid], cum + lp, True))
                else:
                    candidates.append(([*tokens, tid], cum + lp))
        candidates.sort(key=lambda c: -c[1])
        open_beams = candidates[:width]
    final = closed + [(t, c, False) for t, c in open_beams]
    final.sort(key=lambda b: score(*b), reverse=True)
    return [tokens[len(prompt) :] for tokens, _, _ in final[:width]]


def _completion(server: Server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.v1}/completions", json={"model": "tiny", **body}, timeout=120)


def test_completion_choices_are_the_reference_beams(beam_server) -> None:
    hf, tokenizer, server = beam_server
    prompt = tokenizer.encode("The weather in the north is", add_special_tokens=False)
    eos = set(tokenizer.eos_token_ids)
    for width, penalty in ((1, 1.0), (3, 1.0), (4, 0.5)):
        body = {
            "prompt": prompt, "n": width, "use_beam_search": True, "max_tokens": 6,
            "length_penalty": penalty, "return_token_ids": True,
        }  # fmt: skip
        result = _completion(server, body)
        assert result.status_code == 200, result.text
        got = [c["token_ids"] for c in sorted(result.json()["choices"], key=lambda c: c["index"])]
        assert got == reference_beams(hf, prompt, width, 6, eos, penalty), (width, penalty)
        usage = result.json()["usage"]
        assert usage["completion_tokens"] == sum(len(t) for t in got)
    # width 1 is greedy decoding
    greedy = _completion(server, {"prompt": prompt, "max_tokens": 6, "temperature": 0})
    beam = _completion(server, {"prompt": prompt, "max_tokens": 6, "use_beam_search": True})
    assert beam.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_chat_beams_through_the_sdk_streamed_and_not(beam_server) -> None:
    _, _, server = beam_server
    sdk = client(server)
    kwargs = {
        "model": "tiny", "messages": [{"role": "user", "content": "Name a color."}],
        "n": 3, "max_tokens": 5, "extra_body": {"use_beam_search": True},
    }  # fmt: skip
    answer = sdk.chat.completions.create(**kwargs)
    texts = [c.message.content for c in answer.choices]
    assert len(texts) == 3 and len(set(texts)) == 3, texts  # three different beams
    streamed = ["", "", ""]
    for chunk in sdk.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 11}, "n"),
        ({"stop": ["x"]}, "stop"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_what_the_search_cannot_honour_is_a_400(beam_server, extra: dict, param: str) -> None:
    _, _, server = beam_server
    body = {"prompt": "Hi", "max_tokens": 4, "use_beam_search": True, **extra}
    result = _completion(server, body)
    assert result.status_code == 400, result.text
    assert result.json()["error"]["param"] == param
    responses = httpx.post(
        f"{server.v1}/responses",
        json={"model": "tiny", "input": "Hi", "use_beam_search": True},
        timeout=60,
    )
    assert responses.status_code == 400 and responses.json()["error"]["param"] == "use_beam_search"


def test_a_client_that_leaves_mid_search_leaves_nothing_running(beam_server) -> None:
    """The search's step requests stop with the request: once a client gives up on a
    search (this one takes ~4 s whole here), no further step is sent (the prefix cache's
    lookups, which every step's prompt adds to, stand still), no request runs and no KV
    block is held."""
    from tests.e2e.clients import metric, wait_metric

    _, _, server = beam_server
    body = {"prompt": "Once", "n": 8, "use_beam_search": True, "max_tokens": 120}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.v1}/completions", json={"model": "tiny", **body}, timeout=0.5)
    time.sleep(0.5)  # a step already in flight finishes
    lookups = metric(server, "hearth:prefix_cache_queries_total")
    assert lookups > 0
    time.sleep(1.5)
    assert metric(server, "hearth:prefix_cache_queries_total") == lookups
    assert wait_metric(server, "hearth:num_requests_running", 0) == 0
    assert wait_metric(server, "hearth:kv_cache_used_blocks", 0) == 0
    after = _completion(server, {"prompt": "Hi", "max_tokens": 3, "use_beam_search": True})
    assert after.status_code == 200, after.text
