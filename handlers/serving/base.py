"""Shared steps of the generating serving classes: request ids, fan-out admission,
sequence setup and the SSE/stats bookkeeping around a Generation."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from collections.abc import Sequence as SequenceT
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec

from engine.client import RequestStream
from engine.sampling_params import SamplingParams
from handlers.errors import InternalServerError, ServingError, from_engine_error
from handlers.protocol.base import PromptTokensDetails, UsageInfo
from handlers.protocol.sampling import SamplingRequest, seed_for_choice
from handlers.serving.choice import Choice, ChoiceDelta, ChoiceOptions
from handlers.serving.context import RequestContext
from handlers.serving.generation import Generation
from handlers.serving.served_model import ServedModel
from handlers.serving.sse import DONE, SSEStream, encode_error
from handlers.serving.stats import NullStatsSink, RequestTracker, StatsSink

logger = logging.getLogger(__name__)


class ServingBase:
    """Base of ServingChat, ServingCompletion and ServingTGI."""

    kind = "generate"

    def __init__(self, served: ServedModel, stats: StatsSink | None = None) -> None:
        self.served = served
        self.stats: StatsSink = stats or NullStatsSink()

    @property
    def keep_alive(self) -> float:
        return self.served.config.sse_keep_alive_interval

    # -- ids --------------------------------------------------------------------------
    @staticmethod
    def request_ids(
        prefix: str, ctx: RequestContext, body_request_id: str | None = None
    ) -> tuple[str, str]:
        """(response id, engine id base).

        The client's id (`X-Request-Id` header, else the body's `request_id`) names the
        response as in vLLM; the engine ids get a random suffix too, because two clients
        may well send the same id and the engine needs unique ones.
        """
        client_id = ctx.request_id or body_request_id
        if client_id:
            response_id = f"{prefix}-{client_id}"
            return response_id, f"{response_id}-{uuid.uuid4().hex[:8]}"
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        return response_id, response_id

    # -- admission --------------------------------------------------------------------
    async def admit(
        self,
        engine_id: str,
        prompts: SequenceT[list[int]],
        params: SequenceT[SamplingParams],
        priority: int = 0,
    ) -> Generation:
        """Admit one engine request per choice (`<engine_id>-<i>`), all or none.

        Admission is answered by the engine before this returns, so a full queue is a
        503 before any status line. If one choice is refused, the admitted ones are
        aborted at once: a refused request holds no KV blocks.
        """
        results = await asyncio.gather(
            *(
                self.served.engine.add_request(f"{engine_id}-{i}", prompt, param, priority)
                for i, (prompt, param) in enumerate(zip(prompts, params, strict=True))
            ),
            return_exceptions=True,
        )
        streams = [r for r in results if isinstance(r, RequestStream)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is None:
            return Generation(streams, self.keep_alive)
        for stream in streams:
            await stream.aclose()
        mapped = from_engine_error(failure)
        if mapped is not None:
            raise mapped from None
        raise failure

    async def start_run(
        self,
        ctx: RequestContext,
        *,
        response_id: str,
        engine_id: str,
        model_name: str,
        prompts: SequenceT[list[int]],
        params: SequenceT[SamplingParams],
        sequences: list[Choice],
        n: int = 1,
        priority: int = 0,
    ) -> Run:
        """Start tracking, admit n choices of every prompt (all or none) and bundle them.

        One path for chat, completion and TGI, so that the engine ids, per-choice seeds
        and the choice -> prompt mapping (`i // n`) that `Run` relies on always agree.
        """
        tracker = self.tracker(response_id, ctx)
        generation = await self.admit(
            engine_id,
            [prompt for prompt in prompts for _ in range(n)],
            [choice for param in params for choice in self.choice_params(param, n)],
            priority,
        )
        return Run(
            response_id=response_id,
            model_name=model_name,
            generation=generation,
            sequences=sequences,
            tracker=tracker,
            prompt_lens=[len(prompt) for prompt in prompts],
            n=n,
        )

    def usage(self, run: Run) -> UsageInfo:
        """The run's usage as responses report it (cached tokens when the server says so)."""
        return run.usage(include_cached=self.served.config.enable_prompt_tokens_details)

    # -- sequences --------------------------------------------------------------------
    def sequence_options(self, request: SamplingRequest) -> ChoiceOptions:
        stop_ids = set(request.stop_token_ids or ())
        if not request.ignore_eos:
            stop_ids.update(self.served.info().eos_token_ids)
        return ChoiceOptions(
            skip_special_tokens=request.skip_special_tokens,
            stop=request.stop,
            include_stop_str_in_output=request.include_stop_str_in_output,
            min_tokens=request.min_tokens,
            stop_token_ids=frozenset(stop_ids),
        )

    def new_sequences(self, count: int, options: ChoiceOptions) -> list[Choice]:
        tokenizer = self.served.tokenizer()
        return [Choice(i, tokenizer, options) for i in range(count)]

    @staticmethod
    def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
        """n copies, seed + i each (identical seeds would give n identical choices)."""
        if params.seed is None:
            return [params] * n
        return [
            msgspec.structs.replace(params, seed=seed_for_choice(params.seed, i)) for i in range(n)
        ]

    def tracker(self, request_id: str, ctx: RequestContext) -> RequestTracker:
        return RequestTracker(self.stats, request_id, self.kind, ctx.arrival_time)

    # -- running ----------------------------------------------------------------------
    async def drive(self, run: Run) -> AsyncGenerator[tuple[Choice, ChoiceDelta] | None, None]:
        """Each choice's deltas as the engine produces them (None: keep-alive tick); a
        choice whose stop string matched is aborted in the engine right away."""
        async with aclosing(run.generation.events()) as events:
            async for event in events:
                if event is None:
                    yield None
                    continue
                index, output = event
                sequence = run.sequences[index]
                delta = sequence.process(output)
                run.tracker.on_output(index, len(delta.token_ids))
                if sequence.stopped_by_string:
                    await run.generation.finish(index)
                yield sequence, delta

    async def collect(self, run: Run) -> None:
        """Run every choice to its end (non-streaming responses)."""
        status = "aborted"
        try:
            async with aclosing(self.drive(run)) as deltas:
                async for _ in deltas:
                    pass
            status = "ok"
        except Exception as exc:
            status = "error"
            mapped = from_engine_error(exc)
            if mapped is not None:
                raise mapped from None
            raise
        finally:
            await run.generation.aclose()
            self.finish_run(run, status)

    async def sse(
        self,
        run: Run,
        *,
        head: list[bytes],
        chunk_for: Callable[[Choice, ChoiceDelta], bytes | None],
        tail: Callable[[], list[bytes]],
        error_for: Callable[[ServingError], bytes] = encode_error,
        done: bool = True,
    ) -> SSEStream:
        """The SSE payloads of a run: head, one chunk per delta, tail, then `[DONE]`.

        A failure after the status line becomes one error event (then `[DONE]`). When
        the transport stops iterating (client gone), the `finally` aborts what is left.
        """
        status = "aborted"
        try:
            for payload in head:
                yield payload
            async with aclosing(self.drive(run)) as deltas:
                async for item in deltas:
                    if item is None:
                        yield None
                        continue
                    chunk = chunk_for(*item)
                    if chunk is not None:
                        yield chunk
            for payload in tail():
                yield payload
            status = "ok"
        except Exception as exc:
            status = "error"
            error = stream_error(exc)
            if error.status >= 500 and not isinstance(exc, ServingError):
                logger.exception("request %s failed while streaming", run.response_id)
            yield error_for(error)
        finally:
            await run.generation.aclose()
            self.finish_run(run, status)
        if done:
            yield DONE

    @staticmethod
    def finish_run(run: Run, status: str) -> None:
        for sequence in run.sequences:
            sequence.abandon("error" if status == "error" else "abort")
        run.tracker.finish(
            status,
            num_prompt_tokens=sum(run.prompt_lens),
            num_output_tokens=sum(len(s.token_ids) for s in run.sequences),
            num_cached_tokens=sum(
                run.sequences[p * run.n].num_cached_tokens for p in range(len(run.prompt_lens))
            ),
            finish_reasons=[s.finish_reason or "abort" for s in run.sequences],
        )


def stream_error(exc: BaseException) -> ServingError:
    """What a failure after the status line becomes (an SSE error event)."""
    mapped = from_engine_error(exc)
    if mapped is not None:
        return mapped
    return InternalServerError("Internal server error while generating the response.")


@dataclass(slots=True)
class Run:
    """An admitted API request: its engine streams, choices and bookkeeping."""

    response_id: str
    model_name: str
    generation: Generation
    sequences: list[Choice]
    tracker: RequestTracker
    prompt_lens: list[int]
    """Prompt tokens of each prompt (one for chat; one per prompt of a batch)."""
    n: int
    """Choices per prompt; choice i belongs to prompt i // n."""
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self, *, include_cached: bool) -> UsageInfo:
        completion_tokens = sum(len(s.token_ids) for s in self.sequences)
        prompt_tokens = sum(self.prompt_lens)
        usage = UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        if include_cached:
            cached = sum(
                self.sequences[p * self.n].num_cached_tokens for p in range(len(self.prompt_lens))
            )
            usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached)
        return usage
