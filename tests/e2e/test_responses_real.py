"""The Responses API against a real `hearth serve` (default model, two API workers) with
the real clients: the `openai` SDK's `responses.create`, `responses.stream` and
`responses.parse`, and the OpenAI Agents SDK running an agent with one function tool.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.e2e.clients import TIMEOUT, async_client, client, sse_lines
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
QUESTION = "What is the capital of France?"
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


def test_create_answers_with_usage_and_cached_tokens(default_server: Server) -> None:
    sdk = client(default_server)
    first = sdk.responses.create(
        model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24, store=False
    )
    assert first.object == "response" and first.status == "completed", first
    assert "Paris" in first.output_text
    [message] = first.output
    assert message.type == "message" and message.role == "assistant"
    usage = first.usage
    assert usage is not None and usage.input_tokens > 10 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    again = sdk.responses.create(
        model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24, store=False
    )
    assert again.output_text == first.output_text, "greedy decoding is reproducible"
    # The same prompt again: its full blocks come from the prefix cache.
    assert again.usage.input_tokens_details.cached_tokens > 0


def test_max_output_tokens_makes_an_incomplete_response(default_server: Server) -> None:
    response = client(default_server).responses.create(
        model=MODEL, input="Tell me a long story about a dragon.", max_output_tokens=3
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_stream_sends_the_typed_events_in_order(default_server: Server) -> None:
    sdk = client(default_server)
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "input": QUESTION,
        "instructions": "Answer in one sentence.",
        "temperature": 0,
        "max_output_tokens": 24,
    }
    with sdk.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert deltas, types
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert final.output_text == "".join(deltas)
    buffered = sdk.responses.create(**kwargs)
    assert buffered.output_text == final.output_text, "stream and non-stream agree"


def test_included_logprobs_parse_in_the_sdk_and_match_chat(default_server: Server) -> None:
    """`include=["message.output_text.logprobs"]` with `top_logprobs`: the SDK's typed
    `Logprob` entries, one per token of the text, equal to the chat route's for the same
    greedy request; streamed, the text deltas carry them too."""
    sdk = client(default_server)
    kwargs: dict[str, Any] = {
        "model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 12,
        "include": ["message.output_text.logprobs"], "top_logprobs": 3,
    }  # fmt: skip
    response = sdk.responses.create(**kwargs)
    part = response.output[0].content[0]
    assert part.logprobs and "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 3 for lp in part.logprobs)
    chat = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_completion_tokens=12, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    chat_entries = chat.choices[0].logprobs.content
    assert [(lp.token, lp.logprob) for lp in part.logprobs] == [
        (lp.token, lp.logprob) for lp in chat_entries
    ][: len(part.logprobs)]
    with sdk.responses.stream(**kwargs) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
    streamed = [lp.token for event in deltas for lp in event.logprobs]
    assert streamed == [lp.token for lp in part.logprobs]


def test_raw_stream_names_each_event(default_server: Server) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", default_server.v1 + "/responses", json=body, timeout=TIMEOUT
    ) as response:
        assert response.status_code == 200
        lines = sse_lines(response.read())
    names = [line[len("event: ") :] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ")]
    assert names == [event["type"] for event in data]
    assert names[0] == "response.created" and names[-1] in (
        "response.completed",
        "response.incomplete",
    )


class City(BaseModel):
    name: str
    country: str


def test_parse_fills_a_pydantic_model(default_server: Server) -> None:
    response = client(default_server).responses.parse(
        model=MODEL,
        input="Name the capital city of France and its country as JSON.",
        text_format=City,
        temperature=0,
        max_output_tokens=64,
    )
    parsed = response.output_parsed
    assert isinstance(parsed, City), response.output_text
    assert City.model_validate_json(response.output_text) == parsed


def test_a_forced_function_call_validates_against_its_schema(default_server: Server) -> None:
    response = client(default_server).responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=64,
    )
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)


def test_a_background_response_is_polled_and_cancelled_from_any_worker(
    default_server: Server,
) -> None:
    """`background=True` through the SDK: `queued` at once, then `retrieve` (fresh
    connections, so either API worker) until `completed` with the text a synchronous
    call gives; a long one is cancelled by `cancel` from any worker and stays so, with
    nothing left running in the engine."""
    import time

    from tests.e2e.clients import wait_metric

    sdk = client(default_server)
    kwargs: dict[str, Any] = {
        "model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 12
    }  # fmt: skip
    queued = sdk.responses.create(**kwargs, background=True)
    assert queued.status == "queued" and queued.background is True
    for _ in range(300):
        polled = client(default_server).responses.retrieve(queued.id)
        if polled.status not in ("queued", "in_progress"):
            break
        time.sleep(0.1)
    assert polled.status == "completed", polled.status
    assert polled.output_text == sdk.responses.create(**kwargs).output_text

    long = sdk.responses.create(
        model=MODEL, input="Tell me a very long story.", max_output_tokens=2000,
        background=True, extra_body={"ignore_eos": True},  # ~20 s here: cancelled long before
    )  # fmt: skip
    for _ in range(100):
        if client(default_server).responses.retrieve(long.id).status == "in_progress":
            break
        time.sleep(0.1)
    time.sleep(0.5)
    cancelled = client(default_server).responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert wait_metric(default_server, "hearth:num_requests_running", 0) == 0
    for _ in range(4):
        assert client(default_server).responses.retrieve(long.id).status == "cancelled"


def test_a_streamed_background_response_resumes_on_any_worker(default_server: Server) -> None:
    """`background=True, stream=True` through the SDK: the client reads a few events and
    leaves; the response runs on; `retrieve(stream=True, starting_after=N)` from fresh
    connections (either API worker) sends the rest, numbered on, to `response.completed`;
    the text of both parts is the synchronous answer's."""
    sdk = client(default_server)
    kwargs: dict[str, Any] = {
        "model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 24
    }  # fmt: skip
    stream = sdk.responses.create(**kwargs, background=True, stream=True)
    head = []
    for event in stream:
        head.append(event)
        if sum(e.type == "response.output_text.delta" for e in head) == 2:
            break
    stream.close()  # the client leaves mid-response
    assert head[0].type == "response.created" and head[0].response.status == "queued"
    response_id = head[0].response.id
    after = head[-1].sequence_number
    rest = list(
        client(default_server).responses.retrieve(response_id, stream=True, starting_after=after)
    )
    assert [e.sequence_number for e in rest] == list(range(after + 1, after + 1 + len(rest)))
    assert rest[-1].type == "response.completed"
    text = "".join(e.delta for e in [*head, *rest] if e.type == "response.output_text.delta")
    final = client(default_server).responses.retrieve(response_id)
    assert final.status == "completed" and final.background is True
    assert text == final.output_text == rest[-1].response.output_text
    assert text == sdk.responses.create(**kwargs).output_text
    again = list(client(default_server).responses.retrieve(response_id, stream=True))
    assert [e.sequence_number for e in again] == list(range(len(again)))
    assert len(again) == after + 1 + len(rest), "from the start: every event once"


def test_a_stored_response_continues_and_is_shared_by_the_workers(
    default_server: Server,
) -> None:
    sdk = client(default_server)
    first = sdk.responses.create(
        model=MODEL, input="My name is Ada.", temperature=0, max_output_tokens=16
    )
    # Fresh connections land on either API worker: every one must find it.
    for _ in range(6):
        fetched = client(default_server).responses.retrieve(first.id)
        assert fetched.id == first.id and fetched.output_text == first.output_text
    follow = sdk.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=16,
    )
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    sdk.responses.delete(first.id)
    for _ in range(3):
        with pytest.raises(openai.NotFoundError):
            client(default_server).responses.retrieve(first.id)


def _weather_agent(server: Server, calls: list[str]) -> Any:
    from agents import Agent, ModelSettings, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    return Agent(
        name="weather",
        instructions="You answer questions about the weather. Use the tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=async_client(server)),
        # The first turn must call the tool (a 135M model would not always choose to);
        # the Agents SDK resets tool_choice after a tool ran, so the next turn answers.
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
    )


def test_the_agents_sdk_runs_an_agent_with_a_function_tool(default_server: Server) -> None:
    from agents import Runner

    calls: list[str] = []
    agent = _weather_agent(default_server, calls)
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert calls, "the tool ran"
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item", kinds


def test_the_agents_sdk_streams_an_agent_run(default_server: Server) -> None:
    """`Runner.run_streamed` reads our typed events (its stream path, not create())."""
    from agents import Runner

    calls: list[str] = []
    agent = _weather_agent(default_server, calls)

    async def run() -> tuple[Any, list[str]]:
        streamed = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
        raw = [
            event.data.type
            async for event in streamed.stream_events()
            if event.type == "raw_response_event"
        ]
        return streamed, raw

    streamed, raw = asyncio.run(run())
    assert calls, "the tool ran"
    assert raw.count("response.completed") >= 2, "two model turns: the call, the answer"
    assert "response.function_call_arguments.done" in raw
    assert "response.output_text.delta" in raw
    assert isinstance(streamed.final_output, str) and streamed.final_output.strip()
