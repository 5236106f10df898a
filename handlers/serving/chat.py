"""Chat completions: render the conversation, admit n choices, answer or stream."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

from engine.messages import TokenLogprob
from handlers.errors import BadRequestError
from handlers.protocol.chat import (
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    DeltaMessage,
    FunctionCall,
    ToolCall,
)
from handlers.serving.base import PromptInput, Run, ServingBase
from handlers.serving.beam_search import beam_search_options
from handlers.serving.chat_template import ChatTemplateChoice, choose_chat_template
from handlers.serving.choice import Choice, ChoiceDelta
from handlers.serving.context import RequestContext
from handlers.serving.harmony import HarmonyStreamer, parse_harmony
from handlers.serving.logprobs import chat_logprobs, prompt_logprobs
from handlers.serving.reasoning import split_reasoning
from handlers.serving.render import render_chat
from handlers.serving.sse import SSEPayload, SSEStream
from handlers.serving.stream_chunks import StreamChunks
from handlers.serving.tool_render import forced_tool_spec, new_call_id, tool_calls_from_text
from handlers.serving.tool_stream import ReasoningStreamer, StreamPiece, ToolCallStreamer


class ServingChat(ServingBase):
    """`POST /v1/chat/completions` (and `/invocations` bodies with `messages`)."""

    kind = "chat"
    id_prefix = "chatcmpl"

    async def create(
        self, request: ChatCompletionRequest, ctx: RequestContext
    ) -> ChatCompletionResponse | SSEStream:
        """Validate against the model, admit, then answer (or return the SSE stream).

        Everything that can be refused is refused before this returns, so a streaming
        caller only ever starts a 200 response for an admitted request.
        """
        run, template = await self.start(request, ctx)
        if request.stream:
            return self._stream(run, request, template)
        return await self.respond(run, request, template)

    async def render_prompt(
        self, request: ChatCompletionRequest, *, offload: bool = False
    ) -> tuple[ChatTemplateChoice, str, list[int]]:
        """(template, prompt text, prompt ids): what `start` admits, and all that
        Anthropic's count_tokens needs, so the two can never count differently."""
        served = self.served
        template = choose_chat_template(served, request)
        prompt_text = await render_chat(served, request, template, documents=request.documents)
        # vLLM's truncation of a chat: the rendered prompt keeps k tokens (by default its
        # last: the system prompt and the oldest turns go first); the text is then what
        # is kept.
        prompt_ids, cut = await served.encode_prompt(
            prompt_text,
            served.truncation(request.truncate_prompt_tokens, request.truncation_side),
            add_special_tokens=request.add_special_tokens,
            param="messages",
            offload=offload,
        )
        if cut:
            prompt_text = served.tokenizer().decode(prompt_ids, skip_special_tokens=False)
        return template, prompt_text, prompt_ids

    async def start(
        self,
        request: ChatCompletionRequest,
        ctx: RequestContext,
        *,
        advisory_thinking_budget: int | None = None,
    ) -> tuple[Run, ChatTemplateChoice]:
        """Model check, render, forced-tool constraint, admission: the run and the
        template its output is parsed with. `/v1/messages` and `/v1/responses` start
        their runs here too and read them back through `respond` / `message_deltas` (one
        renderer, one tool parser, one reasoning split). `advisory_thinking_budget`
        (Anthropic's `budget_tokens`) caps reasoning where the model reasons in blocks
        (`<think>`, harmony's analysis channel) and is dropped elsewhere."""
        model_name = self.model_name(request.model)
        template, prompt_text, prompt_ids = await self.render_prompt(request)
        budget = self.thinking_budget(request.thinking_budget, template.reasons_in_blocks)
        if budget is None and template.reasons_in_blocks:
            budget = advisory_thinking_budget
        structured = forced_tool_spec(request)
        if structured is not None and request.use_beam_search:
            raise BadRequestError(
                "tool_choice: a forced tool call is a constrained generation, which beam "
                "search (use_beam_search) does not run; use tool_choice 'auto' or sampling",
                param="tool_choice",
            )
        options = self.sequence_options(request)
        if template.harmony:  # the parser reads the channels' special tokens
            options = dataclasses.replace(options, skip_special_tokens=False)
        run = await self.start_run(
            ctx,
            model_name=model_name,
            prompts=[PromptInput(prompt_ids, "messages", prompt_text)],
            build_params=lambda bounds: request.to_sampling_params(bounds, structured),
            options=options,
            client_request_id=request.request_id,
            n=request.n,
            priority=request.priority,
            cache_salt=request.cache_salt,
            thinking_budget=budget,
            harmony=template.harmony,
            beam_search=beam_search_options(request),
        )
        return run, template

    def _echo_text(self, request: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the last message's content, if it has the response role."""
        if not request.echo:
            return ""
        last = request.messages[-1]
        if last.role != self.served.config.response_role:
            return ""
        return last.text() or ""

    def _logprobs(
        self, request: ChatCompletionRequest, delta_logprobs: list[TokenLogprob] | None
    ) -> ChatCompletionLogProbs | None:
        if not request.logprobs:
            return None
        content = chat_logprobs(
            delta_logprobs or [],
            self.served.token_texts(request.return_tokens_as_token_ids),
            len(request.logprob_token_ids or ()) or request.top_logprobs or 0,
        )
        return ChatCompletionLogProbs(content=content)

    async def create_batch(
        self, requests: list[ChatCompletionRequest], ctx: RequestContext
    ) -> ChatCompletionResponse:
        """vLLM's `/v1/chat/completions/batch`: one request's conversations (validated
        one by one: `parse_batch_chat`) rendered, admitted together (all or none) and
        answered as one choice each, in order."""
        first = requests[0]
        model_name = self.model_name(first.model)
        rendered = []
        for request in requests:
            # Each conversation is tokenized on a thread and the loop gets a turn between
            # them, so a batch of many costs other requests no more than one does.
            rendered.append(await self.render_prompt(request, offload=len(requests) > 1))
            await asyncio.sleep(0)
        template = rendered[0][0]
        options = self.sequence_options(first)
        if template.harmony:
            options = dataclasses.replace(options, skip_special_tokens=False)
        run = await self.start_run(
            ctx,
            model_name=model_name,
            prompts=[
                PromptInput(ids, f"messages[{i}]", text)
                for i, (_, text, ids) in enumerate(rendered)
            ],
            build_params=first.to_sampling_params,
            options=options,
            client_request_id=first.request_id,
            priority=first.priority,
            cache_salt=first.cache_salt,
            thinking_budget=self.thinking_budget(first.thinking_budget, template.reasons_in_blocks),
            harmony=template.harmony,
            beam_search=beam_search_options(first),
        )
        await self.collect(run)
        choices = [
            self.finished_choice(request, chosen, seq, self._echo_text(request) + seq.text)
            for request, (chosen, _, _), seq in zip(requests, rendered, run.sequences, strict=True)
        ]
        return ChatCompletionResponse(**self.envelope(run), choices=choices)

    # -- non-streaming ----------------------------------------------------------------
    async def respond(
        self, run: Run, request: ChatCompletionRequest, template: ChatTemplateChoice
    ) -> ChatCompletionResponse:
        await self.collect(run)
        echo = self._echo_text(request)
        choices = [
            self.finished_choice(request, template, seq, echo + seq.text) for seq in run.sequences
        ]
        first = run.sequences[0].prompt_logprobs
        return ChatCompletionResponse(
            **self.envelope(run),
            choices=choices,
            prompt_logprobs=prompt_logprobs(first, self.served.token_texts()) if first else None,
            prompt_token_ids=run.prompt_token_ids[0] if request.return_token_ids else None,
            prompt_text=run.prompt_texts[0] if request.return_prompt_text else None,
        )

    def finished_choice(
        self,
        request: ChatCompletionRequest,
        template: ChatTemplateChoice,
        seq: Choice,
        text: str,
    ) -> ChatCompletionResponseChoice:
        """One finished choice: reasoning split off, tool calls parsed out of the text (the
        derender route builds its choices here too)."""
        reasoning = None
        if _parses_harmony(request, template):
            parsed = parse_harmony(text, _offered_tools(request))
            reasoning, content, calls = parsed.reasoning, parsed.content, parsed.calls
            text = content or ""
        else:
            if template.reasoning:
                reasoning, text = split_reasoning(text)
            content, calls = tool_calls_from_text(text, request, template.tool_format)
        finish = seq.finish_reason
        if calls and finish == "stop":
            finish = "tool_calls"
        if not request.include_reasoning:
            reasoning = None
        message = ChatMessage(
            role=self.served.config.response_role,
            content=content if calls else text,
            reasoning_content=reasoning,
            tool_calls=[
                ToolCall(
                    id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)
                )
                for c in calls
            ],
        )
        return ChatCompletionResponseChoice(
            index=seq.index,
            message=message,
            logprobs=self._logprobs(request, seq.logprobs),
            finish_reason=finish,
            stop_reason=seq.stop_reason,
            token_ids=list(seq.token_ids) if request.return_token_ids else None,
        )

    # -- streaming --------------------------------------------------------------------
    def _stream(
        self, run: Run, request: ChatCompletionRequest, template: ChatTemplateChoice
    ) -> SSEStream:
        return self.sse(run, self._chunks(run, request, template))

    async def _chunks(
        self, run: Run, request: ChatCompletionRequest, template: ChatTemplateChoice
    ) -> AsyncGenerator[SSEPayload, None]:
        """The role chunk of each choice, the echo, one chunk per delta, the usage tail."""
        chunks = StreamChunks(
            run,
            ChatCompletionChunk,
            request.stream_options,
            include_cached=self.served.config.enable_prompt_tokens_details,
        )
        chunk, running_usage = chunks.chunk, chunks.running_usage
        role = self.served.config.response_role
        for seq in run.sequences:
            first: dict[str, Any] = {}
            if request.return_token_ids and seq is run.sequences[0]:
                first["prompt_token_ids"] = run.prompt_token_ids[0]
            if request.return_prompt_text and seq is run.sequences[0]:
                first["prompt_text"] = run.prompt_texts[0]
            yield chunk(
                [
                    ChatCompletionChunkChoice(
                        index=seq.index,
                        delta=DeltaMessage(role=role, content=""),
                        logprobs=None,
                        finish_reason=None,
                    )
                ],
                running_usage(),
                **first,
            )
        echo = self._echo_text(request)
        if echo:
            for seq in run.sequences:
                yield chunk(
                    [
                        ChatCompletionChunkChoice(
                            index=seq.index,
                            delta=DeltaMessage(content=echo),
                            logprobs=None,
                            finish_reason=None,
                        )
                    ],
                    running_usage(),
                )
        async for item in self.message_deltas(run, request, template):
            if item is None:
                yield None
                continue
            seq, delta, message, finish = item
            if not request.include_reasoning and "reasoning_content" in message.model_fields_set:
                kept = message.model_fields_set - {"reasoning_content"}
                message = DeltaMessage(**{name: getattr(message, name) for name in kept})
                if not (kept or finish or delta.logprobs or request.return_token_ids):
                    continue  # a delta of reasoning alone says nothing here
            choice_fields: dict[str, Any] = {
                "index": seq.index,
                "delta": message,
                "logprobs": self._logprobs(request, delta.logprobs),
                "finish_reason": finish,
            }
            if delta.finish_reason is not None:
                choice_fields["stop_reason"] = delta.stop_reason
            if request.return_token_ids:
                choice_fields["token_ids"] = delta.token_ids
            yield chunk([ChatCompletionChunkChoice(**choice_fields)], running_usage())
        for payload in chunks.tail():
            yield payload

    async def message_deltas(
        self, run: Run, request: ChatCompletionRequest, template: ChatTemplateChoice
    ) -> AsyncGenerator[tuple[Choice, ChoiceDelta, DeltaMessage, str | None] | None, None]:
        """(choice, engine delta, message delta, finish reason) per delta that says
        something, through each choice's reasoning split and tool-call streamer; None
        for a keep-alive tick. The chat stream wraps these in chunks; the Messages and
        Responses streams in their typed events."""
        tools = {
            seq.index: ToolCallStreamer(request, template.tool_format) for seq in run.sequences
        }
        reasoning = {seq.index: ReasoningStreamer(template.reasoning) for seq in run.sequences}
        harmony = None
        if _parses_harmony(request, template):
            harmony = {seq.index: HarmonyStreamer(_offered_tools(request)) for seq in run.sequences}
        async for item in self.deltas(run, self.keep_alive):
            if item is None:
                yield None
                continue
            seq, delta = item
            # a delta with only token ids (a byte of a character still incomplete) says
            # nothing, unless the client asked for the ids
            ids_asked = request.return_token_ids and delta.token_ids
            if not (delta.text or delta.logprobs or delta.finish_reason or ids_asked):
                continue
            if harmony is not None:
                message, finish = _harmony_delta_message(delta, harmony[seq.index])
            else:
                message, finish = self._delta_message(delta, tools[seq.index], reasoning[seq.index])
            yield seq, delta, message, finish

    @staticmethod
    def _delta_message(
        delta: ChoiceDelta, tools: ToolCallStreamer, reasoning: ReasoningStreamer
    ) -> tuple[DeltaMessage, str | None]:
        """One delta's text through the reasoning split and the tool-call streamer; at
        the end both are flushed. Only fields with something to say are set (chunks are
        serialized with exclude_unset)."""
        thought, text = reasoning.feed(delta.text) if delta.text else ("", "")
        piece = tools.feed(text) if text else StreamPiece()
        finish = delta.finish_reason
        if finish is not None:
            more_thought, more_text = reasoning.finish()
            thought += more_thought
            tail = tools.feed(more_text) if more_text else StreamPiece()
            end = tools.finish()
            piece = StreamPiece(
                content=piece.content + tail.content + end.content,
                tool_calls=piece.tool_calls + tail.tool_calls + end.tool_calls,
            )
            if tools.num_calls and finish == "stop":
                finish = "tool_calls"
        fields: dict[str, Any] = {}
        if piece.content:
            fields["content"] = piece.content
        if thought:
            fields["reasoning_content"] = thought
        if piece.tool_calls:
            fields["tool_calls"] = piece.tool_calls
        return DeltaMessage(**fields), finish


def _parses_harmony(request: ChatCompletionRequest, template: ChatTemplateChoice) -> bool:
    """Harmony channels are parsed unless a tool is forced (named or required): then the
    output is the constrained call JSON itself, read as for every other format."""
    if not template.harmony:
        return False
    return not request.tools or request.effective_tool_choice in ("auto", "none")


def _offered_tools(request: ChatCompletionRequest) -> set[str]:
    """The tools a harmony call may name (none under tool_choice "none")."""
    if not request.tools or request.effective_tool_choice == "none":
        return set()
    return {t.function.name for t in request.tools}


def _harmony_delta_message(
    delta: ChoiceDelta, streamer: HarmonyStreamer
) -> tuple[DeltaMessage, str | None]:
    """`ServingChat._delta_message` for harmony outputs: one streamer does the reasoning,
    content and tool-call split."""
    thought, text, calls = streamer.feed(delta.text) if delta.text else ("", "", [])
    finish = delta.finish_reason
    if finish is not None:
        more_thought, more_text, more_calls = streamer.finish()
        thought, text, calls = thought + more_thought, text + more_text, calls + more_calls
        if streamer.num_calls and finish == "stop":
            finish = "tool_calls"
    fields: dict[str, Any] = {}
    if text:
        fields["content"] = text
    if thought:
        fields["reasoning_content"] = thought
    if calls:
        fields["tool_calls"] = calls
    return DeltaMessage(**fields), finish
