"""Anthropic Messages: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A thin layer over `ServingChat` (docs/architecture.md, "Routes"): the request is
translated into a chat request (`anthropic_convert.py`), started and read back through
the chat serving path (one renderer, one tool parser, one reasoning split), and its
answer or deltas become Anthropic's message or events. Every error it raises is
rendered in Anthropic's shape, also when the body came through `/invocations`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from typing import Any

from handlers.errors import ServingError
from handlers.protocol.anthropic import (
    CountTokensRequest,
    CountTokensResponse,
    MessageDelta,
    MessageDeltaEvent,
    MessageResponse,
    MessagesRequest,
    MessageStartEvent,
    MessageStopEvent,
    MessagesUsage,
    PingEvent,
)
from handlers.protocol.base import parse_request
from handlers.protocol.chat import ChatCompletionRequest
from handlers.serving.anthropic_convert import (
    message_from_chat,
    message_id,
    messages_usage,
    stop_reason_of,
    to_chat_request,
)
from handlers.serving.anthropic_stream import ContentBlocks, error_event, named_event
from handlers.serving.base import Run
from handlers.serving.chat import ServingChat
from handlers.serving.chat_template import ChatTemplateChoice
from handlers.serving.context import RequestContext
from handlers.serving.sse import SSEPayload, SSEStream


@contextmanager
def anthropic_dialect() -> Iterator[None]:
    """Errors raised inside are answered in Anthropic's shape."""
    try:
        yield
    except ServingError as exc:
        exc.dialect = "anthropic"
        raise


class ServingMessages:
    def __init__(self, chat: ServingChat) -> None:
        self.chat = chat

    async def create_from_body(self, body: Any, ctx: RequestContext) -> MessageResponse | SSEStream:
        """Validate a decoded body (model optional: `/invocations`) and create."""
        with anthropic_dialect():
            request = parse_request(MessagesRequest, body, self.chat.served.limits)
        return await self.create(request, ctx)

    async def create(
        self, request: MessagesRequest, ctx: RequestContext
    ) -> MessageResponse | SSEStream:
        """Admit, then answer (or return the admitted event stream)."""
        chat = self.chat
        with anthropic_dialect():
            chat_request = to_chat_request(request, chat.served.limits)
            thinking = request.thinking
            budget = thinking.budget_tokens if thinking and thinking.type == "enabled" else None
            run, template = await chat.start(chat_request, ctx, advisory_thinking_budget=budget)
            if request.stream:
                events = self._events(run, chat_request, template)
                return chat.sse(run, events, error_for=error_event, done=False)
            return message_from_chat(await chat.respond(run, chat_request, template))

    async def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        """The prompt tokens `create` would admit for the same body (same rendering)."""
        chat = self.chat
        with anthropic_dialect():
            chat.model_name(request.model)
            chat_request = to_chat_request(request, chat.served.limits)
            _, _, prompt_ids = await chat.render_prompt(chat_request)
        return CountTokensResponse(input_tokens=len(prompt_ids))

    async def _events(
        self, run: Run, request: ChatCompletionRequest, template: ChatTemplateChoice
    ) -> AsyncGenerator[SSEPayload, None]:
        """message_start, a ping, the content blocks, message_delta (stop reason and
        usage), message_stop. A keep-alive tick (--sse-keep-alive-interval) is
        Anthropic's own `ping` event."""
        start = MessageResponse(
            id=message_id(run.response_id),
            model=run.model_name,
            content=[],
            usage=MessagesUsage(input_tokens=sum(run.prompt_lens), output_tokens=0),
        )
        yield named_event(MessageStartEvent(message=start))
        yield named_event(PingEvent())
        blocks = ContentBlocks()
        stop_reason, stop_sequence = None, None
        async for item in self.chat.message_deltas(run, request, template):
            if item is None:
                yield named_event(PingEvent())
                continue
            _, delta, message, finish = item
            for event in blocks.feed(message):
                yield named_event(event)
            if finish is not None:
                stop_reason, stop_sequence = stop_reason_of(finish, delta.stop_reason)
        for event in blocks.close():
            yield named_event(event)
        include_cached = self.chat.served.config.enable_prompt_tokens_details
        usage = messages_usage(run.usage(include_cached=include_cached))
        delta_event = MessageDeltaEvent(
            delta=MessageDelta(stop_reason=stop_reason, stop_sequence=stop_sequence), usage=usage
        )
        yield named_event(delta_event)
        yield named_event(MessageStopEvent())
