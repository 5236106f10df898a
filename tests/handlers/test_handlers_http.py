"""HTTP concerns: auth, ids, limits, probes, metrics, CORS, root path, headers."""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

import falcon.testing
import pytest
from fake_engine import FakeEngine
from handlers_testing import assert_openai_error, call_asgi, connected_client

from handlers.config import ServerConfig
from handlers.http.app import create_app
from handlers.http.disconnect import CancelOnDisconnect

CHAT_BODY = {"messages": [{"role": "user", "content": "Hello"}]}
KEY = "sk-test-123"


@pytest.fixture
def secured(make_client) -> falcon.testing.TestClient:
    return make_client(
        api_key_digests=ServerConfig.with_api_keys([KEY, "other"]).api_key_digests,
        enable_server_load_tracking=True,  # so /load exists and must be locked too
    )


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("POST", "/invocations"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/load"),
        ("GET", "/no/such/route"),
    ],
)
def test_every_inference_route_needs_the_key(secured, engine, headers, method, path):
    result = secured.simulate_request(method, path, json=CHAT_BODY, headers=headers)
    error = assert_openai_error(result, 401, None)
    assert error["type"] == "AuthenticationError"
    assert result.headers["www-authenticate"] == "Bearer"
    assert engine.added == []


def test_right_key_passes(secured, engine):
    result = secured.simulate_post(
        "/v1/chat/completions", json=CHAT_BODY, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert result.status_code == 200
    second = secured.simulate_get("/v1/models", headers={"Authorization": "bearer other"})
    assert second.status_code == 200


@pytest.mark.parametrize("path", ["/ping", "/health", "/version"])
def test_probes_are_open(secured, path):
    assert secured.simulate_get(path).status_code == 200


def test_metrics_need_the_key_when_one_is_set(secured, client):
    """Issue 17 item 9: /metrics was open, and its series name the served model (by
    default the model's filesystem path)."""
    assert_openai_error(secured.simulate_get("/metrics"), 401)
    keyed = secured.simulate_get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert keyed.status_code == 200
    assert client.simulate_get("/metrics").status_code == 200  # no key set: open


@pytest.mark.parametrize("origin", ["https://evil.example", "null"])
def test_a_wildcard_origin_never_gets_credentials(make_client, origin):
    """`--allowed-origins '*' --allow-credentials` reflected any Origin with
    Allow-Credentials: any site could call the API with the user's cookies."""
    cors = make_client(allowed_origins=("*",), allow_credentials=True)
    result = cors.simulate_get("/v1/models", headers={"Origin": origin})
    assert result.headers.get("Access-Control-Allow-Credentials") is None
    assert result.headers.get("Access-Control-Allow-Origin") in ("*", None)
    named = make_client(allowed_origins=("https://app.example",), allow_credentials=True)
    ok = named.simulate_get("/v1/models", headers={"Origin": "https://app.example"})
    assert ok.headers.get("Access-Control-Allow-Credentials") == "true"
    assert ok.headers.get("Access-Control-Allow-Origin") == "https://app.example"


def test_ping_follows_readiness_and_health_follows_death(client, engine: FakeEngine):
    engine.ready = False
    for method in ("GET", "POST"):
        assert_openai_error(client.simulate_request(method, "/ping"), 503)
    assert client.simulate_get("/health").status_code == 200  # loading is alive
    result = client.simulate_post("/v1/chat/completions", json=CHAT_BODY)
    assert_openai_error(result, 503)
    engine.ready = True
    assert client.simulate_get("/ping").status_code == 200
    assert client.simulate_post("/ping").status_code == 200
    engine.die()
    assert_openai_error(client.simulate_get("/health"), 503)
    assert_openai_error(client.simulate_get("/ping"), 503)
    assert_openai_error(client.simulate_post("/v1/chat/completions", json=CHAT_BODY), 503)


@pytest.mark.anyio
async def test_lifespan_starts_and_closes_the_engine(client, engine: FakeEngine):
    engine.ready = False  # startup must not wait for warm-up
    async with falcon.testing.ASGIConductor(client.app) as conductor:
        assert engine.started and not engine.closed
        assert (await conductor.simulate_get("/ping")).status_code == 503
    assert engine.closed


def test_request_id_echo(make_client):
    client = make_client(enable_request_id_headers=True)
    result = client.simulate_get("/v1/models", headers={"X-Request-Id": "req-42"})
    assert result.headers["x-request-id"] == "req-42"
    generated = client.simulate_post("/v1/chat/completions", json=CHAT_BODY)
    assert generated.json["id"] == "chatcmpl-" + generated.headers["x-request-id"]
    error = client.simulate_get("/nowhere", headers={"X-Request-Id": "req-43"})
    assert error.headers["x-request-id"] == "req-43"


def test_request_id_not_echoed_by_default(client):
    result = client.simulate_get("/v1/models", headers={"X-Request-Id": "req-42"})
    assert "x-request-id" not in result.headers


def test_too_large_body_by_content_length(client, engine):
    result = client.simulate_post("/v1/chat/completions", body=b"x" * (7 << 20))
    error = assert_openai_error(result, 413, None)
    assert error["type"] == "RequestTooLargeError"


@pytest.mark.anyio
async def test_too_large_body_without_content_length(client, engine):
    body = b'{"messages": "' + b"x" * (7 << 20) + b'"}'
    result = await call_asgi(client.app, "/v1/chat/completions", body, content_length=False)
    assert result.status == 413
    assert result.json["error"]["code"] == 413


def test_body_limit_is_configurable(make_client):
    client = make_client(max_request_body_bytes=100)
    result = client.simulate_post("/invocations", json={"prompt": "x" * 200})
    assert_openai_error(result, 413)


def test_unknown_route_and_wrong_method(client):
    error = assert_openai_error(client.simulate_get("/v2/nothing"), 404, None)
    assert error["type"] == "NotFoundError"
    result = client.simulate_get("/v1/chat/completions")
    error = assert_openai_error(result, 405, None)
    assert "POST" in result.headers["allow"]
    assert_openai_error(client.simulate_delete("/v1/models"), 405)


def test_models_list(client, model_dir):
    body = client.simulate_get("/v1/models").json
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny", "tiny-alias"]
    assert body["data"][0]["max_model_len"] == 256
    assert body["data"][0]["root"] == str(model_dir)
    assert body["data"][0]["architecture"] == "LlamaForCausalLM"


def test_models_retrieve_is_the_listed_card(client, make_client):
    """`GET /v1/models/{model}` (OpenAI's `models.retrieve`; vLLM has no such route): the
    card `/v1/models` lists under that name, a name with slashes included, and a 404 in
    OpenAI's shape naming `model` for any other name."""
    listed = {m["id"]: m for m in client.simulate_get("/v1/models").json["data"]}
    for name in ("tiny", "tiny-alias"):
        result = client.simulate_get(f"/v1/models/{name}")
        assert result.status_code == 200, result.text
        assert result.json == listed[name]
    error = assert_openai_error(client.simulate_get("/v1/models/other"), 404, "model")
    assert error["type"] == "NotFoundError" and "`other`" in error["message"]
    assert_openai_error(client.simulate_delete("/v1/models/tiny"), 405)
    slashed = make_client(served_model_names=("org/tiny-1b",))
    result = slashed.simulate_get("/v1/models/org/tiny-1b")
    assert result.status_code == 200, result.text
    assert result.json["id"] == "org/tiny-1b" and result.json["object"] == "model"
    assert_openai_error(slashed.simulate_get("/v1/models/org"), 404, "model")


def test_version(client):
    # The installed distribution's own version, not just any string.
    body = client.simulate_get("/version").json
    assert body["version"] == importlib.metadata.version("hearth")
    # Once the engine is warm: what --quantization resolved to, the kernels it runs and
    # the native architecture serving the model.
    assert set(body) == {"version", "quantization", "kernels", "architecture"}
    assert body["architecture"] == "LlamaForCausalLM"


def test_load_route_only_with_the_flag(client, make_client, engine):
    assert_openai_error(client.simulate_get("/load"), 404)
    tracked = make_client(enable_server_load_tracking=True)
    assert tracked.simulate_get("/load").json == {"server_load": 0}


def test_metrics_have_hearth_names(model_dir, tokenizer, engine):
    app = create_app(
        ServerConfig(model_dir=str(model_dir), served_model_names=["m"]), engine, tokenizer
    )
    client = connected_client(app)
    assert client.simulate_post("/v1/chat/completions", json=CHAT_BODY).status_code == 200
    result = client.simulate_get("/metrics")
    assert result.headers["content-type"].startswith("text/plain")
    text = result.text
    for name in (
        "hearth:time_to_first_token_seconds_bucket",
        "hearth:inter_token_latency_seconds_bucket",
        "hearth:e2e_request_latency_seconds_count",
        'hearth:request_success_total{finished_reason="stop",model_name="m"}',
        'hearth:prompt_tokens_total{model_name="m"}',
        'hearth:generation_tokens_total{model_name="m"}',
    ):
        assert name in text, name


def test_metrics_multiprocess_mode(monkeypatch, tmp_path, client):
    """/metrics sums what every process wrote into the multiprocess directory (the
    engine and each API worker write their own files)."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    key = mmap_key("hearth:num_preemptions", "hearth:num_preemptions_total", [], [], "p")
    for pid, value in ((101, 2.0), (102, 3.0)):  # two processes' counters
        values = MmapedDict(str(tmp_path / f"counter_{pid}.db"))
        values.write_value(key, value, 0.0)
        values.close()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    result = client.simulate_get("/metrics")
    assert result.status_code == 200
    assert "hearth:num_preemptions_total 5.0" in result.text.splitlines()


def test_cors_off_by_default(client):
    result = client.simulate_get("/v1/models", headers={"Origin": "https://example.com"})
    assert "access-control-allow-origin" not in result.headers


def test_cors_with_configured_origin(make_client):
    client = make_client(
        allowed_origins=["https://ok.example"],
        allowed_methods=["GET", "POST"],
        api_key_digests=ServerConfig.with_api_keys([KEY]).api_key_digests,
    )
    preflight = client.simulate_options(
        "/v1/chat/completions",
        headers={
            "Origin": "https://ok.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200  # preflights carry no credentials
    assert preflight.headers["access-control-allow-origin"] == "https://ok.example"
    assert preflight.headers["access-control-allow-methods"] == "GET, POST"
    other = client.simulate_get("/version", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_root_path_is_stripped(make_client):
    client = make_client(root_path="/api")
    assert client.simulate_get("/api/v1/models").status_code == 200
    assert client.simulate_get("/v1/models").status_code == 200  # proxy already stripped it
    assert client.simulate_get("/api/ping").status_code == 200


def test_sagemaker_custom_attributes_echoed(client):
    headers = {"X-Amzn-SageMaker-Custom-Attributes": "trace=1"}
    result = client.simulate_post("/invocations", json={"prompt": "x"}, headers=headers)
    assert result.status_code == 200
    assert result.headers["x-amzn-sagemaker-custom-attributes"] == "trace=1"


def test_unhandled_bug_is_a_500_without_internals(client, engine: FakeEngine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(engine, "add_request", broken)
    result = client.simulate_post("/v1/chat/completions", json=CHAT_BODY)
    error = assert_openai_error(result, 500, None)
    assert "secret" not in error["message"] and error["type"] == "InternalServerError"


@pytest.mark.anyio
async def test_disconnect_watcher_leaves_the_body_to_the_app() -> None:
    """The watcher reads `receive` only once the app has read the whole body, so the
    server's flow control still bounds an upload (a 413 reads no more of it)."""
    reads: list[int] = []
    sent: list[dict] = []

    async def receive() -> dict:
        reads.append(len(reads))
        if len(reads) == 1:
            return {"type": "http.request", "body": b"x" * 10, "more_body": True}
        await asyncio.Event().wait()  # the rest of a huge upload, never needed
        raise AssertionError("unreachable")

    async def refusing_app(scope: dict, receive: Any, send: Any) -> None:
        await receive()  # the first chunk says the body is too large
        await send({"type": "http.response.start", "status": 413, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(message: dict) -> None:
        sent.append(message)

    await CancelOnDisconnect(refusing_app)({"type": "http"}, receive, send)
    assert reads == [0]  # only the app's own read
    assert sent[0]["status"] == 413


def test_tokenizer_info_only_when_enabled(make_client, tokenizer, model_dir) -> None:
    """vLLM's GET /tokenizer_info behind --enable-tokenizer-info-endpoint: the tokenizer's
    config without file paths, added tokens as text, its class and the chat template."""
    import json as json_module

    assert make_client().simulate_get("/tokenizer_info").status_code == 404
    result = make_client(enable_tokenizer_info_endpoint=True).simulate_get("/tokenizer_info")
    assert result.status_code == 200, result.text
    info = result.json
    raw = json_module.loads((model_dir / "tokenizer_config.json").read_text())
    assert info["chat_template"] == tokenizer.chat_template
    assert "tokenizer_class" in info
    assert not any(key.endswith("_file") for key in info)
    for key in ("bos_token", "eos_token"):
        if key in raw:
            want = raw[key]["content"] if isinstance(raw[key], dict) else raw[key]
            assert info[key] == want
