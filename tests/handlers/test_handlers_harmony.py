"""gpt-oss's harmony channels: the parser on real token streams, and chat answers through
the app (reasoning_content, content, tool calls; streamed equal to non-streamed).

The tokenizer is the handler tests' tiny BPE with harmony's special tokens added (as
gpt-oss's own tokenizer has them: one id each, dropped by skip_special_tokens), so the
text the parser sees is what the incremental detokenizer releases token by token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from fake_engine import FakeEngine, Script
from handlers_testing import (
    CHAT_TEMPLATE,
    MAX_MODEL_LEN,
    build_tiny_model,
    call_asgi,
    connected_client,
    encode,
)
from tokenizers import AddedToken
from tokenizers import Tokenizer as RawTokenizer

from engine.config import ModelInfo
from engine.tokenizer import Tokenizer
from handlers.config import ServerConfig
from handlers.http.app import create_app
from handlers.serving.harmony import HarmonyStreamer, parse_harmony, uses_harmony
from handlers.serving.stats import NullStatsSink

HARMONY_TOKENS = [
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
    "<|call|>",
]  # fmt: skip

REASONING = "The user wants the weather. I should call get_weather."
ANSWER = "It is sunny in Paris, 24 degrees."
ARGS = '{"city": "Paris", "unit": "celsius"}'
THINK_THEN_ANSWER = (
    f"<|channel|>analysis<|message|>{REASONING}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}"
)
THINK_THEN_CALL = (
    f"<|channel|>analysis<|message|>{REASONING}<|end|>"
    f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    f"<|message|>{ARGS}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = build_tiny_model(tmp_path_factory.mktemp("harmony-model"))
    raw = RawTokenizer.from_file(str(directory / "tokenizer.json"))
    raw.add_special_tokens([AddedToken(t, special=True) for t in HARMONY_TOKENS])
    raw.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def harmony_tokenizer(harmony_dir: Path) -> Tokenizer:
    return Tokenizer(harmony_dir)


def _pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    """The text as the incremental detokenizer releases it, one token at a time, with
    the special tokens kept (what ServingChat does for harmony outputs)."""
    ids = encode(tokenizer, text)
    assert all(tokenizer.token_to_id(t) in ids for t in HARMONY_TOKENS if t in text)
    detok = tokenizer.incremental_detokenizer(skip_special_tokens=False)
    return [detok.step(i) for i in ids]


def _stream(pieces: list[str], tools: set[str] | None) -> tuple[str, str, list[tuple[str, str]]]:
    streamer = HarmonyStreamer(tools)
    reasoning, content, calls = "", "", {}
    for fields in [*(streamer.feed(p) for p in pieces), streamer.finish()]:
        reasoning += fields[0]
        content += fields[1]
        for d in fields[2]:
            call = calls.setdefault(d.index, ["", ""])
            if d.id is not None:
                assert d.function.name and d.function.arguments == ""
                call[0] = d.function.name
            call[1] += d.function.arguments or ""
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)]


def test_the_special_tokens_are_single_ids_dropped_by_default(harmony_tokenizer) -> None:
    ids = encode(harmony_tokenizer, THINK_THEN_CALL)
    for token in ("<|channel|>", "<|message|>", "<|constrain|>", "<|start|>", "<|end|>"):
        assert ids.count(harmony_tokenizer.token_to_id(token)) >= 1
    assert "<|channel|>" not in harmony_tokenizer.decode(ids)  # why the parser keeps them
    assert harmony_tokenizer.decode(ids, skip_special_tokens=False) == THINK_THEN_CALL


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (THINK_THEN_ANSWER, (REASONING, ANSWER, [])),
        (THINK_THEN_ANSWER + "<|return|>", (REASONING, ANSWER, [])),
        (THINK_THEN_CALL, (REASONING, None, [("get_weather", ARGS)])),
        (THINK_THEN_CALL + "<|call|>", (REASONING, None, [("get_weather", ARGS)])),
        # The recipient before the channel (harmony allows both orders).
        (
            f"<|start|>assistant to=functions.get_weather<|channel|>commentary json"
            f"<|message|>{ARGS}<|call|>",
            (None, None, [("get_weather", ARGS)]),
        ),
        # A preamble on commentary (no recipient) is content; cut off mid-reasoning.
        (
            f"<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant"
            f"<|channel|>final<|message|>{ANSWER}",
            (None, "Let me check." + ANSWER, []),
        ),
        (f"<|channel|>analysis<|message|>{REASONING[:20]}", (REASONING[:20], None, [])),
        # Not harmony at all: content, unchanged.
        (ANSWER, (None, ANSWER, [])),
        # A built-in tool hearth does not run: visible as reasoning, never a call.
        (
            '<|channel|>analysis to=browser.search<|message|>{"query": "x"}<|call|>',
            ('{"query": "x"}', None, []),
        ),
    ],
    ids=[
        "answer",
        "answer-return",
        "call",
        "call-call",
        "recipient-first",
        "preamble",
        "cut-off",
        "plain",
        "builtin",
    ],
)
def test_parse_and_stream_agree_on_real_token_streams(harmony_tokenizer, text, want) -> None:
    """Non-streamed, streamed token by token, and streamed in random cuts of the same
    text (special tokens split across deltas): one answer."""
    tools = {"get_weather"}
    parsed = parse_harmony(text, tools)
    got = (parsed.reasoning, parsed.content, [(c.name, c.arguments) for c in parsed.calls])
    assert got == want
    expected = (want[0] or "", want[1] or "", want[2])
    assert _stream(_pieces(harmony_tokenizer, text), tools) == expected
    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(6, len(text) - 1)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _stream(chunks, tools) == expected, chunks
    assert _stream(list(text), tools) == expected  # one character per delta


def test_a_call_to_a_tool_not_offered_stays_content() -> None:
    parsed = parse_harmony(THINK_THEN_CALL, {"get_time"})
    assert (parsed.reasoning, parsed.content, parsed.calls) == (REASONING, ARGS, [])
    assert parse_harmony(THINK_THEN_CALL, None).calls == []


def test_uses_harmony_by_flag_architecture_or_template() -> None:
    assert uses_harmony(None, None, "GptOssForCausalLM")
    assert uses_harmony(None, "{{ '<|channel|>final<|message|>' }}", "LlamaForCausalLM")
    assert not uses_harmony(None, CHAT_TEMPLATE, "LlamaForCausalLM")
    assert uses_harmony("harmony", CHAT_TEMPLATE, "LlamaForCausalLM")
    assert not uses_harmony("none", None, "GptOssForCausalLM")
    assert not uses_harmony("think", None, "GptOssForCausalLM")


# ------------------------------------------------------------------------------------
# through the app: a gpt-oss model (by its architecture) on a scripted engine
# ------------------------------------------------------------------------------------


@pytest.fixture
def engine(harmony_tokenizer: Tokenizer, harmony_dir: Path) -> FakeEngine:
    eos = [harmony_tokenizer.token_to_id("<|return|>"), harmony_tokenizer.token_to_id("<|call|>")]
    info = ModelInfo(
        model_dir=str(harmony_dir), max_model_len=4 * MAX_MODEL_LEN,
        vocab_size=harmony_tokenizer.vocab_size, eos_token_ids=eos, num_kv_blocks=256,
        block_size=16, architecture="GptOssForCausalLM",
    )  # fmt: skip
    return FakeEngine(info=info)


@pytest.fixture
def app(harmony_dir: Path, harmony_tokenizer: Tokenizer, engine: FakeEngine):
    config = ServerConfig(model_dir=str(harmony_dir), served_model_names=("gpt-oss",))
    return connected_client(
        create_app(config, engine, harmony_tokenizer, stats=NullStatsSink())
    ).app


def _script(engine: FakeEngine, tokenizer: Tokenizer, text: str, stop: str) -> None:
    engine.script = Script(token_ids=[*encode(tokenizer, text), tokenizer.token_to_id(stop)])


def _rebuild(events: list) -> tuple[str, str, list[tuple[str, str]], str | None]:
    reasoning, content, calls, finish = "", "", {}, None
    for event in events:
        if not isinstance(event, dict) or not event.get("choices"):
            continue
        choice = event["choices"][0]
        delta = choice["delta"]
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        for d in delta.get("tool_calls") or []:
            call = calls.setdefault(d["index"], ["", ""])
            if d.get("id"):
                call[0] = d["function"]["name"]
            call[1] += d["function"].get("arguments") or ""
        finish = choice.get("finish_reason") or finish
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_chat_answer_splits_reasoning_from_content(app, engine, harmony_tokenizer, stream):
    _script(engine, harmony_tokenizer, THINK_THEN_ANSWER, "<|return|>")
    result = await call_asgi(app, CHAT, {"messages": MESSAGES, "stream": stream})
    assert result.status == 200, result.body
    if stream:
        reasoning, content, calls, finish = _rebuild(result.events)
    else:
        choice = result.json["choices"][0]
        message = choice["message"]
        reasoning, content, finish = message["reasoning_content"], message["content"], None
        calls = message.get("tool_calls") or []
        finish = choice["finish_reason"]
    assert (reasoning, content, calls, finish) == (REASONING, ANSWER, [], "stop")


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_chat_tool_call_from_the_commentary_channel(app, engine, harmony_tokenizer, stream):
    _script(engine, harmony_tokenizer, THINK_THEN_CALL, "<|call|>")
    body = {"messages": MESSAGES, "tools": [WEATHER], "stream": stream}
    result = await call_asgi(app, CHAT, body)
    assert result.status == 200, result.body
    if stream:
        reasoning, content, calls, finish = _rebuild(result.events)
        assert content == ""
    else:
        choice = result.json["choices"][0]
        message = choice["message"]
        reasoning, finish = message["reasoning_content"], choice["finish_reason"]
        assert message["content"] is None
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        assert message["tool_calls"][0]["id"].startswith("call_")
    assert reasoning == REASONING and finish == "tool_calls"
    assert [(name, json.loads(args)) for name, args in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]


@pytest.mark.anyio
async def test_chat_render_keeps_the_channel_tokens_through_generate(
    app, engine, harmony_tokenizer
):
    """The chat route keeps harmony's special tokens (its parser reads the channels); the
    render says so, so `/inference/v1/generate` in text mode gives them back too."""
    rendered = await call_asgi(app, "/v1/chat/completions/render", {"messages": MESSAGES})
    assert rendered.status == 200, rendered.body
    assert rendered.json["sampling_params"]["skip_special_tokens"] is False
    _script(engine, harmony_tokenizer, THINK_THEN_ANSWER, "<|return|>")
    body = {**rendered.json, "output_mode": "text"}
    generated = await call_asgi(app, "/inference/v1/generate", body)
    assert generated.status == 200, generated.body
    assert generated.json["choices"][0]["text"].startswith("<|channel|>analysis<|message|>")


@pytest.mark.anyio
@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
async def test_thinking_budget_caps_the_analysis_channel(app, engine, harmony_tokenizer, path):
    """On a harmony model thinking_token_budget is no 400: the block is the analysis
    message, and what the engine forces at the budget is its end plus the final answer's
    header, so the model answers instead of opening another analysis message."""
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    result = await call_asgi(app, path, {**base, "thinking_token_budget": 6})
    assert result.status == 200, result.body
    spec = engine.added[-1].params.thinking
    ids = harmony_tokenizer.token_to_id
    assert spec is not None and spec.budget == 6
    assert spec.start_ids == [
        ids("<|channel|>"),
        *encode(harmony_tokenizer, "analysis"),
        ids("<|message|>"),
    ]
    assert spec.end_ids == [ids("<|end|>")]
    final = [ids("<|channel|>"), *encode(harmony_tokenizer, "final"), ids("<|message|>")]
    assert spec.forced_ids == [
        ids("<|end|>"), ids("<|start|>"), *encode(harmony_tokenizer, "assistant"), *final
    ]  # fmt: skip
