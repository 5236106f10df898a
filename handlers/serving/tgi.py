"""TGI's generate API on /invocations, for clients written against HF's SageMaker
TGI containers: `[{"generated_text": ...}]`, or TGI's token events when streaming."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import orjson

from engine.messages import TokenLogprob
from handlers.errors import ServingError
from handlers.protocol.tgi import (
    TGIDetails,
    TGIPrefillToken,
    TGIRequest,
    TGIResponse,
    TGIResponses,
    TGIStreamDetails,
    TGIStreamResponse,
    TGIToken,
)
from handlers.serving.base import Run, ServingBase
from handlers.serving.choice import Choice, ChoiceOptions
from handlers.serving.context import RequestContext
from handlers.serving.sse import SSEPayload, SSEStream, encode_chunk


def _finish_reason(seq: Choice) -> str:
    if seq.finish_reason == "stop":
        return "stop_sequence" if seq.stopped_by_string else "eos_token"
    return "length"


def _tgi_error(error: ServingError) -> bytes:
    return orjson.dumps({"error": error.message, "error_type": "generation"})


class ServingTGI(ServingBase):
    kind = "tgi"
    id_prefix = "tgi"

    async def generate(self, request: TGIRequest, ctx: RequestContext) -> TGIResponses | SSEStream:
        model_name = self.model_name(None)  # TGI bodies name no model
        prompts = await self.tokenize_prompts(
            [request.inputs],
            add_special_tokens=True,
            field="inputs",
            truncation=self.served.truncation(
                request.parameters.truncate, param="parameters.truncate"
            ),
        )
        run = await self.start_run(
            ctx,
            model_name=model_name,
            prompts=prompts,
            build_params=request.to_sampling_params,
            # NOTE: TGI keeps the stop sequence in the generated text.
            options=ChoiceOptions(stop=request.parameters.stop, include_stop_str_in_output=True),
        )
        if request.stream:
            return self._stream(run, request)
        return await self._respond(run, request)

    def _token(self, token_id: int, text: str, logprob: float | None) -> TGIToken:
        special = token_id in self.served.tokenizer().all_special_ids
        return TGIToken(id=token_id, text=text, logprob=logprob, special=special)

    async def _respond(self, run: Run, request: TGIRequest) -> TGIResponses:
        await self.collect(run)
        seq = run.sequences[0]
        p = request.parameters
        text = (request.inputs if p.return_full_text else "") + seq.text
        details = None
        if p.details:
            texts = self.served.token_texts()
            logprobs = {i: lp.logprob for i, lp in enumerate(seq.logprobs)}
            details = TGIDetails(
                finish_reason=_finish_reason(seq),
                generated_tokens=len(seq.token_ids),
                seed=p.seed,
                prefill=self._prefill(run, seq) if request.wants_prefill else [],
                tokens=[
                    self._token(tid, texts.text(tid), logprobs.get(i))
                    for i, tid in enumerate(seq.token_ids)
                ],
                top_tokens=[self._top_tokens(entry, p.top_n_tokens) for entry in seq.logprobs]
                if p.top_n_tokens
                else [],
            )
        return TGIResponses([TGIResponse(generated_text=text, details=details)])

    def _top_tokens(self, entry: TokenLogprob, n: int | None) -> list[TGIToken]:
        """TGI's `top_tokens` of one position: the n most likely, most likely first."""
        texts = self.served.token_texts()
        return [self._token(tid, texts.text(tid), lp) for tid, lp in entry.top[: n or 0]]

    def _prefill(self, run: Run, seq: Choice) -> list[TGIPrefillToken]:
        """`decoder_input_details`: each prompt token with its logprob (the first: none)."""
        texts = self.served.token_texts()
        entries = seq.prompt_logprobs or []
        out = []
        for i, token_id in enumerate(run.prompt_token_ids[0]):
            entry = entries[i] if i < len(entries) else None
            logprob = entry.logprob if entry is not None else None
            out.append(TGIPrefillToken(id=token_id, text=texts.text(token_id), logprob=logprob))
        return out

    def _stream(self, run: Run, request: TGIRequest) -> SSEStream:
        # TGI streams end without `[DONE]`, and report errors in TGI's own shape.
        return self.sse(run, self._events(run, request), error_for=_tgi_error, done=False)

    async def _events(self, run: Run, request: TGIRequest) -> AsyncGenerator[SSEPayload, None]:
        """One TGI token event per delta; the last carries the text and the details."""
        count = 0
        async for item in self.deltas(run, self.keep_alive):
            if item is None:
                yield None
                continue
            seq, delta = item
            if not delta.token_ids and not delta.finish_reason:
                continue
            ids = delta.token_ids or seq.token_ids[-1:] or [0]
            token_id = ids[-1]
            logprob = delta.logprobs[-1].logprob if delta.logprobs else None
            top_n = request.parameters.top_n_tokens
            event = TGIStreamResponse(
                index=count,
                token=self._token(token_id, delta.text, logprob),
                top_tokens=self._top_tokens(delta.logprobs[-1], top_n)
                if top_n and delta.logprobs
                else [],
                generated_text=seq.text if delta.finish_reason else None,
                details=TGIStreamDetails(
                    finish_reason=_finish_reason(seq),
                    generated_tokens=len(seq.token_ids),
                    seed=request.parameters.seed,
                )
                if delta.finish_reason
                else None,
            )
            count += 1
            yield encode_chunk(event)
