"""Responses input -> a chat request: the one translation that lets `/v1/responses` run
the chat path (its renderer, tool parser and reasoning parser) unchanged.

- `instructions` -> a leading system message (not carried over by
  `previous_response_id`, as in OpenAI's API);
- the stored conversation of `previous_response_id` -> the messages before the input;
- message items -> chat messages (text parts joined by newlines, as chat joins them);
- `function_call` items -> `tool_calls` of an assistant message (consecutive calls, and
  calls right after an assistant message, join that message: one assistant turn);
- `function_call_output` items -> `tool` messages;
- `reasoning` items -> nothing (chat templates drop earlier turns' reasoning too);
- tools, `tool_choice`, `text.format`, `max_output_tokens` and the sampling fields -> their
  chat names.

Chat's own checks then run on the result; their 400s are renamed back to the Responses
fields (`responses_error`), so a client never sees a field it did not send.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from handlers.errors import ServingError
from handlers.protocol.base import RequestLimits, parse_request
from handlers.protocol.chat import ChatCompletionRequest
from handlers.protocol.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    JsonSchemaTextFormat,
    MessageItem,
    ResponsesRequest,
    ToolChoiceFunction,
    content_text,
)


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as chat messages (dicts in chat's wire form)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[dict[str, Any]] = []
    for item in request.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": content_text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": content_text(item.output)}
            )
    return messages


def _tool_choice(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    fmt = request.text.format if request.text else None
    if fmt is None or fmt.type == "text":
        return None
    if isinstance(fmt, JsonSchemaTextFormat):
        return {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.name,
                "description": fmt.description,
                "schema": fmt.json_schema,
                "strict": fmt.strict,
            },
        }
    return {"type": "json_object"}


def chat_request(
    request: ResponsesRequest, history: list[dict[str, Any]], limits: RequestLimits
) -> ChatCompletionRequest:
    """The chat request that answers `request` after the stored `history`."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    messages += history
    messages += input_messages(request)
    effort = request.reasoning.effort if request.reasoning else None
    body: dict[str, Any] = {
        "messages": messages,
        "model": request.model,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "repetition_penalty": request.repetition_penalty,
        "seed": request.seed,
        "ignore_eos": request.ignore_eos or None,
        "tools": [
            {"type": "function", "function": t.definition().model_dump(exclude_none=True)}
            for t in request.tools
        ]
        if request.tools
        else None,
        "tool_choice": _tool_choice(request),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": _response_format(request),
        "chat_template_kwargs": {"reasoning_effort": effort} if effort else None,
        "stream": request.stream,
        "priority": request.priority,
        "request_id": request.request_id,
        "cache_salt": request.cache_salt,
    }
    if request.wants_logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = request.top_logprobs or 0
    with responses_params():
        return parse_request(
            ChatCompletionRequest, {k: v for k, v in body.items() if v is not None}, limits
        )


_CHAT_TO_RESPONSES = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
)


def responses_param(param: str | None) -> str | None:
    """A chat field name as the Responses request spells it."""
    if param is None:
        return None
    for chat, responses in _CHAT_TO_RESPONSES:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            # Message indices shift (instructions, history): name the whole input.
            return responses if chat == "messages" else responses + param[len(chat) :]
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    if param.startswith("tool_choice.function."):
        return param.replace(".function.", ".", 1)
    return param


def responses_error(error: ServingError) -> ServingError:
    """`error` with its param (and the message's leading `param:`) in Responses terms."""
    renamed = responses_param(error.param)
    if renamed == error.param:
        return error
    message = error.message
    if error.param and message.startswith(error.param):
        message = renamed + message[len(error.param) :]
    elif error.param:
        message = message.replace(f"'{error.param}'", f"'{renamed}'")
    error.message, error.param = message, renamed
    error.args = (message,)
    return error


@contextmanager
def responses_params() -> Iterator[None]:
    """Within the block, a ServingError names Responses fields (`responses_error`)."""
    try:
        yield
    except ServingError as exc:
        raise responses_error(exc) from None
