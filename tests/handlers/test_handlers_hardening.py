"""Issue 8 (hardening) on the handler side: per-request caps (items 1, 6), token-id
prompts of any length (7), chat templates that cannot take a worker down (8), and the
smaller holes of item 9 (TGI fields, log lines). Production app, scripted engine."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest
from handlers_testing import assert_openai_error

from engine.tokenizer import ChatTemplateError, Tokenizer
from handlers.protocol.completion import CompletionRequest
from handlers.serving.stats import NullStatsSink, RequestTracker, loggable

USER = [{"role": "user", "content": "Hello"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


# -- item 1: prompts x n --------------------------------------------------------------
def test_prompts_times_n_is_capped_with_a_400(client, engine) -> None:
    """256 prompts x n=16 was 4096 engine requests in one tick; the cap is a clear 400."""
    body = {"prompt": ["hi"] * 256, "n": 16, "max_tokens": 1}
    result = client.simulate_post(COMPLETIONS, json=body)
    error = assert_openai_error(result, 400, "n")
    assert "4096" in error["message"] and "1024" in error["message"]
    assert engine.added == []
    ok = client.simulate_post(COMPLETIONS, json={**body, "n": 4})  # exactly the cap
    assert ok.status_code == 200, ok.text
    assert len(engine.added) == 1024 and engine.live == set()


# -- item 6: caps on per-request lists -----------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop_token_ids", list(range(1025))),
        ("logit_bias", {str(t): 1.0 for t in range(1025)}),
    ],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_per_request_lists_are_capped(client, engine, path: str, field: str, value: Any) -> None:
    """Scanned or rebuilt every step, these had no size limit (a full-vocabulary
    logit_bias cost ~5 ms per request per step)."""
    body = {"messages": USER} if path == CHAT else {"prompt": "hi"}
    result = client.simulate_post(path, json={**body, field: value})
    error = assert_openai_error(result, 400, field)
    assert "1024" in error["message"]
    assert engine.added == []


# -- item 7: one long token-id prompt ----------------------------------------------------
def test_a_token_id_prompt_longer_than_the_prompt_count_cap_is_one_prompt() -> None:
    """A single prompt of 300 token ids was refused with "at most 256 prompts": the
    count cap ran before telling token ids from a list of prompts."""
    request = CompletionRequest.model_validate({"prompt": list(range(1, 301))})
    assert request.prompts() == [list(range(1, 301))]


def test_a_long_token_id_prompt_is_served(client, engine, model_info) -> None:
    engine.info = msgspec.structs.replace(model_info, max_model_len=2048)
    ids = [5] * 1000
    result = client.simulate_post(COMPLETIONS, json={"prompt": ids, "max_tokens": 1})
    assert result.status_code == 200, result.text
    assert engine.added[0].prompt_token_ids == ids


# -- item 8: request chat templates ------------------------------------------------------
HOSTILE_TEMPLATES = {
    "huge-repeat": "{{ 'x' * 100000000 }}",
    "huge-power": "{% set n = 10 ** 2000000 %}ok",
    "huge-output": "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
    "long-loop": "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}"
    "{% endfor %}{% endfor %}",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_hostile_templates_fail_cleanly(tokenizer: Tokenizer, name: str) -> None:
    """A template could build a 10 GB string, a huge number, or loop for hours on the
    worker. Size and time limits now end each with a template error (a 400)."""
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template(USER, chat_template=HOSTILE_TEMPLATES[name])


@pytest.mark.timeout(60)
def test_a_looping_request_template_is_a_400(make_client, engine) -> None:
    client = make_client(trust_request_chat_template=True)
    body = {"messages": USER, "chat_template": HOSTILE_TEMPLATES["long-loop"]}
    assert_openai_error(client.simulate_post(CHAT, json=body), 400, "messages")
    assert engine.added == []
    assert client.simulate_post(CHAT, json={"messages": USER}).status_code == 200


def test_ordinary_templates_still_render(tokenizer: Tokenizer) -> None:
    template = "{% for m in messages %}{{ m['role'] * 2 }}:{{ m['content'] + '!' }}{% endfor %}"
    assert tokenizer.apply_chat_template(USER, chat_template=template) == "useruser:Hello!"


# -- item 9: TGI fields, log lines ---------------------------------------------------------
@pytest.mark.parametrize(
    ("parameters", "stream", "param"),
    [
        ({"top_n_tokens": 21}, False, "parameters.top_n_tokens"),
        (
            {"details": True, "decoder_input_details": True},
            True,
            "parameters.decoder_input_details",
        ),
    ],
)
def test_tgi_details_beyond_what_can_be_given_are_a_400(
    client, engine, parameters: dict, stream: bool, param: str
) -> None:
    """TGI's top_n_tokens past the logprob cap, and prompt details on a stream (TGI
    refuses them too); both were silently ignored once, then refused outright."""
    body = {"inputs": "Say hi", "stream": stream, "parameters": {"max_new_tokens": 2, **parameters}}
    assert_openai_error(client.simulate_post("/invocations", json=body), 400, param)
    assert engine.added == []


def test_client_ids_are_escaped_in_log_lines(caplog) -> None:
    """The body's request_id reached the log unsanitized: a newline forged a log line."""
    assert loggable("abc-123") == "abc-123"
    assert loggable("x\nrequest forged: status=ok") == "x\\nrequest forged: status=ok"
    assert loggable("\x1b[31mred") == "\\x1b[31mred"
    assert len(loggable("z" * 5000)) < 400
    tracker = RequestTracker(NullStatsSink(), "cmpl-a\nb", "chat", 0.0)
    with caplog.at_level(logging.INFO, logger="handlers.requests"):
        tracker.finish(
            "ok", num_prompt_tokens=1, num_output_tokens=1, num_cached_tokens=0, finish_reasons=[]
        )
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert messages[0].startswith("request cmpl-a\\nb chat: status=ok")


@pytest.mark.parametrize("disabled", [False, True])
def test_disable_log_requests_drops_the_per_request_line(make_client, caplog, disabled) -> None:
    """--disable-log-requests was accepted and ignored."""
    client = make_client(disable_log_requests=disabled)
    with caplog.at_level(logging.INFO):
        assert client.simulate_post(CHAT, json={"messages": USER}).status_code == 200
    lines = [r for r in caplog.records if r.name == "handlers.requests"]
    assert len(lines) == (0 if disabled else 1)
