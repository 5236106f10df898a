"""`POST /inference/v1/generate` (vLLM's token-in-token-out route): token ids in, token ids
out, through the completion path's checks, sequences and stop rules.

The request is checked as the completion it is (`GenerateRequest.to_completion_body`);
the answer is vLLM's generate shape: choices carry `token_ids` (and `text` with
`output_mode: "text"`), logprobs name tokens by id, the stream sends one chunk per delta
with no id/created/model envelope, and a usage chunk when `stream_options` asks.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from typing import Any

from engine.messages import TokenLogprob
from handlers.errors import BadRequestError
from handlers.protocol.base import RequestLimits, parse_request
from handlers.protocol.chat import ChatCompletionLogProbs
from handlers.protocol.completion import CompletionRequest
from handlers.protocol.generate import (
    SAMPLING_FIELDS,
    GenerateChoice,
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamResponse,
    GenerateTextChoice,
)
from handlers.serving.base import Run
from handlers.serving.choice import Choice, ChoiceDelta
from handlers.serving.completion import ServingCompletion
from handlers.serving.context import RequestContext
from handlers.serving.logprobs import MIN_LOGPROB, chat_logprobs, prompt_logprobs
from handlers.serving.sse import SSEPayload, SSEStream, encode_chunk


class ServingGenerate(ServingCompletion):
    """A completion of token ids (`ServingCompletion.start`) answered in vLLM's generate
    shape."""

    kind = "generate"
    id_prefix = "generate-tokens"

    async def generate(
        self, request: GenerateRequest, ctx: RequestContext
    ) -> GenerateResponse | SSEStream:
        text_mode = request.output_mode == "text"
        if text_mode and not request.detokenize:
            raise BadRequestError(
                "output_mode 'text' needs sampling_params.detokenize to be true.",
                param="output_mode",
            )
        completion = _as_completion(request, self.served.limits)
        with _renamed_params():
            run, _ = await self.start(completion, ctx)
        if request.stream:
            return self.sse(run, self._chunks(run, request, completion))
        return await self._respond(run, request, completion)

    # -- answers ----------------------------------------------------------------------
    async def _respond(
        self, run: Run, request: GenerateRequest, completion: CompletionRequest
    ) -> GenerateResponse:
        await self.collect(run)
        text_mode = request.output_mode == "text"
        choices = [
            _choice(
                text_mode,
                seq.text,
                index=seq.index,
                finish_reason=seq.finish_reason or "stop",
                stop_reason=seq.stop_reason,
                token_ids=list(seq.token_ids),
                logprobs=self._logprobs(request, completion, seq.logprobs),
            )
            for seq in run.sequences
        ]
        first = run.sequences[0]
        texts = self.served.token_texts()
        return GenerateResponse(
            request_id=run.response_id,
            model=run.model_name,
            created=run.created,
            output_mode=request.output_mode,
            choices=choices,
            usage=run.usage(include_cached=self.served.config.enable_prompt_tokens_details),
            prompt_token_ids=run.prompt_token_ids[0] if request.return_token_ids else None,
            prompt_logprobs=prompt_logprobs(first.prompt_logprobs, texts)
            if completion.prompt_logprobs is not None and first.prompt_logprobs
            else None,
        )

    async def _chunks(
        self, run: Run, request: GenerateRequest, completion: CompletionRequest
    ) -> AsyncGenerator[SSEPayload, None]:
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        include_cached = self.served.config.enable_prompt_tokens_details
        prompt_ids = run.prompt_token_ids[0] if request.return_token_ids else None
        async for item in self.deltas(run, self.keep_alive):
            if item is None:
                yield None
                continue
            seq, delta = item
            if not (delta.token_ids or delta.finish_reason or delta.text):
                continue
            chunk = GenerateStreamResponse(
                request_id=run.response_id,
                output_mode=request.output_mode,
                choices=[self._delta_choice(request, completion, seq, delta)],
            )
            if prompt_ids is not None:
                chunk.prompt_token_ids = prompt_ids
                prompt_ids = None
            if continuous:
                chunk.usage = run.usage(include_cached=include_cached)
            yield encode_chunk(chunk)
        if include_usage:
            yield encode_chunk(
                GenerateStreamResponse(
                    request_id=run.response_id,
                    output_mode=request.output_mode,
                    choices=[],
                    usage=run.usage(include_cached=include_cached),
                )
            )

    def _delta_choice(
        self,
        request: GenerateRequest,
        completion: CompletionRequest,
        seq: Choice,
        delta: ChoiceDelta,
    ) -> GenerateChoice:
        return _choice(
            request.output_mode == "text",
            delta.text,
            index=seq.index,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason if delta.finish_reason is not None else None,
            token_ids=list(delta.token_ids),
            logprobs=self._logprobs(request, completion, delta.logprobs),
        )

    def _logprobs(
        self,
        request: GenerateRequest,
        completion: CompletionRequest,
        entries: list[TokenLogprob] | None,
    ) -> GenerateLogProbs | ChatCompletionLogProbs | None:
        """Tokens mode: vLLM's generate logprobs (ids, ranks; the sampled token first in
        `top_logprobs`, then the others in rank order, `max(k, 1)` in all). Text mode:
        chat's shape, with token strings and bytes."""
        k = completion.logprobs
        if k is None:
            return None
        entries = entries or []
        if request.output_mode == "text":
            return ChatCompletionLogProbs(
                content=chat_logprobs(entries, self.served.token_texts(), k)
            )
        return GenerateLogProbs(content=[_token_entry(entry, k) for entry in entries])


def _choice(text_mode: bool, text: str, **fields: Any) -> GenerateChoice:
    """A choice in the request's output mode: with its text in text mode only."""
    return GenerateTextChoice(text=text, **fields) if text_mode else GenerateChoice(**fields)


def _token_entry(entry: TokenLogprob, k: int) -> GenerateLogProbsContent:
    top = [GenerateLogProb(token_id=entry.token_id, logprob=_floor(entry.logprob), rank=entry.rank)]
    for rank, (token_id, logprob) in enumerate(entry.top, start=1):
        if token_id != entry.token_id:
            top.append(GenerateLogProb(token_id=token_id, logprob=_floor(logprob), rank=rank))
    return GenerateLogProbsContent(
        token_id=entry.token_id,
        logprob=_floor(entry.logprob),
        rank=entry.rank,
        top_logprobs=top[: max(k, 1)],
    )


def _floor(logprob: float) -> float:
    """vLLM's rule on this route: NaN and anything below the wire's floor (-inf) are it."""
    return MIN_LOGPROB if logprob != logprob else max(logprob, MIN_LOGPROB)


def _as_completion(request: GenerateRequest, limits: RequestLimits) -> CompletionRequest:
    """The request as a completion, its errors named by the generate request's fields."""
    with _renamed_params():
        return parse_request(CompletionRequest, request.to_completion_body(), limits)


@contextmanager
def _renamed_params() -> Iterator[None]:
    """A 400 raised by the completion rules names the field as the generate request
    spells it: `prompt` is `token_ids`, a sampling field is `sampling_params.<name>`."""
    try:
        yield
    except BadRequestError as exc:
        if exc.param:
            head = exc.param.split(".")[0].split("[")[0]
            if head == "prompt":
                exc.param = "token_ids" + exc.param[len("prompt") :]
            elif head in SAMPLING_FIELDS:
                exc.param = f"sampling_params.{exc.param}"
        raise
