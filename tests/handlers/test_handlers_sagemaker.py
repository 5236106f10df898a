"""SageMaker's session protocol, JSON Lines and /execution-parameters through the
production app over the scripted engine (the real-server versions are in
tests/e2e/test_sagemaker_sessions_batch.py)."""

from __future__ import annotations

import json
import re

import falcon.testing
import pytest
from fake_engine import FakeEngine
from handlers_testing import assert_openai_error

SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_ID = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_ID = "X-Amzn-SageMaker-Closed-Session-Id"
ADAPTER = "X-Amzn-SageMaker-Adapter-Identifier"
PROMPT = {"prompt": "Hello there", "max_tokens": 3}


@pytest.fixture
def sessions(make_client) -> falcon.testing.TestClient:
    return make_client(enable_stateful_sessions=True, session_ttl=60.0)


def _open(client: falcon.testing.TestClient) -> str:
    result = client.simulate_post("/invocations", json={"requestType": "NEW_SESSION"})
    assert result.status_code == 200, result.text
    match = re.fullmatch(
        r"(\S+); Expires=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)", result.headers[NEW_ID]
    )
    assert match, result.headers[NEW_ID]
    assert result.text == f"Session {match[1]} created"
    assert int(result.headers["content-length"]) == len(result.content)
    return match[1]


def test_a_session_is_opened_used_and_closed(sessions, engine: FakeEngine) -> None:
    session_id = _open(sessions)
    used = sessions.simulate_post("/invocations", json=PROMPT, headers={SESSION: session_id})
    assert used.status_code == 200, used.text
    assert engine.added[-1].session_id == session_id  # the engine was told
    closed = sessions.simulate_post(
        "/invocations", json={"requestType": "CLOSE"}, headers={SESSION: session_id}
    )
    assert closed.status_code == 200 and closed.headers[CLOSED_ID] == session_id
    after = sessions.simulate_post("/invocations", json=PROMPT, headers={SESSION: session_id})
    assert_openai_error(after, 400)
    assert session_id not in engine.sessions


def test_the_new_session_header_runs_the_request_in_a_new_session(sessions, engine) -> None:
    result = sessions.simulate_post("/invocations", json=PROMPT, headers={SESSION: "NEW_SESSION"})
    assert result.status_code == 200, result.text
    assert result.json["object"] == "text_completion"
    session_id = result.headers[NEW_ID].split(";")[0]
    assert engine.added[-1].session_id == session_id in engine.sessions


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({"requestType": "CLOSE"}, {}, SESSION),
        ({"requestType": "CLOSE"}, {SESSION: "never-opened"}, SESSION),
        ({"requestType": "RESUME"}, {}, "requestType"),
        ({"requestType": "CLOSE"}, {SESSION: "NEW_SESSION"}, SESSION),
        ({"requestType": "NEW_SESSION"}, {SESSION: "session0-" + "x" * 24}, SESSION),
        ({**PROMPT, "stream": True}, {SESSION: "NEW_SESSION"}, SESSION),
    ],
    ids=["close-unnamed", "close-unknown", "bad-type", "close-new", "new-in-one", "new-streamed"],
)
def test_bad_session_requests_are_400s(sessions, engine, body, headers, param) -> None:
    result = sessions.simulate_post("/invocations", json=body, headers=headers)
    assert_openai_error(result, 400)
    assert result.json["error"]["param"] == param
    assert engine.added == [] and engine.sessions == set()
    assert NEW_ID not in result.headers


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "max_tokens": -1},
        {"messages": [{"role": "tool", "content": "x"}], "max_tokens": 2, "n": 0},
        {"task": "embeddings", "input": []},
    ],
    ids=["completion", "chat", "embeddings"],
)
def test_a_refused_first_turn_leaves_no_session_open(sessions, engine, body) -> None:
    """The NEW_SESSION header on a body that is then refused: a 400 without the new id, and
    the session it had opened is closed (else it would hold a slot of the table, unknown to
    anyone, until it expired)."""
    result = sessions.simulate_post("/invocations", json=body, headers={SESSION: "NEW_SESSION"})
    assert_openai_error(result, 400)
    assert NEW_ID not in result.headers
    assert engine.sessions == set()


def test_session_headers_without_sessions_enabled_are_400s(client, engine) -> None:
    for body, headers in (
        ({"requestType": "NEW_SESSION"}, {}),
        (PROMPT, {SESSION: "whatever"}),
    ):
        result = client.simulate_post("/invocations", json=body, headers=headers)
        assert_openai_error(result, 400)
        assert "not enabled" in result.json["error"]["message"]
    assert engine.added == []


def test_a_session_on_an_adapter_runs_the_adapter_in_the_session(make_client, engine) -> None:
    client = make_client(enable_stateful_sessions=True, session_ttl=60.0, enable_lora=True)
    session_id = _open(client)
    result = client.simulate_post(
        "/invocations", json=PROMPT, headers={SESSION: session_id, ADAPTER: "sql"}
    )
    assert result.status_code == 200, result.text
    assert result.json["model"] == "sql"
    assert (engine.added[-1].session_id, engine.added[-1].lora_name) == (session_id, "sql")


def test_an_embedding_in_a_session_is_checked_against_it(sessions, engine: FakeEngine) -> None:
    """Embeddings name their session to the engine, which checks it (an unknown one is a
    400, as for a generation: docs/api.md) and pins nothing for them
    (tests/engine/test_embeddings.py); a NEW_SESSION header still opens a session."""
    body = {"task": "embeddings", "input": "Hello there"}
    guessed = sessions.simulate_post("/invocations", json=body, headers={SESSION: "never-opened"})
    assert_openai_error(guessed, 400)
    assert "session" in guessed.json["error"]["message"].lower()
    session_id = _open(sessions)
    result = sessions.simulate_post("/invocations", json=body, headers={SESSION: session_id})
    assert result.status_code == 200, result.text
    assert result.json["object"] == "list"
    assert engine.added[-1].pooling is not None and engine.added[-1].session_id == session_id
    opened = sessions.simulate_post("/invocations", json=body, headers={SESSION: "NEW_SESSION"})
    assert opened.status_code == 200, opened.text
    assert opened.headers[NEW_ID].split(";")[0] in engine.sessions


def test_json_lines_records_run_on_the_adapter_header(make_client, engine) -> None:
    client = make_client(enable_lora=True)
    lines = [json.dumps({"prompt": p, "max_tokens": 2}) for p in ("first", "second")]
    result = client.simulate_post(
        "/invocations",
        body="\n".join(lines).encode(),
        headers={"Content-Type": "application/jsonlines", ADAPTER: "sql"},
    )
    assert result.status_code == 200, result.text
    assert [json.loads(line)["model"] for line in result.text.splitlines()] == ["sql", "sql"]
    assert [added.lora_name for added in engine.added] == ["sql", "sql"]


def test_json_lines_answer_each_record_in_order(client, engine: FakeEngine) -> None:
    lines = [
        json.dumps({"prompt": "first", "max_tokens": 2}),
        "",
        "[1, 2",
        json.dumps({"messages": [{"role": "user", "content": "second"}], "max_tokens": 2}),
        json.dumps({"prompt": "third", "max_tokens": 0.5}),
        json.dumps({"nothing": True}),
    ]
    result = client.simulate_post(
        "/invocations",
        body="\n".join(lines).encode(),
        headers={"Content-Type": "application/jsonlines"},
    )
    assert result.status_code == 200, result.text
    assert result.headers["content-type"] == "application/jsonlines"
    answers = [json.loads(line) for line in result.text.splitlines()]
    assert [a.get("object") or a["error"]["code"] for a in answers] == [
        "text_completion", 400, "chat.completion", 400, 400,
    ]  # fmt: skip
    assert answers[3]["error"]["param"] == "max_tokens"
    assert len(engine.added) == 2  # only the good records reached the engine
    assert engine.live == set()


def test_json_lines_carry_the_pooling_kinds(client, engine: FakeEngine) -> None:
    """A batch transform of embeddings, rerank, score and Cohere embed records: each
    answered in its own API's shape, in order, a bad one as its error body."""
    lines = [
        json.dumps({"task": "embeddings", "input": "a text"}),
        json.dumps({"query": "which?", "documents": ["one", "two"]}),
        json.dumps({"text_1": "a", "text_2": ["b", "c"]}),
        json.dumps({"texts": ["x"], "input_type": "search_document"}),
        json.dumps({"query": "which?", "documents": []}),
    ]
    result = client.simulate_post(
        "/invocations",
        body="\n".join(lines).encode(),
        headers={"Content-Type": "application/jsonlines"},
    )
    assert result.status_code == 200, result.text
    answers = [json.loads(line) for line in result.text.splitlines()]
    assert answers[0]["object"] == "list" and answers[0]["data"][0]["object"] == "embedding"
    assert [r["index"] for r in answers[1]["results"]] in ([0, 1], [1, 0])
    assert [d["object"] for d in answers[2]["data"]] == ["score", "score"]
    assert answers[3]["response_type"] == "embeddings_by_type"
    assert answers[4]["error"]["param"] == "documents"
    assert engine.live == set()


def test_json_lines_without_records_is_a_400(client) -> None:
    result = client.simulate_post(
        "/invocations", body=b"\n \n", headers={"Content-Type": "application/x-jsonlines"}
    )
    assert_openai_error(result, 400)


def test_execution_parameters(make_client, engine: FakeEngine) -> None:
    engine.info.max_num_seqs = 48
    client = make_client(max_request_body_bytes=20 << 20)
    result = client.simulate_get("/execution-parameters")
    assert result.json == {
        "MaxConcurrentTransforms": 48,
        "BatchStrategy": "MULTI_RECORD",
        "MaxPayloadInMB": 20,
    }
    engine.ready = False
    assert_openai_error(client.simulate_get("/execution-parameters"), 503)
