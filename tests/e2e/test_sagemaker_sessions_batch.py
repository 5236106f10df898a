"""SageMaker-native serving on real servers: stateful sessions across two API workers,
`/execution-parameters`, JSON Lines batches, Content-Length on buffered answers, and the
request timeout that follows the SageMaker mode (realtime cuts, async completes).

The session tests pin raw HTTP connections to a chosen worker
(`tests/e2e/worker_connections.py`), so "worker B sees the session worker A opened" is
checked, not hoped for.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import Server, start_sagemaker_serve, start_server
from tests.e2e.worker_connections import WorkerConnection, worker_pids

pytestmark = pytest.mark.slow

SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_ID = "x-amzn-sagemaker-new-session-id"
CLOSED_ID = "x-amzn-sagemaker-closed-session-id"
TTL_S = 600
MAX_NUM_SEQS = 16
EXPIRES = re.compile(r"^([A-Za-z0-9_-]{32,}); Expires=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)$")


@pytest.fixture(scope="module")
def server(server_logs: Path, model_smollm2_dir: str) -> Iterator[Server]:
    """Two API workers, sessions on, cached-token counts reported."""
    server = start_server(
        server_logs,
        "--workers", "2",
        "--max-model-len", "1024",
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--enable-stateful-sessions",
        "--session-ttl", str(TTL_S),
        "--enable-prompt-tokens-details",
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def workers(server: Server) -> tuple[WorkerConnection, WorkerConnection]:
    pids = worker_pids(server)
    assert len(pids) == 2, pids
    return WorkerConnection(server, pids[0]), WorkerConnection(server, pids[1])


def _chat(turns: list[dict[str, str]]) -> dict[str, object]:
    return {"messages": turns, "max_tokens": 8, "temperature": 0}


def _new_session(conn: WorkerConnection) -> tuple[str, datetime]:
    answer = conn.request("POST", "/invocations", {"requestType": "NEW_SESSION"})
    assert answer.status == 200, answer.body
    match = EXPIRES.match(answer.headers[NEW_ID])
    assert match, answer.headers[NEW_ID]
    return match[1], datetime.strptime(match[2], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def test_session_opened_on_one_worker_is_used_and_closed_on_the_other(
    workers: tuple[WorkerConnection, WorkerConnection],
) -> None:
    a, b = workers
    assert a.pid != b.pid
    session_id, expires = _new_session(a)
    assert abs((expires - datetime.now(UTC)).total_seconds() - TTL_S) < 60

    turns = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    first = b.request("POST", "/invocations", _chat(turns), {SESSION: session_id})
    assert first.status == 200, first.body  # worker B knows A's session
    reply = first.json()["choices"][0]["message"]["content"]
    turns += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And two more?"}]
    second = a.request("POST", "/invocations", _chat(turns), {SESSION: session_id})
    assert second.status == 200, second.body
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16  # the first turn's prefix blocks were still warm

    closed = b.request("POST", "/invocations", {"requestType": "CLOSE"}, {SESSION: session_id})
    assert closed.status == 200, closed.body
    assert closed.headers[CLOSED_ID] == session_id

    after = a.request("POST", "/invocations", _chat(turns), {SESSION: session_id})
    assert after.status == 400, after.body  # A sees B's close
    assert after.json()["error"]["code"] == 400
    again = a.request("POST", "/invocations", {"requestType": "CLOSE"}, {SESSION: session_id})
    assert again.status == 400


def test_new_session_header_runs_the_first_turn_in_the_new_session(
    workers: tuple[WorkerConnection, WorkerConnection],
) -> None:
    a, b = workers
    turns = [{"role": "user", "content": "What is the capital of France?"}]
    first = a.request("POST", "/invocations", _chat(turns), {SESSION: "NEW_SESSION"})
    assert first.status == 200, first.body
    assert first.json()["object"] == "chat.completion"
    match = EXPIRES.match(first.headers[NEW_ID])
    assert match, first.headers
    session_id = match[1]
    next_turn = b.request("POST", "/invocations", _chat(turns), {SESSION: session_id})
    assert next_turn.status == 200, next_turn.body
    assert next_turn.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    close = a.request("POST", "/invocations", {"requestType": "CLOSE"}, {SESSION: session_id})
    assert close.status == 200


def test_unknown_and_malformed_session_requests_are_400s(
    workers: tuple[WorkerConnection, WorkerConnection],
) -> None:
    a, b = workers
    turns = [{"role": "user", "content": "Hi"}]
    embedding = {"task": "embeddings", "input": "Hi"}
    for conn in (a, b):
        for body in (_chat(turns), embedding):
            guessed = conn.request("POST", "/invocations", body, {SESSION: "a" * 32})
            assert guessed.status == 400, guessed.body
            assert "session" in guessed.json()["error"]["message"].lower()
    refused = a.request(
        "POST", "/invocations", {"prompt": "x", "max_tokens": -1}, {SESSION: "NEW_SESSION"}
    )
    assert refused.status == 400 and NEW_ID not in refused.headers, refused.headers
    no_header = a.request("POST", "/invocations", {"requestType": "CLOSE"})
    assert no_header.status == 400
    assert no_header.json()["error"]["param"] == SESSION
    bad_type = a.request("POST", "/invocations", {"requestType": "OPEN"})
    assert bad_type.status == 400
    assert bad_type.json()["error"]["param"] == "requestType"


def test_many_session_turns_over_fresh_connections_reach_both_workers(server: Server) -> None:
    """The brief's form of the cross-worker check too: many short-lived connections."""
    with httpx.Client(base_url=server.url, timeout=120) as client:
        opened = client.post("/invocations", json={"requestType": "NEW_SESSION"})
        session_id = opened.headers[NEW_ID].split(";")[0]
    statuses = []
    for i in range(8):
        with httpx.Client(base_url=server.url, timeout=120) as client:
            body = {"prompt": f"Count to {i}:", "max_tokens": 2}
            statuses.append(
                client.post("/invocations", json=body, headers={SESSION: session_id}).status_code
            )
    assert statuses == [200] * 8


def test_execution_parameters_come_from_the_engine(server: Server) -> None:
    answer = httpx.get(server.url + "/execution-parameters", timeout=30)
    assert answer.status_code == 200
    assert answer.json() == {
        "MaxConcurrentTransforms": MAX_NUM_SEQS,
        "BatchStrategy": "MULTI_RECORD",
        "MaxPayloadInMB": 6,  # the default 6 MiB body limit
    }
    assert int(answer.headers["content-length"]) == len(answer.content)


def test_json_lines_in_order_with_a_bad_record_answered_on_its_own_line(server: Server) -> None:
    records = [
        json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
        json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
        "{not json",
        json.dumps({"prompt": "One, two,", "max_tokens": -1}),
        json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 2}}),
        json.dumps({"prompt": "Stream me", "stream": True}),
    ]
    body = ("\n".join(records) + "\n\n").encode()  # a trailing blank line is no record
    answer = httpx.post(
        server.url + "/invocations",
        content=body,
        headers={"Content-Type": "application/jsonlines"},
        timeout=300,
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("application/jsonlines")
    assert int(answer.headers["content-length"]) == len(answer.content)
    lines = [json.loads(line) for line in answer.content.decode().splitlines()]
    assert len(lines) == len(records)
    assert lines[0]["object"] == "text_completion" and lines[0]["usage"]["completion_tokens"] == 4
    assert lines[1]["object"] == "chat.completion"
    assert lines[2]["error"]["code"] == 400 and "JSON" in lines[2]["error"]["message"]
    assert lines[3]["error"]["code"] == 400 and lines[3]["error"]["param"] == "max_tokens"
    assert "generated_text" in lines[4][0]  # TGI answers a list
    assert lines[5]["error"]["param"] == "stream"
    empty = httpx.post(
        server.url + "/invocations",
        content=b"\n\n",
        headers={"Content-Type": "application/jsonlines"},
        timeout=30,
    )
    assert empty.status_code == 400


def test_buffered_answers_carry_content_length(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    cases = [
        ("GET", "/ping", None, 200),
        ("GET", "/health", None, 200),
        ("GET", "/v1/models", None, 200),
        ("GET", "/nowhere", None, 404),
        ("POST", "/invocations", b'{"prompt": "Hi", "max_tokens": 2}', 200),
        ("POST", "/invocations", b'{"prompt": "Hi", "max_tokens": -5}', 400),
        ("POST", "/invocations", b'{"requestType": "NEW_SESSION"}', 200),
    ]
    for method, path, body, status in cases:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read()
        assert resp.status == status, (path, payload)
        assert resp.getheader("Content-Length") == str(len(payload)), (path, resp.getheaders())
        assert resp.getheader("Transfer-Encoding") is None
    conn.close()


# ------------------------------------------------------------ the request timeout by mode

REALTIME_TIMEOUT_S = 1
STEP_DELAY_S = 0.05
LONG_REQUEST = {"prompt": "Tell me a long story.", "max_tokens": 40, "ignore_eos": True}
"""At least 40 steps of STEP_DELAY_S (2 s) on any host: past the realtime timeout."""
SERVE_ENV = {
    "SM_HEARTH_MAX_MODEL_LEN": "1024",
    "SM_HEARTH_KV_CACHE_MEMORY": "128MiB",
    "HEARTH_TEST_STEP_DELAY": str(STEP_DELAY_S),
    "HEARTH_SAGEMAKER_REALTIME_TIMEOUT": str(REALTIME_TIMEOUT_S),
}


@pytest.fixture(scope="module")
def realtime_serve(server_logs: Path, model_smollm2_dir: str) -> Iterator[Server]:
    """`serve` in real-time mode with a short (configurable) realtime timeout and a batch
    payload size."""
    server = start_sagemaker_serve(server_logs, {**SERVE_ENV, "SAGEMAKER_MAX_PAYLOAD_IN_MB": "20"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def async_serve(server_logs: Path, model_smollm2_dir: str) -> Iterator[Server]:
    """`serve` in async mode (what `hearth deploy sagemaker --async` sets), the same
    realtime timeout as above, and AWS's session variables (a short expiry)."""
    env = {
        **SERVE_ENV,
        "HEARTH_SAGEMAKER_MODE": "async",
        "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true",
        "SAGEMAKER_SESSIONS_EXPIRATION": str(SHORT_TTL_S),
    }
    server = start_sagemaker_serve(server_logs, env)
    yield server
    server.stop()


SHORT_TTL_S = 8
"""Long enough for one 1-token request on a loaded host, short enough not to idle the suite."""


def test_realtime_mode_cuts_a_request_at_its_timeout(realtime_serve: Server) -> None:
    start = time.monotonic()
    answer = httpx.post(realtime_serve.url + "/invocations", json=LONG_REQUEST, timeout=300)
    elapsed = time.monotonic() - start
    assert answer.status_code == 504, answer.text
    assert f"request timeout of {REALTIME_TIMEOUT_S} s" in answer.json()["error"]["message"]
    assert elapsed < REALTIME_TIMEOUT_S + 10


def test_async_mode_lets_the_same_request_run_past_the_realtime_timeout(
    async_serve: Server,
) -> None:
    start = time.monotonic()
    answer = httpx.post(async_serve.url + "/invocations", json=LONG_REQUEST, timeout=900)
    elapsed = time.monotonic() - start
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == LONG_REQUEST["max_tokens"]
    assert int(answer.headers["content-length"]) == len(answer.content)
    # It ran past the realtime cut (at least 40 delayed steps) and completed.
    assert elapsed > LONG_REQUEST["max_tokens"] * STEP_DELAY_S > REALTIME_TIMEOUT_S


def test_serve_maps_aws_session_variables_and_expiry_is_honoured(async_serve: Server) -> None:
    with httpx.Client(base_url=async_serve.url, timeout=300) as client:
        opened = client.post("/invocations", json={"requestType": "NEW_SESSION"})
        assert opened.status_code == 200, opened.text
        match = EXPIRES.match(opened.headers[NEW_ID])
        assert match
        session_id = match[1]
        expires = datetime.strptime(match[2], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
        assert abs((expires - datetime.now(UTC)).total_seconds() - SHORT_TTL_S) < 3
        body = {"prompt": "Hi", "max_tokens": 1}
        live = client.post("/invocations", json=body, headers={SESSION: session_id})
        assert live.is_success, live.text
        # Past SAGEMAKER_SESSIONS_EXPIRATION (the header's second is rounded down).
        time.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 1.5)
        late = client.post("/invocations", json=body, headers={SESSION: session_id})
        assert late.status_code == 400, late.text


def test_serve_maps_the_batch_payload_size(realtime_serve: Server) -> None:
    params = httpx.get(realtime_serve.url + "/execution-parameters", timeout=30).json()
    assert params["MaxPayloadInMB"] == 20
