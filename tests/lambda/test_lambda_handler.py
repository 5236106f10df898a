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
    events = [*sorted(str(p) for p in EVENTS.glob("*.json")), str(ping)]
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


@pytest.mark.parametrize("kind", ["api_gateway_rest_v1", "http_api_v2", "function_url", "alb"])
def test_each_event_kind_gets_a_chat_completion(responses: dict, kind: str) -> None:
    resp = responses["responses"][kind]
    assert resp["statusCode"] == 200, resp
    body = resp["body"]
    if resp.get("isBase64Encoded"):
        body = base64.b64decode(body).decode()
    data = json.loads(body)
    assert data["object"] == "chat.completion"
    assert "Paris" in data["choices"][0]["message"]["content"]
    headers = {k.lower(): v for k, v in (resp.get("headers") or {}).items()}
    multi = {k.lower(): v for k, v in (resp.get("multiValueHeaders") or {}).items()}
    content_type = headers.get("content-type") or multi.get("content-type", [""])[0]
    assert content_type.startswith("application/json")


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
    resp = responses["responses"][kind]
    assert resp["statusCode"] == 200, resp
    data = json.loads(resp["body"])
    assert data["object"] == "response" and data["status"] == "completed", data
    [message] = data["output"]
    assert "Paris" in message["content"][0]["text"]
    assert data["usage"]["input_tokens"] > 0
