"""The typed events of a streamed response, from the chat stream's deltas.

`ResponseEvents` turns the `DeltaMessage`s that the chat path makes of each engine output
(`ServingChat.message_deltas`: reasoning split, tool-call streamer) into OpenAI's event
sequence, numbering every event (`sequence_number`):

    response.created, response.in_progress,
    per output item, in order (one is open at a time):
      reasoning: output_item.added, [reasoning_summary_part.added],
                 reasoning_text.delta..., [reasoning_summary_text.delta...],
                 reasoning_text.done, [reasoning_summary_text.done, reasoning_summary_part.done],
                 output_item.done
      message:   output_item.added, content_part.added, output_text.delta...,
                 output_text.done, content_part.done, output_item.done
      call:      output_item.added, function_call_arguments.delta...,
                 function_call_arguments.done, output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it short)

A failure after the first event is one `error` event (`error`), as OpenAI sends it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel

from handlers.errors import ServingError
from handlers.protocol.chat import ChatCompletionLogProbsContent, DeltaMessage, DeltaToolCall
from handlers.protocol.responses import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    OutputItem,
    OutputItemEvent,
    OutputText,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningText,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponseUsage,
    SummaryDeltaEvent,
    SummaryDoneEvent,
    SummaryPartEvent,
    SummaryText,
    TextDeltaEvent,
    TextDoneEvent,
)
from handlers.serving.responses_output import (
    failed_response,
    final_status,
    function_call_item,
    item_status,
    message_item,
    new_id,
    reasoning_item,
)
from handlers.serving.sse import SSEEvent


@dataclass(slots=True)
class _OpenItem:
    kind: str
    """'reasoning', 'message' or 'function_call'."""
    item_id: str
    output_index: int
    text: str = ""
    """The text so far (reasoning, message text or call arguments)."""
    call_id: str = ""
    name: str = ""
    logprobs: list[ChatCompletionLogProbsContent] = field(default_factory=list)
    """A message's token logprobs so far (when the request includes them)."""


class ResponseEvents:
    """The event stream of one response; `items` and `response` are its final state."""

    def __init__(self, shell: ResponseObject, *, summary: bool) -> None:
        self.response = shell
        self.summary = summary
        self.items: list[OutputItem] = []
        self._open: _OpenItem | None = None
        self._sequence = 0

    def _event(self, model_type: type[BaseModel], kind: str, **fields: object) -> SSEEvent:
        event = model_type(type=kind, sequence_number=self._sequence, **fields)
        self._sequence += 1
        return SSEEvent(kind, event.__pydantic_serializer__.to_json(event))

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> list[SSEEvent]:
        """`response.created` (the response as it stands: `queued` in the background) and
        `response.in_progress`; nothing once they were made."""
        if self._sequence:
            return []
        running = self.response.model_copy(update={"status": "in_progress"})
        return [
            self._event(ResponseLifecycleEvent, "response.created", response=self.response),
            self._event(ResponseLifecycleEvent, "response.in_progress", response=running),
        ]

    def finish(
        self, finish_reason: str | None, usage_of: Callable[[list[OutputItem]], ResponseUsage]
    ) -> tuple[ResponseObject, list[SSEEvent]]:
        """Close the open item; the final response (its usage from `usage_of(items)`) and
        the events up to its last one (`response.completed` / `response.incomplete`),
        which the caller sends after storing the response."""
        status, incomplete = final_status(finish_reason)
        events: list[SSEEvent] = []
        if not self.items and self._open is None:
            events += self.delta(DeltaMessage(content=""), force_message=True)
        events += self._close(item_status(status))
        usage = usage_of(self.items)
        self.response = self.response.model_copy(
            update={
                "status": status,
                "output": self.items,
                "usage": usage,
                "incomplete_details": incomplete,
                "completed_at": int(time.time()) if status == "completed" else None,
            }
        )
        events.append(
            self._event(ResponseLifecycleEvent, f"response.{status}", response=self.response)
        )
        return self.response, events

    def failed(self, response: ResponseObject) -> SSEEvent:
        """`response.failed`: the run stopped before its end (the server shut down)."""
        self.response = response
        return self._event(ResponseLifecycleEvent, "response.failed", response=response)

    def failure(self, error: ServingError) -> list[SSEEvent]:
        """A failure after the stream began: the `error` event, then `response.failed`
        (the response with its error and the items completed before it), which ends the
        stream for the SDK's stream helper as `response.completed` would."""
        failed = failed_response(self.response, error.type, error.message, list(self.items))
        return [self.error(error), self.failed(failed)]

    def error(self, error: ServingError) -> SSEEvent:
        """The `error` event of a failure after the stream began."""
        return self._event(
            ErrorEvent, "error", code=error.type, message=error.message, param=error.param
        )

    # -- deltas -----------------------------------------------------------------------
    def delta(
        self,
        message: DeltaMessage,
        *,
        force_message: bool = False,
        logprobs: list[ChatCompletionLogProbsContent] | None = None,
    ) -> list[SSEEvent]:
        """The events of one chat delta: reasoning, then text (with the logprobs of the
        delta's tokens, when the request includes them), then tool calls."""
        events: list[SSEEvent] = []
        if message.reasoning_content:
            events += self._reasoning(message.reasoning_content)
        if message.content or force_message:
            events += self._text(message.content or "", logprobs or [])
        for call in message.tool_calls or ():
            events += self._tool_call(call)
        return events

    def _switch_to(self, kind: str, prefix: str, **call: str) -> tuple[_OpenItem, list[SSEEvent]]:
        """The open item of `kind`; when another kind (or, for calls, another call) is
        open, that one is closed and a new item opened (its `added` events)."""
        if self._open is not None and self._open.kind == kind and not call:
            return self._open, []
        events = self._close("completed")
        item = _OpenItem(kind, new_id(prefix), len(self.items), **call)
        self._open = item
        ids = {"item_id": item.item_id, "output_index": item.output_index}
        events.append(
            self._event(
                OutputItemEvent,
                "response.output_item.added",
                output_index=item.output_index,
                item=self._item(item, "in_progress"),
            )
        )
        part = {"message": OutputText(text=""), "reasoning": ReasoningText(text="")}.get(kind)
        if part is not None:  # a message's text, or a reasoning item's (as vLLM's stream)
            events.append(
                self._event(
                    ContentPartEvent,
                    "response.content_part.added",
                    content_index=0,
                    part=part,
                    **ids,
                )
            )
        if kind == "reasoning" and self.summary:
            events.append(
                self._event(
                    SummaryPartEvent,
                    "response.reasoning_summary_part.added",
                    summary_index=0,
                    part=SummaryText(text=""),
                    **ids,
                )
            )
        return item, events

    def _item(self, item: _OpenItem, status: str) -> OutputItem:
        """The item as it stands: empty while in progress, whole when done."""
        text = item.text if status != "in_progress" else ""
        if item.kind == "reasoning":
            return reasoning_item(item.item_id, text, status, self.summary and bool(text))
        if item.kind == "message":
            if status == "in_progress":
                return message_item(item.item_id, "", status).model_copy(update={"content": []})
            return message_item(item.item_id, text, status, item.logprobs)
        return function_call_item(item.item_id, item.call_id, item.name, text, status)

    def _reasoning(self, text: str) -> list[SSEEvent]:
        item, events = self._switch_to("reasoning", "rs")
        item.text += text
        ids = {"item_id": item.item_id, "output_index": item.output_index}
        events.append(
            self._event(
                ReasoningDeltaEvent,
                "response.reasoning_text.delta",
                content_index=0,
                delta=text,
                **ids,
            )
        )
        if self.summary:
            events.append(
                self._event(
                    SummaryDeltaEvent,
                    "response.reasoning_summary_text.delta",
                    summary_index=0,
                    delta=text,
                    **ids,
                )
            )
        return events

    def _text(self, text: str, logprobs: list[ChatCompletionLogProbsContent]) -> list[SSEEvent]:
        item, events = self._switch_to("message", "msg")
        if text:
            item.text += text
            item.logprobs += logprobs
            events.append(
                self._event(
                    TextDeltaEvent,
                    "response.output_text.delta",
                    item_id=item.item_id,
                    output_index=item.output_index,
                    content_index=0,
                    delta=text,
                    logprobs=logprobs,
                )
            )
        return events

    def _tool_call(self, call: DeltaToolCall) -> list[SSEEvent]:
        """A fragment with an id opens a call (chat's first fragment carries id and
        name); later fragments carry argument text."""
        events: list[SSEEvent] = []
        if call.id is not None:
            item, events = self._switch_to(
                "function_call", "fc", call_id=call.id, name=call.function.name or ""
            )
        elif self._open is None or self._open.kind != "function_call":
            return events
        item = self._open
        arguments = call.function.arguments
        if arguments:
            item.text += arguments
            events.append(
                self._event(
                    ArgumentsDeltaEvent,
                    "response.function_call_arguments.delta",
                    item_id=item.item_id,
                    output_index=item.output_index,
                    delta=arguments,
                )
            )
        return events

    def _close(self, status: str) -> list[SSEEvent]:
        """The `done` events of the open item, which joins `items`."""
        item = self._open
        if item is None:
            return []
        self._open = None
        ids = {"item_id": item.item_id, "output_index": item.output_index}
        events: list[SSEEvent] = []
        if item.kind == "reasoning":
            events.append(
                self._event(
                    ReasoningDoneEvent,
                    "response.reasoning_text.done",
                    content_index=0,
                    text=item.text,
                    **ids,
                )
            )
            events.append(
                self._event(
                    ContentPartEvent,
                    "response.content_part.done",
                    content_index=0,
                    part=ReasoningText(text=item.text),
                    **ids,
                )
            )
            if self.summary:
                events.append(
                    self._event(
                        SummaryDoneEvent,
                        "response.reasoning_summary_text.done",
                        summary_index=0,
                        text=item.text,
                        **ids,
                    )
                )
                events.append(
                    self._event(
                        SummaryPartEvent,
                        "response.reasoning_summary_part.done",
                        summary_index=0,
                        part=SummaryText(text=item.text),
                        **ids,
                    )
                )
        elif item.kind == "message":
            events.append(
                self._event(
                    TextDoneEvent,
                    "response.output_text.done",
                    content_index=0,
                    text=item.text,
                    logprobs=item.logprobs,
                    **ids,
                )
            )
            events.append(
                self._event(
                    ContentPartEvent,
                    "response.content_part.done",
                    content_index=0,
                    part=OutputText(text=item.text, logprobs=item.logprobs),
                    **ids,
                )
            )
        else:
            events.append(
                self._event(
                    ArgumentsDoneEvent,
                    "response.function_call_arguments.done",
                    name=item.name,
                    arguments=item.text,
                    **ids,
                )
            )
        done = self._item(item, status)
        self.items.append(done)
        events.append(
            self._event(
                OutputItemEvent,
                "response.output_item.done",
                output_index=item.output_index,
                item=done,
            )
        )
        return events
