"""thinking_token_budget through a real `hearth serve --reasoning-parser think` (a tiny
random-weight Qwen3): a completion whose prompt opens a `<think>` block gets the
closing tag forced after exactly `budget` tokens (seen through return_token_ids), the
same request without a budget runs on freely, and the tokens before the cut are the
free run's (forcing changes nothing before it). The same under `--reasoning-parser
harmony`, where the block is the analysis message and the forced ids run on into the
final answer's header.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer
from tests.e2e.clients import client
from tests.e2e.server import Server, start_server
from tests.engine.tiny_models import save_servable_tiny

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _serve(
    tmp_path_factory: pytest.TempPathFactory, directory: Path, parser: str
) -> Iterator[tuple[Path, Server]]:
    """`hearth serve` of the tiny model in `directory` with `--reasoning-parser parser`."""
    server = start_server(
        tmp_path_factory.mktemp(f"{parser}-logs"), str(directory), "--served-model-name", "tiny",
        "--max-model-len", "128", "--reasoning-parser", parser,
    )  # fmt: skip
    yield directory, server
    server.stop()


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Server]]:
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    save_servable_tiny("qwen3", directory)
    yield from _serve(tmp_path_factory, directory, "think")


def _greedy_ids(server: Server, prompt: list[int], max_tokens: int, **extra) -> list[int]:
    """The token ids of a greedy completion of `prompt` (EOS ignored), through the SDK."""
    out = client(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
    )  # fmt: skip
    return (out.choices[0].model_extra or {})["token_ids"]


def test_the_block_is_closed_at_the_budget(reasoning_server) -> None:
    directory, server = reasoning_server
    tokenizer = Tokenizer(directory)
    prompt = tokenizer.encode("Question: is it safe? <think>", add_special_tokens=False)
    end_ids = tokenizer.encode("</think>", add_special_tokens=False)
    free = _greedy_ids(server, prompt, 12)
    assert free[3 : 3 + len(end_ids)] != end_ids
    budget = 3
    capped = _greedy_ids(server, prompt, 12, thinking_token_budget=budget)
    print(f"\nfree {free}\ncapped {capped}")
    assert capped[:budget] == free[:budget]
    assert capped[budget : budget + len(end_ids)] == end_ids
    assert _greedy_ids(server, prompt, 12, thinking_token_budget=-1) == free


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Server]]:
    """The same tiny Qwen3 with harmony's special tokens in its tokenizer, served as a
    harmony model (`--reasoning-parser harmony`)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RawTokenizer

    from handlers.serving.harmony import CALL, CHANNEL, END, MESSAGE, RETURN, START

    directory = tmp_path_factory.mktemp("tiny-harmony")
    save_servable_tiny("qwen3", directory)
    raw = RawTokenizer.from_file(str(directory / "tokenizer.json"))
    specials = [START, END, MESSAGE, CHANNEL, CALL, RETURN, "<|constrain|>"]
    raw.add_special_tokens([AddedToken(t, special=True) for t in specials])
    raw.save(str(directory / "tokenizer.json"))
    yield from _serve(tmp_path_factory, directory, "harmony")


def test_the_analysis_channel_is_closed_and_the_final_answer_opened(harmony_server) -> None:
    """A completion whose prompt opens harmony's analysis message: at the budget the
    message's end and the final channel's header are forced, then sampling goes on."""
    directory, server = harmony_server
    tokenizer = Tokenizer(directory)
    prompt = tokenizer.encode(
        "Question: is it safe?<|start|>assistant<|channel|>analysis<|message|>",
        add_special_tokens=False,
    )
    forced = tokenizer.encode(
        "<|end|><|start|>assistant<|channel|>final<|message|>", add_special_tokens=False
    )
    assert forced[0] == tokenizer.token_to_id("<|end|>")
    free = _greedy_ids(server, prompt, 14)
    budget = 3
    assert free[budget : budget + len(forced)] != forced
    capped = _greedy_ids(server, prompt, 14, thinking_token_budget=budget)
    print(f"\nfree {free}\ncapped {capped}")
    assert capped[:budget] == free[:budget]
    assert capped[budget : budget + len(forced)] == forced
    assert len(capped) == 14  # sampling went on after the header
