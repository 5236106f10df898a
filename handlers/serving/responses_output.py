"""The pieces of a Responses answer, shared by the buffered response and the stream so
both say the same thing: output items (reasoning, message, function calls), status,
usage, the echo of the request's settings, and the conversation that is stored for
`previous_response_id`."""

from __future__ import annotations

import secrets
from typing import Any

from engine.messages import TokenLogprob
from handlers.protocol.base import UsageInfo
from handlers.protocol.chat import ChatCompletionLogProbsContent
from handlers.protocol.responses import (
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningOutput,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    SummaryText,
    ToolChoiceFunction,
)
from handlers.serving.choice import Choice

ItemStatus = str
"""'in_progress', 'completed' or 'incomplete'."""


def failed_response(
    response: ResponseObject, code: str, message: str, output: list[OutputItem] | None = None
) -> ResponseObject:
    """`response` stored or sent as failed with its error (and the items finished before
    the failure, when given)."""
    update: dict[str, object] = {
        "status": "failed",
        "error": ResponseError(code=code, message=message),
    }
    if output is not None:
        update["output"] = output
    return response.model_copy(update=update)


def new_id(prefix: str) -> str:
    """OpenAI-style ids: `resp_...`, `msg_...`, `fc_...`, `rs_...`."""
    return f"{prefix}_{secrets.token_hex(16)}"


def message_item(
    item_id: str,
    text: str,
    status: ItemStatus,
    logprobs: list[ChatCompletionLogProbsContent] | None = None,
) -> OutputMessage:
    part = OutputText(text=text, logprobs=logprobs or [])
    return OutputMessage(id=item_id, status=status, content=[part])


def text_token_logprobs(seq: Choice, text: str, after: str) -> list[TokenLogprob]:
    """The logprob entries of the tokens that wrote `text` into the choice's output,
    found after `after` (the reasoning, which precedes the answer), by the character
    span each token released (`Choice.text_ends`). Reasoning and tool-call markup around
    the answer have tokens too; only the answer's are the output text's logprobs."""
    output = seq.text
    base = 0
    if after and (found := output.find(after)) >= 0:
        base = found + len(after)
    start = output.find(text, base) if text else -1
    if start < 0:
        return []
    end = start + len(text)
    kept: list[TokenLogprob] = []
    pending: list[TokenLogprob] = []
    previous = 0
    for entry, released in zip(seq.logprobs, seq.text_ends, strict=False):
        pending.append(entry)
        if released == previous:  # part of a character: it goes with the token ending it
            continue
        if released > start and previous < end:
            kept += pending
        pending = []
        previous = released
    return kept


def reasoning_item(item_id: str, text: str, status: ItemStatus, summary: bool) -> ReasoningOutput:
    """The reasoning as `content`; as `summary` too when the request asked for one
    (there is no summarizer: the summary is the reasoning)."""
    return ReasoningOutput(
        id=item_id,
        status=status,
        content=[ReasoningText(text=text)],
        summary=[SummaryText(text=text)] if summary else [],
    )


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: ItemStatus
) -> FunctionCallOutput:
    return FunctionCallOutput(
        id=item_id, call_id=call_id, name=name, arguments=arguments, status=status
    )


def final_status(finish_reason: str | None) -> tuple[str, IncompleteDetails | None]:
    """(response status, incomplete_details) of a finished choice."""
    if finish_reason == "length":
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    return "completed", None


def item_status(response_status: str) -> ItemStatus:
    return "incomplete" if response_status == "incomplete" else "completed"


def response_usage(usage: UsageInfo, reasoning_tokens: int) -> ResponseUsage:
    """Chat usage in Responses names; cached tokens are always reported (the Responses
    usage object always has them)."""
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        total_tokens=usage.total_tokens,
    )


def response_shell(
    response_id: str, request: ResponsesRequest, model_name: str, created_at: int
) -> ResponseObject:
    """The response as it starts (`in_progress`, no output): the request's settings echoed
    the way OpenAI echoes them."""
    choice = request.tool_choice
    tool_choice: str | dict[str, Any] = (
        choice.model_dump() if isinstance(choice, ToolChoiceFunction) else (choice or "auto")
    )
    fmt = request.text.format if request.text else None
    text: dict[str, Any] = {"format": {"type": "text"}}
    if fmt is not None:
        text = {"format": fmt.model_dump(by_alias=True, exclude_none=True)}
    return ResponseObject(
        id=response_id,
        created_at=created_at,
        status="in_progress",
        model=model_name,
        instructions=request.instructions,
        previous_response_id=request.previous_response_id,
        tools=[t.model_dump(exclude_none=True) for t in request.tools or ()],
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        temperature=request.temperature,
        top_p=request.top_p,
        max_output_tokens=request.max_output_tokens,
        max_tool_calls=request.max_tool_calls,
        text=text,
        reasoning=request.reasoning.model_dump(exclude_none=True) if request.reasoning else None,
        store=request.store,
        metadata=request.metadata or {},
        user=request.user,
    )


def assistant_message(items: list[OutputItem]) -> dict[str, Any]:
    """The output as the chat message a later turn replays (`previous_response_id`)."""
    text = "".join(
        part.text for item in items if isinstance(item, OutputMessage) for part in item.content
    )
    calls = [
        {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments},
        }
        for item in items
        if isinstance(item, FunctionCallOutput)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
        message["content"] = text or None
    return message
