"""Chat message deltas into Anthropic's content-block events.

Anthropic streams a message as numbered content blocks, each opened
(`content_block_start`), filled (`content_block_delta`: `thinking_delta`, `text_delta`
or `input_json_delta`) and closed (`content_block_stop`) before the next one opens.
`ContentBlocks` follows the chat stream's delta fields in the order one delta carries
them (reasoning, content, tool calls) and opens a new block whenever the kind changes
or a new tool call starts (a `DeltaToolCall` with an id).
"""

from __future__ import annotations

import orjson

from handlers.errors import ServingError, anthropic_error_body
from handlers.protocol.anthropic import (
    ContentBlock,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJsonDelta,
    StreamEvent,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
)
from handlers.protocol.chat import DeltaMessage
from handlers.serving.anthropic_convert import tool_use_id
from handlers.serving.sse import SSEEvent


def named_event(event: StreamEvent) -> SSEEvent:
    """An event as SSE: its `type` is also the `event:` name the SDKs dispatch on."""
    return SSEEvent(event.type, event.__pydantic_serializer__.to_json(event))


def error_event(error: ServingError) -> SSEEvent:
    """A failure after the status line: Anthropic's `error` event."""
    return SSEEvent("error", orjson.dumps(anthropic_error_body(error.message, error.status)))


class ContentBlocks:
    """The open block of one streamed message and the index of the next."""

    def __init__(self) -> None:
        self._open: str | None = None
        self._next_index = 0

    @property
    def _index(self) -> int:
        return self._next_index - 1

    def _start(self, block: ContentBlock) -> list[StreamEvent]:
        events = self.close()
        self._open = block.type
        self._next_index += 1
        events.append(ContentBlockStartEvent(index=self._index, content_block=block))
        return events

    def feed(self, message: DeltaMessage) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if message.reasoning_content:
            if self._open != "thinking":
                events += self._start(ThinkingBlock(thinking=""))
            delta = ThinkingDelta(thinking=message.reasoning_content)
            events.append(ContentBlockDeltaEvent(index=self._index, delta=delta))
        if message.content:
            if self._open != "text":
                events += self._start(TextBlock(text=""))
            text = TextDelta(text=message.content)
            events.append(ContentBlockDeltaEvent(index=self._index, delta=text))
        for call in message.tool_calls or ():
            if call.id is not None:
                block = ToolUseBlock(
                    id=tool_use_id(call.id), name=call.function.name or "", input={}
                )
                events += self._start(block)
            arguments = call.function.arguments
            if arguments and self._open == "tool_use":
                partial = InputJsonDelta(partial_json=arguments)
                events.append(ContentBlockDeltaEvent(index=self._index, delta=partial))
        return events

    def close(self) -> list[StreamEvent]:
        """Close the open block, if any."""
        if self._open is None:
            return []
        self._open = None
        return [ContentBlockStopEvent(index=self._index)]
