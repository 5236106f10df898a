"""Invoking endpoints: buffered via moto, streamed via real event-stream bytes."""

from __future__ import annotations

import base64
import itertools
import json
from typing import Any

import pytest
from botocore.stub import Stubber

from infra.errors import DeployError, StreamError
from infra.invoke import (
    Delta,
    chat_body,
    deltas_from_sse,
    function_url_event,
    invoke_json,
    invoke_lambda,
    load_body,
    payload_chunks,
    response_text,
    stream_deltas,
)

CHAT = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."}}]}


def sse(*chunks: dict[str, Any] | str) -> bytes:
    out = b""
    for chunk in chunks:
        data = chunk if isinstance(chunk, str) else json.dumps(chunk, ensure_ascii=False)
        out += f"data: {data}\n\n".encode()
    return out


def chat_chunk(text: str, index: int = 0, finish: str | None = None) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": index, "delta": {"content": text}, "finish_reason": finish}],
    }


def split_parts(data: bytes, *cuts: int) -> list[bytes]:
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@pytest.fixture
def rt(session: Any) -> Any:
    return session.client("sagemaker-runtime")


def test_invoke_json_returns_the_decoded_answer(rt: Any, moto_api: Any) -> None:
    moto_api.endpoint_results(json.dumps(CHAT))
    sent: list[dict[str, Any]] = []
    rt.meta.events.register(
        "provide-client-params.sagemaker-runtime.InvokeEndpoint",
        lambda params, **_: sent.append(dict(params)),
    )
    answer = invoke_json(rt, "demo", chat_body("capital of France?"), custom_attributes="trace=1")
    assert response_text(answer) == "Paris."
    assert json.loads(sent[0]["Body"]) == {
        "messages": [{"role": "user", "content": "capital of France?"}],
        "max_tokens": 256,
    }
    assert (sent[0]["ContentType"], sent[0]["Accept"]) == ("application/json", "application/json")
    assert sent[0]["CustomAttributes"] == "trace=1"


def test_invoke_json_rejects_a_non_json_answer(rt: Any, moto_api: Any) -> None:
    moto_api.endpoint_results("<html>oops</html>", content_type="text/html")
    with pytest.raises(DeployError, match="did not answer JSON"):
        invoke_json(rt, "demo", {"prompt": "x"})


def test_stream_reassembles_parts_split_mid_event_and_mid_character(
    rt: Any, shims: Any, eventstream: Any
) -> None:
    body = sse(
        chat_chunk("Bon"),
        chat_chunk("jour à "),
        chat_chunk("vous 🎉"),
        chat_chunk("", finish="stop"),
        "[DONE]",
    )
    e_acute = body.index("à".encode()) + 1  # inside the 2-byte "à"
    party = body.index("🎉".encode()) + 2  # inside the 4-byte emoji
    parts = split_parts(body, 10, e_acute, party)
    assert all(len(p) for p in parts)
    shims.stream.queue([eventstream.payload_part(p) for p in parts])
    shims.stream.chunk_size = 5  # the HTTP layer splits the binary messages too

    deltas = list(stream_deltas(rt, "demo", {"messages": []}, custom_attributes="a=b"))

    assert "".join(d.text for d in deltas) == "Bonjour à vous 🎉"
    assert deltas[-1] == Delta(index=0, text="", finish_reason="stop")
    (request,) = shims.stream.requests
    assert request["url"].endswith("/endpoints/demo/invocations-response-stream")
    assert request["body"] == {"messages": [], "stream": True}  # forced on
    assert request["headers"]["X-Amzn-SageMaker-Accept"] == b"text/event-stream"
    assert request["headers"]["X-Amzn-SageMaker-Custom-Attributes"] == b"a=b"


def test_stream_of_completions_keeps_choice_indexes(rt: Any, shims: Any, eventstream: Any) -> None:
    body = sse(
        {"choices": [{"index": 0, "text": "one", "finish_reason": None}]},
        {"choices": [{"index": 1, "text": "two", "finish_reason": None}]},
        "[DONE]",
    )
    shims.stream.queue([eventstream.payload_part(p) for p in split_parts(body, 3, 40)])
    deltas = list(stream_deltas(rt, "demo", {"prompt": "x", "n": 2}))
    assert deltas == [Delta(0, "one"), Delta(1, "two")]


def test_model_stream_error_after_some_text(rt: Any, shims: Any, eventstream: Any) -> None:
    shims.stream.queue(
        [
            eventstream.payload_part(sse(chat_chunk("partial"))),
            eventstream.exception(
                "ModelStreamError", "Your model took too long", "ModelInvocationTimeExceeded"
            ),
        ]
    )
    received: list[str] = []
    with pytest.raises(StreamError, match=r"model stream error \(ModelStreamError\): Your model"):
        for delta in stream_deltas(rt, "demo", {"messages": []}):
            received.append(delta.text)
    assert received == ["partial"]


def test_internal_stream_failure(rt: Any, shims: Any, eventstream: Any) -> None:
    shims.stream.queue([eventstream.exception("InternalStreamFailure", "stream broke")])
    with pytest.raises(StreamError, match="SageMaker internal stream failure: stream broke"):
        list(stream_deltas(rt, "demo", {"messages": []}))


def test_error_chunk_from_the_server(rt: Any, shims: Any, eventstream: Any) -> None:
    error = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
    shims.stream.queue([eventstream.payload_part(sse(chat_chunk("a"), error, "[DONE]"))])
    with pytest.raises(StreamError, match="server error during the stream: engine died"):
        list(stream_deltas(rt, "demo", {"messages": []}))


def test_stream_without_done_is_an_error(rt: Any, shims: Any, eventstream: Any) -> None:
    shims.stream.queue([eventstream.payload_part(sse(chat_chunk("cut")))])
    with pytest.raises(StreamError, match=r"ended before data: \[DONE\]"):
        list(stream_deltas(rt, "demo", {"messages": []}))


def test_stream_cut_inside_a_character(rt: Any, shims: Any, eventstream: Any) -> None:
    shims.stream.queue([eventstream.payload_part('data: {"x": "é'.encode()[:-1])])
    with pytest.raises(StreamError, match="not valid UTF-8"):
        list(stream_deltas(rt, "demo", {"messages": []}))


def test_json_answer_on_the_stream_api(rt: Any, shims: Any, eventstream: Any) -> None:
    raw = json.dumps(CHAT).encode()
    shims.stream.queue(
        [eventstream.payload_part(p) for p in split_parts(raw, 7)], content_type="application/json"
    )
    assert list(stream_deltas(rt, "demo", {"messages": []})) == [Delta(0, "Paris.", "stop")]


def test_payload_chunks_from_plain_event_dicts() -> None:
    events = [
        {"PayloadPart": {"Bytes": b"da"}},
        {"PayloadPart": {"Bytes": b""}},
        {"PayloadPart": {"Bytes": b"ta"}},
        {"ModelStreamError": {"ErrorCode": "StreamBroken", "Message": "gone"}},
        {"PayloadPart": {"Bytes": b"never"}},
    ]
    seen: list[bytes] = []
    with pytest.raises(StreamError, match=r"\(StreamBroken\): gone"):
        seen.extend(payload_chunks(events))
    assert seen == [b"da", b"ta"]
    with pytest.raises(StreamError, match="internal stream failure: x"):
        list(payload_chunks([{"InternalStreamFailure": {"Message": "x"}}]))


def test_deltas_ignore_role_only_chunks_and_stop_at_done() -> None:
    data = [
        json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
        json.dumps(chat_chunk("hi")),
        "[DONE]",
        json.dumps(chat_chunk("after done")),
    ]
    assert list(deltas_from_sse(data)) == [Delta(0, "hi")]
    with pytest.raises(StreamError, match="malformed"):
        list(deltas_from_sse(["{not json"]))


def test_load_body_inline_and_from_file(tmp_path: Any) -> None:
    assert load_body('{"prompt": "x"}') == {"prompt": "x"}
    path = tmp_path / "body.json"
    path.write_text('{"messages": []}')
    assert load_body(f"@{path}") == {"messages": []}
    for bad, message in (
        ("[1]", "JSON object"),
        ("{", "not valid JSON"),
        ("@/nope", "cannot read"),
    ):
        with pytest.raises(DeployError, match=message):
            load_body(bad)


def test_response_text_of_completions_and_errors() -> None:
    assert response_text({"choices": [{"index": 0, "text": "abc"}]}) == "abc"
    with pytest.raises(DeployError, match="no choices"):
        response_text({"error": {"message": "x"}})


# ---------------------------------------------------------------------------- Lambda


def test_function_url_event_shape() -> None:
    event = function_url_event("/v1/chat/completions", {"messages": []})
    assert event["version"] == "2.0"
    assert event["rawPath"] == event["requestContext"]["http"]["path"] == "/v1/chat/completions"
    assert event["requestContext"]["http"]["method"] == "POST"
    assert event["headers"]["content-type"] == "application/json"
    assert json.loads(event["body"]) == {"messages": []} and event["isBase64Encoded"] is False


@pytest.fixture
def lam(session: Any, role_arn: str, image: str) -> Any:
    client = session.client("lambda")
    client.create_function(
        FunctionName="fn", Role=role_arn, PackageType="Image", Code={"ImageUri": image}
    )
    return client


def test_invoke_lambda_decodes_the_http_response(lam: Any, moto_api: Any) -> None:
    moto_api.lambda_result(
        json.dumps(
            {"statusCode": 200, "headers": {}, "body": json.dumps(CHAT), "isBase64Encoded": False}
        )
    )
    assert response_text(invoke_lambda(lam, "fn", chat_body("q"))) == "Paris."
    encoded = base64.b64encode(json.dumps(CHAT).encode()).decode()
    moto_api.lambda_result(
        json.dumps({"statusCode": 200, "body": encoded, "isBase64Encoded": True})
    )
    assert response_text(invoke_lambda(lam, "fn", chat_body("q"))) == "Paris."


def test_invoke_lambda_http_error(lam: Any, moto_api: Any) -> None:
    error = {"error": {"message": "prompt is too long", "type": "BadRequestError", "code": 400}}
    moto_api.lambda_result(json.dumps({"statusCode": 400, "body": json.dumps(error)}))
    with pytest.raises(DeployError, match="answered 400: prompt is too long"):
        invoke_lambda(lam, "fn", chat_body("q"))


def test_invoke_lambda_function_error(session: Any) -> None:
    # moto's Docker-less backend cannot fail an invocation: stub the one call.
    import io

    lam = session.client("lambda")
    payload = {"errorType": "Runtime.ExitError", "errorMessage": "out of memory"}
    with Stubber(lam) as stub:
        stub.add_response(
            "invoke",
            {
                "StatusCode": 200,
                "FunctionError": "Unhandled",
                "Payload": io.BytesIO(json.dumps(payload).encode()),  # type: ignore[dict-item]
            },
        )
        with pytest.raises(DeployError, match=r"fn failed: Runtime\.ExitError: out of memory"):
            invoke_lambda(lam, "fn", {"messages": []})


def _responses_stream(*texts: str, finish: str | None = "stop") -> list[str]:
    """The data of a Responses stream as the server's own event writer makes it."""
    from handlers.errors import InternalServerError
    from handlers.protocol.chat import DeltaMessage
    from handlers.protocol.responses import ResponsesRequest
    from handlers.protocol.responses import ResponseUsage as Usage
    from handlers.serving.responses_output import response_shell
    from handlers.serving.responses_stream import ResponseEvents

    shell = response_shell("resp_1", ResponsesRequest(input="q"), "m", 0)
    events = ResponseEvents(shell, summary=False)
    out = [*events.start()]
    for text in texts:
        out += events.delta(DeltaMessage(content=text))
    if finish is None:
        out.append(events.error(InternalServerError("engine failed")))
    else:
        usage = Usage.model_validate(
            {
                "input_tokens": 1,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 1,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 2,
            }
        )
        out += events.finish(finish, lambda _: usage)[1]
    return [event.data.decode() for event in out]


def test_deltas_of_a_responses_stream_end_at_its_last_event() -> None:
    data = _responses_stream("Par", "is.")
    assert list(deltas_from_sse(data)) == [
        Delta(0, "Par"),
        Delta(0, "is."),
        Delta(0, "", finish_reason="stop"),
    ]
    cut = _responses_stream("Par", finish="length")
    assert list(deltas_from_sse(cut))[-1] == Delta(0, "", finish_reason="length")
    with pytest.raises(StreamError, match="engine failed"):
        list(deltas_from_sse(_responses_stream("Par", finish=None)))
    with pytest.raises(StreamError, match="ended before"):
        list(deltas_from_sse(data[:-1]))


def test_response_text_of_a_responses_answer() -> None:
    answer = {
        "object": "response",
        "output": [
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
            {"type": "message", "content": [{"type": "output_text", "text": "Paris."}]},
            {"type": "function_call", "name": "f", "arguments": "{}"},
        ],
    }
    assert response_text(answer) == "Paris."
