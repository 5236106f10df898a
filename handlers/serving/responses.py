"""The OpenAI Responses API over the chat path: `POST /v1/responses`, `GET` / `DELETE
/v1/responses/{id}` and `POST /v1/responses/{id}/cancel`.

A Responses request becomes a chat request (`responses_input.py`) that `ServingChat`
renders, admits and runs exactly as `/v1/chat/completions` would: one renderer, one tool
parser, one reasoning parser. Its result becomes output items (`responses_output.py`),
its delta stream the typed events (`responses_stream.py`). With `store` (the default)
the finished response and its conversation go into the store the API workers share
(`response_store.py`), which `previous_response_id` and `GET` read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from engine.messages import TokenLogprob
from handlers.errors import BadRequestError, NotFoundError, ServingError
from handlers.protocol.base import RequestLimits
from handlers.protocol.chat import (
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from handlers.protocol.responses import (
    OutputItem,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from handlers.serving.base import Run, stream_error
from handlers.serving.chat import ServingChat
from handlers.serving.chat_template import ChatTemplateChoice
from handlers.serving.context import RequestContext
from handlers.serving.logprobs import chat_logprobs
from handlers.serving.response_store import ResponseStore, StoredResponse
from handlers.serving.responses_background import BackgroundRuns
from handlers.serving.responses_input import chat_request, input_messages, responses_params
from handlers.serving.responses_output import (
    assistant_message,
    failed_response,
    final_status,
    function_call_item,
    item_status,
    message_item,
    new_id,
    reasoning_item,
    response_shell,
    response_usage,
    text_token_logprobs,
)
from handlers.serving.responses_replay import EventLog, follow
from handlers.serving.responses_stream import ResponseEvents
from handlers.serving.sse import SSEPayload, SSEStream

logger = logging.getLogger(__name__)


class ServingResponses:
    """`/v1/responses` (and `/invocations` bodies with `input`)."""

    def __init__(self, chat: ServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store
        self.background = BackgroundRuns(store)

    @property
    def limits(self) -> RequestLimits:
        return self.chat.served.limits

    async def create(
        self, request: ResponsesRequest, ctx: RequestContext
    ) -> ResponseObject | SSEStream:
        """Refuses what it must before it returns (as chat does), so a stream only starts
        for an admitted request."""
        if request.background and not self.chat.served.config.background_responses:
            raise BadRequestError(
                "background responses need a long-running server (this one stops between "
                "invocations); send the request without background",
                param="background",
            )
        if request.background and not self.store.enabled:
            raise BadRequestError(
                "background responses are read back from the response store, which this "
                "server keeps off (--responses-store-max-entries 0)",
                param="background",
            )
        history = await self._history(request.previous_response_id)
        chat = chat_request(request, history, self.limits)
        with responses_params():
            run, template = await self.chat.start(chat, ctx)
        shell = response_shell(new_id("resp"), request, run.model_name, run.created)
        conversation = [*history, *input_messages(request)]
        if request.background:
            queued = await self._start_background(shell, run, chat, template, request, conversation)
            return follow(self.store, queued.id) if request.stream else queued
        if request.stream:
            events = ResponseEvents(shell, summary=request.wants_summary)
            return self.chat.sse(
                run,
                self._events(run, chat, template, events, request, conversation),
                error_for=events.failure,
                done=False,
            )
        with responses_params():
            answer = await self.chat.respond(run, chat, template)
        response = self._buffered(shell, answer, run, request)
        await self._store(request, response, conversation)
        return response

    async def as_chat(self, request: ResponsesRequest) -> ChatCompletionRequest:
        """The chat request `create` runs for `request` (its stored history included):
        what `/v1/responses/render` renders."""
        history = await self._history(request.previous_response_id)
        return chat_request(request, history, self.limits)

    async def retrieve(self, response_id: str) -> ResponseObject:
        return (await self._stored(response_id))[1]

    async def stream_stored(self, response_id: str, starting_after: int = -1) -> SSEStream:
        """`GET /v1/responses/{id}?stream=true`: the events of a background response
        created with `stream`, after `starting_after`, then as they come (from the store,
        so from any worker: `responses_replay.follow`). 404 when there is none; 400 for a
        response that was not streamed."""
        _, response = await self._stored(response_id)
        if not response.background or not await self.store.has_events(response_id):
            raise BadRequestError(
                "only a background response created with stream=true can be streamed; "
                "retrieve it without stream",
                param="stream",
            )
        return follow(self.store, response_id, starting_after)

    async def _stored(self, response_id: str) -> tuple[StoredResponse, ResponseObject]:
        """The stored entry and its response object; 404 when there is none."""
        stored = await self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored, ResponseObject.model_validate(stored.response)

    async def delete(self, response_id: str) -> ResponseDeleted:
        if not await self.store.delete(response_id):
            raise _not_found(response_id)
        return ResponseDeleted(id=response_id)

    async def cancel(self, response_id: str) -> ResponseObject:
        """Only background responses can be cancelled (OpenAI, vLLM); one still queued or
        running turns `cancelled` in the store, where the worker running it sees it
        (handlers/serving/responses_background.py). A finished one is returned as it is.
        404 when there is none."""
        stored, response = await self._stored(response_id)
        if not response.background:
            raise BadRequestError("Cannot cancel a synchronous response.", param="response_id")
        if response.status in ("queued", "in_progress"):
            response = response.model_copy(update={"status": "cancelled"})
            await self.store.put(
                response_id, response.__pydantic_serializer__.to_json(response), stored.messages
            )
        return response

    # -- background -------------------------------------------------------------------
    async def _start_background(
        self,
        shell: ResponseObject,
        run: Run,
        chat: ChatCompletionRequest,
        template: ChatTemplateChoice,
        request: ResponsesRequest,
        conversation: list[dict[str, Any]],
    ) -> ResponseObject:
        """Store the response `queued` and run it detached (`BackgroundRuns`); the
        answer is the queued response. Streamed, the run writes its events to the store
        (`responses_replay.EventLog`), the first ones before this returns."""
        queued = shell.model_copy(update={"status": "queued", "background": True})
        await self._store(request, queued, conversation)
        events = ResponseEvents(queued, summary=request.wants_summary) if request.stream else None
        log = EventLog(self.store, queued.id)

        async def finish(response: ResponseObject) -> None:
            stored = await self.store.get(queued.id)
            if stored is not None and stored.response.get("status") == "cancelled":
                return  # cancelled while it finished: the cancel stands
            await self._store(request, response, conversation)

        async def work() -> None:
            await self._store(
                request, queued.model_copy(update={"status": "in_progress"}), conversation
            )
            if events is not None:
                await streamed(events)
                return
            try:
                with responses_params():
                    answer = await self.chat.respond(run, chat, template)
                response = self._buffered(queued, answer, run, request)
            except ServingError as exc:
                response = failed_response(queued, exc.type, exc.message)
            await finish(response)

        async def streamed(events: ResponseEvents) -> None:
            status = "aborted"
            try:
                async for payload in self._events(
                    run, chat, template, events, request, conversation, store=finish
                ):
                    if payload is not None:
                        await log.add(payload)
                status = "ok"
            except Exception as exc:  # stored as failed; the stream's error, response.failed
                status = "error"
                error = stream_error(exc)
                if error.status >= 500 and not isinstance(exc, ServingError):
                    logger.exception("background response %s failed", queued.id)
                last = events.failure(error)
                await finish(events.response)
                for event in last:
                    await log.add(event)
            finally:
                await log.flush()
                self.chat.finish_run(run, status)

        async def stopped(reason: str) -> None:
            self.chat.finish_run(run, "aborted")
            if reason == "cancelled":
                return  # the store already says so
            failed = failed_response(
                queued, "server_shutdown", "The server shut down before the response finished."
            )
            await finish(failed)
            if events is not None:
                await log.add(events.failed(failed))

        if events is not None:
            for event in events.start():
                await log.add(event)
            await log.flush()
        self.background.start(queued.id, work, stopped)
        return queued

    # -- steps ------------------------------------------------------------------------
    async def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        if previous_response_id is None:
            return []
        stored = await self.store.get(previous_response_id)
        if stored is None:
            raise NotFoundError(
                f"Response with id '{previous_response_id}' not found (it was never stored, "
                "was deleted, or expired).",
                param="previous_response_id",
            )
        return stored.messages

    async def _store(
        self,
        request: ResponsesRequest,
        response: ResponseObject,
        conversation: list[dict[str, Any]],
    ) -> None:
        if not request.store:
            return
        messages = [*conversation, assistant_message(response.output)]
        await self.store.put(
            response.id, response.__pydantic_serializer__.to_json(response), messages
        )

    def _reasoning_tokens(self, items: list[OutputItem]) -> int:
        tokenizer = self.chat.served.tokenizer()
        return sum(
            len(tokenizer.encode(part.text, add_special_tokens=False))
            for item in items
            if item.type == "reasoning"
            for part in item.content
        )

    def _logprob_entries(
        self, entries: list[TokenLogprob], request: ResponsesRequest
    ) -> list[ChatCompletionLogProbsContent]:
        """Engine logprobs as the output text's entries (chat's `logprobs.content`
        shape, which is the Responses one), `top_logprobs` alternatives each."""
        return chat_logprobs(entries, self.chat.served.token_texts(), request.top_logprobs or 0)

    def _usage(self, run: Run, items: list[OutputItem]) -> ResponseUsage:
        return response_usage(run.usage(include_cached=True), self._reasoning_tokens(items))

    def _buffered(
        self,
        shell: ResponseObject,
        answer: ChatCompletionResponse,
        run: Run,
        request: ResponsesRequest,
    ) -> ResponseObject:
        choice = answer.choices[0]
        message = choice.message
        status, incomplete = final_status(choice.finish_reason)
        done = item_status(status)
        items: list[OutputItem] = []
        if message.reasoning_content:
            items.append(
                reasoning_item(new_id("rs"), message.reasoning_content, done, request.wants_summary)
            )
        if message.content or not message.tool_calls:
            logprobs = None
            if request.wants_logprobs:
                seq = run.sequences[0]
                entries = text_token_logprobs(
                    seq, message.content or "", message.reasoning_content or ""
                )
                logprobs = self._logprob_entries(entries, request)
            items.append(message_item(new_id("msg"), message.content or "", done, logprobs))
        for call in message.tool_calls:
            items.append(
                function_call_item(
                    new_id("fc"), call.id, call.function.name, call.function.arguments, done
                )
            )
        return shell.model_copy(
            update={
                "status": status,
                "output": items,
                "usage": self._usage(run, items),
                "incomplete_details": incomplete,
                "completed_at": int(time.time()) if status == "completed" else None,
            }
        )

    async def _events(
        self,
        run: Run,
        chat: ChatCompletionRequest,
        template: ChatTemplateChoice,
        events: ResponseEvents,
        request: ResponsesRequest,
        conversation: list[dict[str, Any]],
        store: Callable[[ResponseObject], Awaitable[None]] | None = None,
    ) -> AsyncGenerator[SSEPayload, None]:
        """The chat stream's message deltas (`ServingChat.message_deltas`: the same
        reasoning split and tool-call streamer) as typed events; the final response is
        stored by `store` (default: as any response) before its last event."""
        for event in events.start():
            yield event
        finish: str | None = None
        held: list[Any] = []
        """Logprobs of tokens that released no text yet (part of a character, or a
        possible stop string): the output text's if the text they end in is content.
        Text the reasoning or tool parsers take as markup (``</think>``) is no content,
        and its tokens' entries are dropped."""
        async for item in self.chat.message_deltas(run, chat, template):
            if item is None:
                yield None
                continue
            _, delta, message, finish = item
            logprobs = None
            if request.wants_logprobs:
                tokens = [*held, *(delta.logprobs or [])]
                held = []
                if message.content and tokens:
                    logprobs = self._logprob_entries(tokens, request)
                elif not delta.text:
                    held = tokens  # nothing released: wait for the text they write
            for event in events.delta(message, logprobs=logprobs):
                yield event
        response, last = events.finish(finish, lambda items: self._usage(run, items))
        if store is None:
            await self._store(request, response, conversation)
        else:
            await store(response)
        for event in last:
            yield event


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
