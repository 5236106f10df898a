"""The Lambda handler answers a chat completion for each event kind AWS sends it
(API Gateway REST v1, HTTP API v2 with a base64 body, Function URL, ALB), with the
real default model running in-process."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EVENTS = Path(__file__).resolve().parents[1] / "lambda_events"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def responses(tmp_path_factory: pytest.TempPathFactory, model_smollm2_dir: str) -> dict:
    ping = tmp_path_factory.mktemp("events") / "ping_v2.json"
    ping.write_text(
        json.dumps(
            {
                "version": "2.0",
                "routeKey": "$default",
                "rawPath": "/ping",
                "rawQueryString": "",
                "headers": {"host": "x.lambda-url.us-east-1.on.aws"},
                "requestContext": {
                    "http": {
                        "method": "GET",
                        "path": "/ping",
                        "protocol": "HTTP/1.1",
                        "sourceIp": "203.0.113.1",
                        "userAgent": "t",
                    },
                    "requestId": "p",
                    "routeKey": "$default",
                    "stage": "$default",
                },
                "isBase64Encoded": False,
            }
        )
    )
    events = [
        *sorted(str(p) for p in EVENTS.glob("*.json")),
        str(ping),
        *embedding_events(ping.parent),
    ]
    env = {
        **os.environ,
        "HEARTH_MAX_MODEL_LEN": "1024",
        "HEARTH_KV_CACHE_MEMORY": "256MiB",  # a size with a unit, as `hearth serve` takes it
        "PYTHONPATH": str(ROOT),
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("drive_lambda.py")), *events],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


def _json_body(resp: dict) -> dict:
    """The JSON body of a 200 Lambda response (base64-decoded when the event said so)."""
    assert resp["statusCode"] == 200, resp
    body = resp["body"]
    if resp.get("isBase64Encoded"):
        body = base64.b64decode(body).decode()
    return json.loads(body)


@pytest.mark.parametrize("kind", ["api_gateway_rest_v1", "http_api_v2", "function_url", "alb"])
def test_each_event_kind_gets_a_chat_completion(responses: dict, kind: str) -> None:
    resp = responses["responses"][kind]
    data = _json_body(resp)
    assert data["object"] == "chat.completion"
    assert "Paris" in data["choices"][0]["message"]["content"]
    headers = {k.lower(): v for k, v in (resp.get("headers") or {}).items()}
    multi = {k.lower(): v for k, v in (resp.get("multiValueHeaders") or {}).items()}
    content_type = headers.get("content-type") or multi.get("content-type", [""])[0]
    assert content_type.startswith("application/json")


@pytest.mark.parametrize("kind", ["function_url_messages", "function_url_invocations_anthropic"])
def test_anthropic_messages_through_lambda(responses: dict, kind: str) -> None:
    """`/v1/messages`, and an Anthropic body (by `anthropic_version`) on `/invocations`."""
    data = _json_body(responses["responses"][kind])
    assert data["type"] == "message" and data["role"] == "assistant"
    assert data["content"][0]["type"] == "text"
    assert "Paris" in data["content"][0]["text"]
    assert data["usage"]["output_tokens"] >= 1


EMBED_TEXTS = ["Paris is in France.", "Berlin"]


def embedding_events(directory: Path) -> list[str]:
    """The stored Function URL event re-aimed at /v1/embeddings (float) and at
    /invocations with the embeddings marker (base64)."""
    template = json.loads((EVENTS / "function_url.json").read_text())
    bodies = {
        "embed_v1": ("/v1/embeddings", {"model": "smollm2", "input": EMBED_TEXTS}),
        "embed_invocations": (
            "/invocations",
            {"task": "embeddings", "input": EMBED_TEXTS, "encoding_format": "base64"},
        ),
    }
    paths = []
    for name, (path, body) in bodies.items():
        event = json.loads(json.dumps(template))
        event["rawPath"] = event["requestContext"]["http"]["path"] = path
        event["body"] = json.dumps(body)
        (directory / f"{name}.json").write_text(json.dumps(event))
        paths.append(str(directory / f"{name}.json"))
    return paths


def test_embeddings_through_lambda(responses: dict) -> None:
    import numpy as np

    bodies = {
        name: _json_body(responses["responses"][name]) for name in ("embed_v1", "embed_invocations")
    }
    floats = np.array([d["embedding"] for d in bodies["embed_v1"]["data"]])
    decoded = np.stack(
        [
            np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
            for d in bodies["embed_invocations"]["data"]
        ]
    )
    assert floats.shape == (len(EMBED_TEXTS), 576)
    assert np.array_equal(floats, decoded)
    assert np.allclose(np.linalg.norm(floats, axis=1), 1.0, atol=1e-6)


def test_import_does_not_wait_for_the_model(responses: dict) -> None:
    # The engine loads in a thread; import returns before it is ready (Lambda's init
    # phase stays short), and the first invocation waits for it.
    assert responses["after_import"] == {"started": True, "ready": False}
    assert responses["after_invocations"] == {"ready": True}


def test_ping_through_lambda(responses: dict) -> None:
    assert responses["responses"]["ping_v2"]["statusCode"] == 200


@pytest.mark.parametrize("kind", ["responses_function_url", "responses_invocations"])
def test_a_responses_body_gets_a_response(responses: dict, kind: str) -> None:
    """`POST /v1/responses`, and `/invocations` with a Responses body (`input`)."""
    data = _json_body(responses["responses"][kind])
    assert data["object"] == "response" and data["status"] == "completed", data
    [message] = data["output"]
    assert "Paris" in message["content"][0]["text"]
    assert data["usage"]["input_tokens"] > 0


def test_a_background_response_is_refused(responses: dict) -> None:
    """The process is frozen between invocations, so a background response would not
    run: a 400 naming the field."""
    resp = responses["responses"]["responses_background"]
    assert resp["statusCode"] == 400, resp
    assert json.loads(resp["body"])["error"]["param"] == "background"
