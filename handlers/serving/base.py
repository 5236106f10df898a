"""Shared steps of the generating serving classes: request ids, fan-out admission,
choice setup, and the one loop and the one try/finally every response runs in.

The streaming path is flat (docs/architecture.md, "One request"): the engine client's
IPC reader puts outputs into the request's `OutputCollector`; `deltas()` takes them,
folds each into its `Choice` and yields the deltas; an endpoint's stream is a plain
async generator of chunks over `deltas()`, run inside `sse()`, whose `finally` aborts
whatever is still running and records the request's stats.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.collector import OutputCollector
from engine.messages import PoolingParams
from engine.sampling_params import SamplingParams, ThinkingBudget
from handlers.errors import (
    BadRequestError,
    InternalServerError,
    RequestTimeoutError,
    ServingError,
    from_engine_error,
)
from handlers.protocol.base import PromptTokensDetails, UsageInfo
from handlers.protocol.sampling import SamplingBounds, SamplingRequest, seed_for_choice
from handlers.serving.beam_search import BeamSearch, BeamSearchOptions, search_collector
from handlers.serving.choice import Choice, ChoiceDelta, ChoiceOptions
from handlers.serving.context import RequestContext
from handlers.serving.served_model import ServedModel, Truncation, offloads
from handlers.serving.sse import DONE, SSEPayload, SSEStream, encode_error
from handlers.serving.stats import NullStatsSink, RequestTracker, StatsSink

logger = logging.getLogger(__name__)

ErrorEncoder = Callable[[ServingError], SSEPayload | list[SSEPayload]]
"""A stream's failure as its API sends one: an event, or several (the Responses API's
`error` then `response.failed`)."""


@dataclass(frozen=True, slots=True)
class PromptInput:
    """One prompt of a request, tokenized."""

    token_ids: list[int]
    param: str
    """The request field a bad prompt is reported against ('messages', 'prompt[1]')."""
    text: str | None = None
    """The prompt as text when there is one (the log line and completion's echo show
    it; token-id prompts are logged as ids)."""

    @property
    def logged(self) -> str | list[int]:
        return self.text if self.text is not None else self.token_ids


class ServingBase:
    """Base of ServingChat, ServingCompletion and ServingTGI."""

    kind = "generate"
    id_prefix = "gen"
    """Response ids are `<id_prefix>-...` (OpenAI's `chatcmpl-`, `cmpl-`)."""

    def __init__(self, served: ServedModel, stats: StatsSink | None = None) -> None:
        self.served = served
        self.stats: StatsSink = stats or NullStatsSink()

    @property
    def keep_alive(self) -> float | None:
        """Seconds between keep-alive ticks of a waiting stream; None (default): none."""
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
        *,
        pooling: PoolingParams | None = None,
        lora_name: str | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> OutputCollector:
        """Admit one engine request per choice (`<engine_id>-<i>`), all or none, into one
        collector (with `pooling`: embedding requests, one per prompt).

        Admission is answered by the engine before this returns, so a full queue is a
        503 before any status line. If one choice is refused, the admitted ones are
        aborted at once: a refused request holds no KV blocks.
        """
        engine = self.served.engine
        collector = OutputCollector(engine)
        results = await asyncio.gather(
            *(
                engine.add_request(
                    f"{engine_id}-{i}",
                    prompt,
                    param,
                    priority,
                    collector,
                    lora_name=lora_name,
                    pooling=pooling,
                    session_id=session_id,
                    cache_salt=cache_salt,
                    group=engine_id if len(prompts) > 1 else None,
                )
                for i, (prompt, param) in enumerate(zip(prompts, params, strict=True))
            ),
            return_exceptions=True,
        )
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is None:
            return collector
        collector.close()
        mapped = from_engine_error(failure)
        if mapped is not None:
            raise mapped from None
        raise failure

    @staticmethod
    def thinking_budget(budget: int | None, reasoning: bool) -> int | None:
        """`thinking_token_budget` for a model that reasons in blocks, `<think>` or
        harmony's analysis channel (400 naming the field for one that does not: there is
        no block to cap)."""
        if budget is not None and not reasoning:
            raise BadRequestError(
                "thinking_token_budget needs a model that reasons in <think> blocks (its "
                "chat template writes them, or --reasoning-parser think) or in harmony's "
                "analysis channel (gpt-oss); this one does neither.",
                param="thinking_token_budget",
            )
        return budget

    def model_name(self, requested: str | None) -> str:
        """The first step of every endpoint: the name to report (404 for a name this
        server does not serve), and a 503 while the engine is loading or gone."""
        name = self.served.resolve_name(requested)
        self.served.info()
        return name

    async def start_run(
        self,
        ctx: RequestContext,
        *,
        model_name: str,
        prompts: SequenceT[PromptInput],
        build_params: Callable[[SamplingBounds], SamplingParams],
        options: ChoiceOptions,
        client_request_id: str | None = None,
        n: int = 1,
        priority: int = 0,
        cache_salt: str | None = None,
        thinking_budget: int | None = None,
        harmony: bool = False,
        beam_search: BeamSearchOptions | None = None,
    ) -> Run:
        """Check each prompt's length, build its SamplingParams, then name the request,
        log its prompts, start tracking, admit n choices of every prompt (all or none)
        and bundle them.

        One path for chat, completion and TGI (the `create()` preamble they shared), so
        that the prompt checks, the bounds the params are built against, the engine ids,
        per-choice seeds and the choice -> prompt mapping (`i // n`) that `Run` relies
        on always agree. `harmony`: the output is harmony's channels, so a thinking
        budget caps the analysis channel.
        """
        served = self.served
        pooling = served.info().pooling
        if pooling is not None and pooling.classifier is not None:
            raise BadRequestError(
                "This model is a sequence classifier: it generates no text. It serves "
                "/classify, /score and /rerank.",
                param="model",
            )
        if ctx.adapter is not None:  # SageMaker's adapter header names the model run
            model_name = ctx.adapter
        adapter = ctx.adapter or served.adapter_for(model_name)
        max_model_len = served.info().max_model_len
        vocab_size = served.vocab_size()
        defaults = served.sampling_defaults()
        encode = served.encode_plain
        thinking = None
        if thinking_budget is not None:
            start_ids, end_ids, forced_ids = served.reasoning_block_ids(harmony)
            thinking = ThinkingBudget(
                budget=thinking_budget, start_ids=start_ids, end_ids=end_ids, forced_ids=forced_ids
            )
        params = []
        for prompt in prompts:
            served.check_prompt_len(len(prompt.token_ids), prompt.param)
            bounds = SamplingBounds(
                max_model_len, len(prompt.token_ids), vocab_size, defaults, encode, thinking
            )
            params.append(build_params(bounds))
        sequences = self.new_sequences(len(prompts) * n, options)
        response_id, engine_id = self.request_ids(self.id_prefix, ctx, client_request_id)
        for prompt in prompts:
            served.log_prompt(response_id, prompt.logged)
        tracker = self.tracker(response_id, ctx)
        tracker.record.adapter = adapter
        if beam_search is not None:
            collector = await self._search(
                ctx, engine_id, prompts, params, n, beam_search, priority, adapter, cache_salt
            )
        else:
            collector = await self.admit(
                engine_id,
                [prompt.token_ids for prompt in prompts for _ in range(n)],
                [choice for param in params for choice in self.choice_params(param, n)],
                priority,
                lora_name=adapter,
                session_id=ctx.session_id,
                cache_salt=cache_salt,
            )
        run = Run(
            response_id=response_id,
            model_name=model_name,
            collector=collector,
            sequences=sequences,
            choice_of={f"{engine_id}-{i}": seq for i, seq in enumerate(sequences)},
            tracker=tracker,
            prompt_lens=[len(prompt.token_ids) for prompt in prompts],
            prompt_token_ids=[prompt.token_ids for prompt in prompts],
            prompt_texts=[prompt.text for prompt in prompts],
            n=n,
        )
        run.deadline = self.arm_deadline(ctx, collector)
        return run

    async def _search(
        self,
        ctx: RequestContext,
        engine_id: str,
        prompts: SequenceT[PromptInput],
        params: SequenceT[SamplingParams],
        n: int,
        options: BeamSearchOptions,
        priority: int,
        adapter: str | None,
        cache_salt: str | None,
    ) -> OutputCollector:
        """`use_beam_search`: the n best beams of each prompt (handlers/serving/
        beam_search.py), each step's requests admitted like any other and bound by the
        request's timeout; a collector holding the beams as the choices' final outputs."""
        eos_ids = frozenset(self.served.info().eos_token_ids)
        searches = [
            (
                BeamSearch(
                    width=n,
                    max_tokens=param.max_tokens,
                    length_penalty=options.length_penalty,
                    ignore_eos=param.ignore_eos,
                    eos_token_ids=eos_ids,
                    num_logprobs=param.logprobs,
                ),
                prompt.token_ids,
            )
            for prompt, param in zip(prompts, params, strict=True)
        ]
        deadlines: list[asyncio.TimerHandle] = []

        async def admit(
            step_id: str, step_prompts: list[list[int]], step_params: list[SamplingParams]
        ) -> OutputCollector:
            collector = await self.admit(
                step_id, step_prompts, step_params, priority,
                lora_name=adapter, session_id=ctx.session_id, cache_salt=cache_salt,
            )  # fmt: skip
            if (deadline := self.arm_deadline(ctx, collector)) is not None:
                deadlines.append(deadline)
            return collector

        try:
            return await search_collector(
                searches,
                engine_id,
                admit,
                lambda: OutputCollector(self.served.engine),
            )
        finally:
            for deadline in deadlines:
                deadline.cancel()

    async def tokenize_prompts(
        self,
        prompts: SequenceT[str | list[int]],
        *,
        add_special_tokens: bool,
        field: str,
        truncation: Truncation | None = None,
    ) -> list[PromptInput]:
        """Texts tokenized (refused first when too long to fit), token ids checked against
        the vocabulary; each named `field` or `field[i]` in a 400. With a `truncation`
        (vLLM's `truncate_prompt_tokens`), each prompt keeps that many tokens; the echoed
        text of a cut prompt is then its kept tokens decoded."""
        out = []
        offload = offloads(prompts)
        for i, prompt in enumerate(prompts):
            param = field if len(prompts) == 1 else f"{field}[{i}]"
            if isinstance(prompt, str):
                ids, cut = await self.served.encode_prompt(
                    prompt,
                    truncation,
                    add_special_tokens=add_special_tokens,
                    param=param,
                    offload=offload,
                )
                out.append(PromptInput(ids, param, None if cut else prompt))
            else:
                self.served.check_token_ids(prompt, param)
                if truncation is not None:
                    prompt = truncation.of(prompt)
                out.append(PromptInput(prompt, param))
        return out

    def arm_deadline(
        self, ctx: RequestContext, collector: OutputCollector
    ) -> asyncio.TimerHandle | None:
        """--request-timeout: fail the collector (504) when the request's time is up."""
        timeout = self.served.config.request_timeout
        if timeout is None:
            return None
        return asyncio.get_running_loop().call_later(
            max(timeout - (time.monotonic() - ctx.arrival_time), 0.0),
            collector.fail,
            RequestTimeoutError(
                f"The request did not finish within the server's request timeout of "
                f"{timeout:g} s (--request-timeout); its generation was stopped."
            ),
        )

    def envelope(self, run: Run) -> dict[str, Any]:
        """The fields every non-streamed OpenAI response shares: id, created, model and
        the usage (cached tokens when the server says so)."""
        return {
            "id": run.response_id,
            "created": run.created,
            "model": run.model_name,
            "usage": run.usage(include_cached=self.served.config.enable_prompt_tokens_details),
        }

    # -- sequences --------------------------------------------------------------------
    @staticmethod
    def sequence_options(request: SamplingRequest) -> ChoiceOptions:
        return ChoiceOptions(
            skip_special_tokens=request.skip_special_tokens,
            stop=request.stop,
            include_stop_str_in_output=request.include_stop_str_in_output,
            min_tokens=request.min_tokens,
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
    async def deltas(
        self, run: Run, keep_alive: float | None = None
    ) -> AsyncGenerator[tuple[Choice, ChoiceDelta] | None, None]:
        """Each choice's deltas as the engine produces them; a choice whose stop string
        matched is aborted in the engine right away. With `keep_alive`, None is yielded
        whenever that many seconds pass without output (a keep-alive tick)."""
        collector = run.collector
        choice_of = run.choice_of
        tracker = run.tracker
        while not collector.finished:
            outputs = await collector.get(keep_alive)
            if not outputs:
                if keep_alive is not None and not collector.finished:
                    yield None
                continue
            for output in outputs:
                choice = choice_of[output.request_id]
                delta = choice.process(output)
                tracker.on_output(choice.index, len(delta.token_ids))
                if choice.stopped_by_string:
                    collector.abort([output.request_id])
                yield choice, delta

    async def collect(self, run: Run) -> None:
        """Run every choice to its end (non-streaming responses). A client disconnect
        cancels the await; the `finally` then aborts the engine requests."""
        status = "aborted"
        try:
            async for _ in self.deltas(run):
                pass
            status = "ok"
        except Exception as exc:
            status = "error"
            mapped = from_engine_error(exc)
            if mapped is not None:
                raise mapped from None
            raise
        finally:
            self.finish_run(run, status)

    async def sse(
        self,
        run: Run,
        payloads: AsyncGenerator[SSEPayload, None],
        *,
        error_for: ErrorEncoder = encode_error,
        done: bool = True,
    ) -> SSEStream:
        """The one try/finally every stream runs in: the endpoint's payloads, then
        `[DONE]`.

        A failure after the status line becomes one error event (then `[DONE]`). When
        the transport stops iterating or the client disconnects (a cancellation), the
        `finally` aborts what is still running in the engine.
        """
        status = "aborted"
        try:
            async for payload in payloads:
                yield payload
            status = "ok"
        except Exception as exc:
            status = "error"
            error = stream_error(exc)
            if error.status >= 500 and not isinstance(exc, ServingError):
                logger.exception("request %s failed while streaming", run.response_id)
            encoded = error_for(error)
            for payload in encoded if isinstance(encoded, list) else [encoded]:
                yield payload
        finally:
            await payloads.aclose()
            self.finish_run(run, status)
        if done:
            yield DONE

    @staticmethod
    def finish_run(run: Run, status: str) -> None:
        """Abort what still runs in the engine and record the request's stats (once)."""
        if run.deadline is not None:
            run.deadline.cancel()
        run.collector.close()
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
    collector: OutputCollector
    sequences: list[Choice]
    choice_of: dict[str, Choice]
    """Engine request id -> its choice."""
    tracker: RequestTracker
    prompt_lens: list[int]
    """Prompt tokens of each prompt (one for chat; one per prompt of a batch)."""
    prompt_token_ids: list[list[int]]
    """Each prompt's token ids, as admitted (`return_token_ids` answers with them)."""
    prompt_texts: list[str | None]
    """Each prompt's text where it has one (chat: the rendered prompt,
    `return_prompt_text` answers with it)."""
    n: int
    """Choices per prompt; choice i belongs to prompt i // n."""
    created: int = field(default_factory=lambda: int(time.time()))
    deadline: asyncio.TimerHandle | None = None
    """The --request-timeout timer: it fails the collector with RequestTimeoutError."""

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
