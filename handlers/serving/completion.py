"""Text completions: one or more prompts (text or token ids), n choices each."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from handlers.errors import InternalServerError
from handlers.protocol.completion import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from handlers.serving.base import PromptInput, Run, ServingBase
from handlers.serving.beam_search import beam_search_options
from handlers.serving.chat_template import reasoning_style
from handlers.serving.choice import Choice, ChoiceDelta
from handlers.serving.context import RequestContext
from handlers.serving.logprobs import completion_logprobs, prompt_logprobs
from handlers.serving.sse import SSEPayload, SSEStream
from handlers.serving.stream_chunks import StreamChunks


class ServingCompletion(ServingBase):
    """`POST /v1/completions` (and `/invocations` bodies with `prompt`)."""

    kind = "completion"
    id_prefix = "cmpl"

    async def create(
        self, request: CompletionRequest, ctx: RequestContext
    ) -> CompletionResponse | SSEStream:
        run, prompts = await self.start(request, ctx)
        echoes = [self._echo_text(request, p) for p in prompts]
        prompt_ids = [p.token_ids for p in prompts]
        if request.stream:
            return self._stream(run, request, echoes, prompt_ids)
        return await self._respond(run, request, echoes, prompt_ids)

    async def start(
        self, request: CompletionRequest, ctx: RequestContext
    ) -> tuple[Run, list[PromptInput]]:
        """Model check, tokenizing, the thinking budget's check, admission: the run and
        its prompts. `/inference/v1/generate` starts its runs here too (it is a
        completion of token ids with another answer shape)."""
        model_name = self.model_name(request.model)
        prompts = await self.tokenize(request)
        budget = request.thinking_budget
        harmony = False
        if budget is not None:
            served = self.served
            source = served.config.chat_template or served.tokenizer().chat_template
            reasoning, harmony = reasoning_style(served, source)
            budget = self.thinking_budget(budget, reasoning or harmony)
        run = await self.start_run(
            ctx,
            model_name=model_name,
            prompts=prompts,
            build_params=request.to_sampling_params,
            options=self.sequence_options(request),
            client_request_id=request.request_id,
            n=request.n,
            priority=request.priority,
            cache_salt=request.cache_salt,
            thinking_budget=budget,
            harmony=harmony,
            beam_search=beam_search_options(request),
        )
        return run, prompts

    async def tokenize(self, request: CompletionRequest) -> list[PromptInput]:
        """The request's prompts as the engine gets them (truncated as asked)."""
        return await self.tokenize_prompts(
            request.prompts(),
            add_special_tokens=request.add_special_tokens,
            field="prompt",
            truncation=self.served.truncation(
                request.truncate_prompt_tokens, request.truncation_side
            ),
        )

    def _echo_text(self, request: CompletionRequest, prompt: PromptInput) -> str:
        if not request.echo:
            return ""
        if prompt.text is not None:
            return prompt.text
        return self.served.tokenizer().decode(
            prompt.token_ids, skip_special_tokens=request.skip_special_tokens
        )

    def _logprobs(
        self, request: CompletionRequest, out: Choice | ChoiceDelta, offset: int
    ) -> CompletionLogProbs | None:
        """Logprobs of `out`'s tokens (a whole choice, or one delta of a stream)."""
        if request.logprobs is None:
            return None
        return completion_logprobs(
            out.logprobs or [],
            out.token_ids,
            self.served.token_texts(request.return_tokens_as_token_ids),
            request.logprobs,
            offset,
        )

    @staticmethod
    def _token_ids(
        request: CompletionRequest, prompt_ids: list[int] | None, token_ids: list[int]
    ) -> dict[str, list[int]]:
        """vLLM's `return_token_ids` fields of a choice (or of a streamed chunk: the
        prompt's ids only in a choice's first)."""
        if not request.return_token_ids:
            return {}
        fields = {"token_ids": list(token_ids)}
        if prompt_ids is not None:
            fields["prompt_token_ids"] = list(prompt_ids)
        return fields

    def _echo_logprobs(
        self, request: CompletionRequest, prompt_ids: list[int], out: Choice | ChoiceDelta
    ) -> CompletionLogProbs:
        """vLLM's echo with logprobs: the prompt's tokens (the first without a logprob)
        then the generated ones of `out`, in one list, offsets counted from the start of
        the prompt."""
        assert request.logprobs is not None
        if out.prompt_logprobs is None:
            raise InternalServerError("The engine returned no prompt logprobs for an echo.")
        return completion_logprobs(
            [*out.prompt_logprobs, *(out.logprobs or [])],
            [*prompt_ids, *out.token_ids],
            self.served.token_texts(request.return_tokens_as_token_ids),
            request.logprobs,
            0,
        )

    # -- non-streaming ----------------------------------------------------------------
    async def _respond(
        self,
        run: Run,
        request: CompletionRequest,
        echoes: list[str],
        prompt_ids: list[list[int]],
    ) -> CompletionResponse:
        await self.collect(run)
        choices = []
        texts = self.served.token_texts()
        for seq in run.sequences:
            echo = echoes[seq.index // run.n]
            if request.echo_logprobs:
                logprobs = self._echo_logprobs(request, prompt_ids[seq.index // run.n], seq)
            else:
                logprobs = self._logprobs(request, seq, len(echo))
            choices.append(
                CompletionResponseChoice(
                    index=seq.index,
                    text=echo + seq.text,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    prompt_logprobs=prompt_logprobs(seq.prompt_logprobs, texts)
                    if request.engine_prompt_logprobs is not None and seq.prompt_logprobs
                    else None,
                    **self._token_ids(request, prompt_ids[seq.index // run.n], seq.token_ids),
                )
            )
        return CompletionResponse(**self.envelope(run), choices=choices)

    # -- streaming --------------------------------------------------------------------
    def _stream(
        self,
        run: Run,
        request: CompletionRequest,
        echoes: list[str],
        prompt_ids: list[list[int]],
    ) -> SSEStream:
        return self.sse(run, self._chunks(run, request, echoes, prompt_ids))

    async def _chunks(
        self,
        run: Run,
        request: CompletionRequest,
        echoes: list[str],
        prompt_ids: list[list[int]],
    ) -> AsyncGenerator[SSEPayload, None]:
        """One chunk per delta (a choice's echo goes out with its first, with the prompt's
        logprobs when asked for), the usage tail."""
        chunks = StreamChunks(
            run,
            CompletionStreamResponse,
            request.stream_options,
            include_cached=self.served.config.enable_prompt_tokens_details,
        )
        pending_echo = {seq.index: echoes[seq.index // run.n] for seq in run.sequences}
        offsets = {index: len(text) for index, text in pending_echo.items()}
        async for item in self.deltas(run, self.keep_alive):
            if item is None:
                yield None
                continue
            seq, delta = item
            first = seq.index in pending_echo
            echo = pending_echo.pop(seq.index, "")
            text = echo + delta.text
            ids_asked = request.return_token_ids and delta.token_ids
            if not (text or delta.logprobs or delta.finish_reason or ids_asked):
                pending_echo[seq.index] = echo
                continue
            if first and request.echo_logprobs:
                # The echoed prompt goes out with its logprobs in the choice's first chunk.
                logprobs = self._echo_logprobs(request, prompt_ids[seq.index // run.n], delta)
            else:
                logprobs = self._logprobs(request, delta, offsets[seq.index])
            if logprobs is not None and logprobs.text_offset:
                last = logprobs.tokens[-1]
                offsets[seq.index] = logprobs.text_offset[-1] + len(last)
            choice_fields: dict[str, Any] = {
                "index": seq.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
            }
            if delta.finish_reason is not None:
                choice_fields["stop_reason"] = delta.stop_reason
            prompt = prompt_ids[seq.index // run.n] if first else None
            choice_fields |= self._token_ids(request, prompt, delta.token_ids)
            yield chunks.chunk(
                [CompletionResponseStreamChoice(**choice_fields)], chunks.running_usage()
            )
        for payload in chunks.tail():
            yield payload
