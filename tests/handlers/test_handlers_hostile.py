"""Issue 17 (hardening II) on the handler side: schemas given as text meet the same caps
as schemas given as objects (item 1), prompts too long to fit are refused before they are
tokenized (2), message and content-part counts are capped (3). Production app, scripted
engine; the engine-side compile queue is tested in tests/engine/test_structured_isolation.py."""

from __future__ import annotations

import json

import pytest
from handlers_testing import assert_openai_error

USER = [{"role": "user", "content": "Hello"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def nested_items(levels: int) -> str:
    """`levels` nested array schemas, as text (json.dumps would recurse)."""
    return '{"type":"array","items":' * levels + '{"type":"string"}' + "}" * levels


# -- item 1: schemas as text ----------------------------------------------------------
TEXT_SCHEMA_FIELDS = [
    (CHAT, lambda s: {"messages": USER, "guided_json": s}, "guided_json"),
    (COMPLETIONS, lambda s: {"prompt": "hi", "guided_json": s}, "guided_json"),
    (CHAT, lambda s: {"messages": USER, "structured_outputs": {"json": s}}, "structured_outputs"),
    (
        "/invocations",
        lambda s: {"inputs": "hi", "parameters": {"grammar": {"type": "json", "value": s}}},
        "parameters.grammar.value",
    ),
    (
        CHAT,
        lambda s: {
            "messages": USER,
            "structured_outputs": {
                "structural_tag": json.dumps(
                    {
                        "type": "structural_tag",
                        "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}],
                        "triggers": ["<a>"],
                    }
                ).replace("{}", s)
            },
        },
        "structured_outputs",
    ),
]


@pytest.mark.parametrize("levels", [900, 1500, 5000])
@pytest.mark.parametrize(("path", "body", "param"), TEXT_SCHEMA_FIELDS)
def test_a_deeply_nested_schema_as_text_is_a_400(client, engine, path, body, param, levels) -> None:
    """A schema inside a string skipped the body's 64-level cap: 900 nested `items` took
    xgrammar ~37 s to compile, and ~1,500 levels were a 500 (RecursionError)."""
    text = nested_items(levels)
    error = assert_openai_error(client.simulate_post(path, json=body(text)), 400)
    assert error["param"] is not None and error["param"].startswith(param.split(".")[0])
    assert "64 levels" in error["message"] or "larger than" in error["message"]
    assert engine.added == []


@pytest.mark.parametrize(("path", "body", "param"), TEXT_SCHEMA_FIELDS[:4])
def test_a_schema_as_text_within_the_caps_is_served(client, engine, path, body, param) -> None:
    result = client.simulate_post(path, json=body(nested_items(40)))
    assert result.status_code == 200, result.text
    assert engine.added[0].params.structured is not None


def test_a_schema_text_over_the_size_cap_is_refused_before_parsing(client, engine) -> None:
    text = " " * (64 * 1024) + "{}"
    error = assert_openai_error(
        client.simulate_post(CHAT, json={"messages": USER, "guided_json": text}), 400, "guided_json"
    )
    assert "larger than" in error["message"]


# -- item 2: prompts too long to fit, tokenizing off the event loop ----------------------
LONG_TEXT_ROUTES = [
    (COMPLETIONS, lambda t: {"prompt": t}, "prompt"),
    (COMPLETIONS, lambda t: {"prompt": ["hi", t]}, "prompt[1]"),
    (CHAT, lambda t: {"messages": [{"role": "user", "content": t}]}, "messages"),
    ("/invocations", lambda t: {"inputs": t}, "inputs"),
    ("/tokenize", lambda t: {"prompt": t}, "prompt"),
    ("/tokenize", lambda t: {"messages": [{"role": "user", "content": t}]}, "messages"),
]


@pytest.mark.parametrize(("path", "body", "param"), LONG_TEXT_ROUTES)
def test_a_text_too_long_to_fit_is_refused_before_it_is_tokenized(
    client, engine, tokenizer, monkeypatch, path, body, param
) -> None:
    """The "too long" 400 came only after the whole text was tokenized (a 6 MB prompt:
    ~5 s of one worker). No token stands for more than `max_token_bytes` characters,
    so a longer text than max_model_len times that is refused at once."""
    limit = engine.info.max_model_len * tokenizer.max_token_bytes
    seen: list[int] = []
    real = type(tokenizer).encode_releasing_gil

    def spy(self, text: str, add_special_tokens: bool = True) -> list[int]:
        seen.append(len(text))
        return real(self, text, add_special_tokens)

    monkeypatch.setattr(type(tokenizer), "encode_releasing_gil", spy)
    monkeypatch.setattr(type(tokenizer), "encode", spy)
    error = assert_openai_error(
        client.simulate_post(path, json=body("a" * (limit + 1))), 400, param
    )
    assert "maximum context length" in error["message"]
    assert all(n <= limit for n in seen), seen  # never tokenized
    assert engine.added == []


def test_long_texts_are_tokenized_on_a_thread_that_releases_the_gil(
    client, engine, tokenizer, monkeypatch
) -> None:
    """`asyncio.to_thread(tokenizer.encode)` did not help: `encode` holds the GIL, so
    the loop froze anyway; `encode_batch` releases it."""
    import threading

    main = threading.get_ident()
    calls: list[tuple[str, bool]] = []
    real = type(tokenizer).encode_releasing_gil

    def spy(self, text: str, add_special_tokens: bool = True) -> list[int]:
        calls.append(("releasing", threading.get_ident() != main))
        return real(self, text, add_special_tokens)

    monkeypatch.setattr(type(tokenizer), "encode_releasing_gil", spy)
    import msgspec

    engine.info = msgspec.structs.replace(engine.info, max_model_len=100_000)
    text = "word " * 8000  # 40,000 characters: over the threading threshold, still fits
    result = client.simulate_post("/tokenize", json={"prompt": text})
    assert result.status_code == 200, result.text
    assert calls == [("releasing", True)]
    assert result.json["tokens"] == tokenizer.encode(text)


@pytest.mark.parametrize("text", ["", "hello world", "héllo 🌍 " * 300, "<|im_start|>x\n" * 50])
def test_encoding_that_releases_the_gil_gives_the_same_ids(tokenizer, text: str) -> None:
    for special in (True, False):
        assert tokenizer.encode_releasing_gil(text, special) == tokenizer.encode(text, special)


# -- item 3: message and content-part counts ---------------------------------------------
@pytest.mark.parametrize("path", [CHAT, "/tokenize", "/invocations"])
def test_message_count_is_capped_before_validation(client, engine, path, monkeypatch) -> None:
    """200,000 messages (6 MB) cost ~1.1 s of validation and ~0.8 s of rendering on the
    event loop before the 4 M-character cap refused them."""
    from handlers.protocol import chat

    validated: list[int] = []
    real = chat.ChatMessageParam._check_role_fields

    def counting(self):
        validated.append(1)
        return real(self)

    monkeypatch.setattr(chat.ChatMessageParam, "_check_role_fields", counting)
    body = {"messages": [{"role": "user", "content": "x"}] * (chat.MAX_MESSAGES + 1)}
    error = assert_openai_error(client.simulate_post(path, json=body), 400, "messages")
    assert str(chat.MAX_MESSAGES) in error["message"]
    assert validated == []  # refused on the raw list
    assert engine.added == []
    ok = {"messages": [{"role": "user", "content": "x"}] * 8}
    assert client.simulate_post(path, json=ok).status_code == 200


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/tokenize", "/invocations"])
def test_a_body_of_millions_of_objects_is_refused_before_it_is_parsed(
    client, engine, path, monkeypatch
) -> None:
    """6 MB of 2,000,000 empty objects took ~0.23 s to parse and 2.0 s to walk for depth,
    all on the event loop: now the raw `{`/`[` count refuses it, and orjson never runs."""
    from handlers.http import media

    parsed: list[int] = []
    real = media.orjson.loads

    def counting(data):
        parsed.append(len(data))
        return real(data)

    monkeypatch.setattr(media.orjson, "loads", counting)
    body = b'{"messages":[' + b",".join([b"{}"] * 2_000_000) + b"]}"
    result = client.simulate_post(path, body=body, headers={"Content-Type": "application/json"})
    error = assert_openai_error(result, 400)
    assert str(media.MAX_BRACKET_BYTES) in error["message"]
    assert parsed == []
    assert engine.added == []


@pytest.mark.parametrize("shape", ["flat", "nested"])
def test_objects_past_the_cap_are_counted_exactly_after_the_parse(client, engine, shape) -> None:
    """Under the raw bracket cap but over the container cap: the walk counts them (and stops
    there) and the body is a 400 naming the cap, before any field is validated."""
    from handlers.http.media import MAX_JSON_CONTAINERS

    extra = MAX_JSON_CONTAINERS + 10
    filler = [[]] * extra if shape == "flat" else [[[]]] * (extra // 2)
    body = {"messages": USER, "metadata": {"filler": filler}}
    error = assert_openai_error(client.simulate_post(CHAT, json=body), 400)
    assert f"more than {MAX_JSON_CONTAINERS} JSON objects and arrays" in error["message"]
    assert engine.added == []


def test_brackets_inside_text_are_not_containers(client, engine) -> None:
    """The raw count is only an upper bound: 100,000 brackets inside a prompt pass the raw
    cap and are no containers, so the body goes on to its fields (here the context check
    of this 256-token test model, which names the prompt)."""
    from handlers.http.media import MAX_BRACKET_BYTES, MAX_JSON_CONTAINERS

    text = "{[" * 50_000
    assert MAX_JSON_CONTAINERS < text.count("{") + text.count("[") <= MAX_BRACKET_BYTES
    result = client.simulate_post("/tokenize", json={"prompt": text})
    error = assert_openai_error(result, 400, "prompt")
    assert "maximum context length" in error["message"]
    fits = client.simulate_post("/tokenize", json={"prompt": "{[" * 60})
    assert fits.status_code == 200, fits.text[:300]


@pytest.mark.parametrize("key", ["content", "tool_calls"])
def test_content_parts_are_capped_over_all_messages(client, engine, key) -> None:
    from handlers.protocol.chat import MAX_CONTENT_PARTS

    if key == "content":
        message = {"role": "user", "content": [{"type": "text", "text": "x"}] * 100}
    else:
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        message = {"role": "assistant", "content": None, "tool_calls": [call] * 100}
    count = MAX_CONTENT_PARTS // 100 + 1
    body = {"messages": [message] * count + USER}
    error = assert_openai_error(client.simulate_post(CHAT, json=body), 400, "messages")
    assert str(MAX_CONTENT_PARTS) in error["message"]
    assert engine.added == []


# -- item 7: loops whose body checks nothing ---------------------------------------------
LOOP_TEMPLATES = {
    "nested-literal": "{% set s = 'x' * 1000000 %}{% for a in s %}{% for b in s %}"
    "{% endfor %}{% endfor %}",
    "triple-list": "{% set l = [0] * 100000 %}{% for a in l %}{% for b in l %}{% for c in l %}"
    "{% endfor %}{% endfor %}{% endfor %}",
    "loop-var": "{% set s = 'y' * 1000000 %}{% for a in s %}{% for b in s %}{% if loop.last %}"
    "{% endif %}{% endfor %}{% endfor %}",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(LOOP_TEMPLATES))
def test_a_loop_over_a_literal_stops_at_the_render_limit(tokenizer, name: str) -> None:
    """The 2 s budget was checked on calls, lookups, arithmetic and output, not on loop
    iterations: 10^12 empty iterations would hold a thread and the GIL for hours. Without
    the per-iteration check this test runs into its pytest timeout."""
    from engine.tokenizer import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="longer than"):
        tokenizer.apply_chat_template(USER, chat_template=LOOP_TEMPLATES[name])


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{{ loop.index }}:{{ m.content }}{% endfor %}", "1:Hello"),
        ("{% for m in nothing %}x{% else %}empty{% endfor %}", "empty"),
        ("{% for k, v in {'a': 1}.items() %}{{ k }}{{ v }}{% endfor %}", "a1"),
        ("{% for m in messages if m.role == 'user' %}{{ m.role }}{% endfor %}", "user"),
        ("{% for m in messages recursive %}{{ m.role }}{% endfor %}", "user"),
        ("{% for m in messages %}{% if loop.first %}{{ loop.length }}{% endif %}{% endfor %}", "1"),
    ],
)
def test_loops_still_render(tokenizer, template: str, expected: str) -> None:
    assert tokenizer.apply_chat_template(USER, chat_template=template) == expected


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", lambda texts: {"input": texts}),
        ("/v1/completions", lambda texts: {"prompt": texts, "max_tokens": 1}),
        ("/score", lambda texts: {"text_1": texts[0], "text_2": texts[1:]}),
        ("/v2/embed", lambda texts: {"texts": texts}),
        (
            "/generative_scoring",
            lambda texts: {"query": "q", "items": texts, "label_token_ids": [1]},
        ),
        (
            "/v1/chat/completions/batch",
            lambda texts: {
                "messages": [[{"role": "user", "content": t}] for t in texts],
                "max_tokens": 1,
            },
        ),
    ],
)
def test_a_batch_long_in_all_is_tokenized_off_the_loop(
    client, engine, tokenizer, monkeypatch, path, body
) -> None:
    """Many texts, each under the threading threshold, long in all (190 of 32 KB held
    one worker's loop ~5 s): every one is tokenized on a thread that releases the GIL."""
    import threading

    import msgspec

    engine.info = msgspec.structs.replace(engine.info, max_model_len=100_000)
    main = threading.get_ident()
    off_loop: list[bool] = []
    real = type(tokenizer).encode_releasing_gil
    real_truncated = type(tokenizer).encode_truncated

    def spy(self, text: str, add_special_tokens: bool = True) -> list[int]:
        off_loop.append(threading.get_ident() != main)
        return real(self, text, add_special_tokens)

    def truncated(self, *args, **kwargs):  # the truncating path (Cohere's END)
        releases = kwargs.get("release_gil", args[4] if len(args) > 4 else False)
        off_loop.append(threading.get_ident() != main and releases)
        return real_truncated(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "encode_releasing_gil", spy)
    monkeypatch.setattr(type(tokenizer), "encode_truncated", truncated)
    texts = ["word " * 1600] * 6  # 8,000 characters each, 48,000 in all
    result = client.simulate_post(path, json=body(texts))
    assert result.status_code == 200, result.text
    assert len(off_loop) >= 5 and all(off_loop), off_loop
