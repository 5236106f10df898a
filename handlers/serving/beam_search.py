"""vLLM's `use_beam_search` for chat and completions: the `n` best continuations of a
prompt by cumulative log-probability, searched step by step over the engine.

Why in the API worker: it is how vLLM's server runs it (`EngineClient.beam_search`), and
it needs nothing new from the engine. Each step sends every live beam (the prompt plus
its tokens) as a one-token request asking for the `2 * width` most likely next tokens;
the prefix cache holds the beams' shared tokens, so a step prefills little more than the
last, partial KV block of each beam. From all beams' candidates, an end-of-sequence
token closes a beam (kept with its score), and the `width` best others by cumulative
logprob go on. After `max_tokens` steps, or when no beam is left open, the `width` best
of the closed and open beams by vLLM's score, `cumulative_logprob / len(tokens) **
length_penalty` (the prompt counted, a final EOS not), are the choices.

The result goes through the same path as sampled choices: the beams become the final
outputs of an `OutputCollector`, so detokenization, stop-token hiding, tool-call and
reasoning parsing, usage and streaming are the route's own. Scores use the engine's
logprobs, which are taken before temperature (vLLM's default `raw_logprobs`): the search
is deterministic and the sampling settings do not change it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from engine.collector import OutputCollector, merge_into
from engine.messages import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from handlers.errors import InternalServerError
from handlers.protocol.sampling import SamplingRequest

Admit = Callable[[str, list[list[int]], list[SamplingParams]], Awaitable[OutputCollector]]
"""`ServingBase.admit` bound to the request's priority, adapter and cache salt."""


@dataclass(slots=True)
class Beam:
    tokens: list[int]
    """Prompt and generated tokens."""
    cum_logprob: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One entry per generated token (its logprob, rank and the step's top tokens)."""
    ended: bool = False
    """Closed by an end-of-sequence token (the last of `tokens`)."""


def beam_score(beam: Beam, length_penalty: float) -> float:
    """vLLM's `get_beam_search_score`: the cumulative logprob over the sequence length
    (prompt included, a final EOS not) to the power `length_penalty`."""
    length = max(len(beam.tokens) - (1 if beam.ended else 0), 1)
    return beam.cum_logprob / (length**length_penalty)


@dataclass(frozen=True, slots=True)
class BeamSearchOptions:
    """What a request asks of the search beyond its sampling parameters (`n` is the
    width, `max_tokens`, `ignore_eos` and `logprobs` are the choice's own)."""

    length_penalty: float = 1.0


def beam_search_options(request: SamplingRequest) -> BeamSearchOptions | None:
    """The request's search settings; None when it samples."""
    if not request.use_beam_search:
        return None
    return BeamSearchOptions(length_penalty=request.length_penalty)


@dataclass(frozen=True, slots=True)
class BeamSearch:
    """One search's settings: `width` beams (the request's `n`), `max_tokens` steps."""

    width: int
    max_tokens: int
    length_penalty: float
    ignore_eos: bool
    eos_token_ids: frozenset[int]
    num_logprobs: int | None
    """The request's own `logprobs` / `top_logprobs` (None: no logprobs in the answer)."""

    @property
    def candidates(self) -> int:
        """Next tokens asked for per beam and step: twice the width, as vLLM (so that
        `width` survive even when some candidates end the sequence), or more when the
        answer wants more alternatives."""
        return max(2 * self.width, self.num_logprobs or 0)

    def step_params(self) -> SamplingParams:
        """A step's request: one token, its top candidates; the token itself is not used
        (greedy, so no random draw), EOS is judged here (`ignore_eos` for the engine)."""
        return SamplingParams(
            temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=self.candidates
        )

    def extend(self, beams: list[Beam], steps: list[TokenLogprob]) -> tuple[list[Beam], list[Beam]]:
        """(the open beams of the next step, the beams this step closed) from each
        beam's candidates (`steps[i]`: the step entry of `beams[i]`)."""
        closed: list[Beam] = []
        scored: list[tuple[float, int, int, float, int]] = []
        for b, (beam, entry) in enumerate(zip(beams, steps, strict=True)):
            for rank, (token_id, logprob) in enumerate(entry.top[: self.candidates], start=1):
                if not math.isfinite(logprob):
                    continue
                total = beam.cum_logprob + logprob
                if token_id in self.eos_token_ids and not self.ignore_eos:
                    closed.append(self._child(beam, entry, token_id, logprob, rank, ended=True))
                else:
                    scored.append((total, b, token_id, logprob, rank))
        scored.sort(key=lambda item: -item[0])
        opened = [
            self._child(beams[b], steps[b], token_id, logprob, rank, ended=False)
            for _, b, token_id, logprob, rank in scored[: self.width]
        ]
        return opened, closed

    def _child(
        self, beam: Beam, entry: TokenLogprob, token_id: int, logprob: float, rank: int, ended: bool
    ) -> Beam:
        shown = entry.top[: self.num_logprobs or 0]
        return Beam(
            tokens=[*beam.tokens, token_id],
            cum_logprob=beam.cum_logprob + logprob,
            logprobs=[*beam.logprobs, TokenLogprob(token_id, logprob, rank, list(shown))],
            ended=ended,
        )

    def best(self, beams: list[Beam]) -> list[Beam]:
        """The `width` best by score. Fewer can only exist where the vocabulary (past its
        -inf logprobs) is narrower than the width: the best are then repeated, so that
        every one of the request's `n` choices has an answer."""
        ranked = sorted(beams, key=lambda b: beam_score(b, self.length_penalty), reverse=True)
        chosen = ranked[: self.width]
        while chosen and len(chosen) < self.width:
            chosen.append(chosen[len(chosen) % len(ranked)])
        return chosen


async def run_search(
    search: BeamSearch, prompt: list[int], step_id: str, admit: Admit
) -> list[Beam]:
    """The `width` best beams of `prompt` (engine requests named `<step_id>-s<k>-<i>`)."""
    open_beams = [Beam(tokens=list(prompt))]
    closed: list[Beam] = []
    for step in range(search.max_tokens):
        if not open_beams:
            break
        entries = await _one_step(search, open_beams, f"{step_id}-s{step}", admit)
        open_beams, ended = search.extend(open_beams, entries)
        closed += ended
    return search.best(closed + open_beams)


async def _one_step(
    search: BeamSearch, beams: list[Beam], step_id: str, admit: Admit
) -> list[TokenLogprob]:
    """Each beam's one-token request, run to its end: its logprob entry per beam."""
    collector = await admit(step_id, [b.tokens for b in beams], [search.step_params()] * len(beams))
    outputs: dict[str, RequestOutput] = {}
    try:
        while not collector.finished:
            for out in await collector.get():
                if out.request_id in outputs:
                    merge_into(outputs[out.request_id], out)
                else:
                    outputs[out.request_id] = out
    finally:
        collector.close()
    entries = []
    for i in range(len(beams)):
        out = outputs.get(f"{step_id}-{i}")
        if out is None or out.finish_reason in ("error", "abort") or not out.new_logprobs:
            raise InternalServerError("The engine failed during a beam search step.")
        entries.append(out.new_logprobs[0])
    return entries


def final_outputs(
    beams: Sequence[Beam], engine_id: str, first: int, prompt_len: int, with_logprobs: bool
) -> list[RequestOutput]:
    """The beams as the final outputs of choices `<engine_id>-<first + i>`."""
    outputs = []
    for i, beam in enumerate(beams):
        ended = beam.ended
        outputs.append(
            RequestOutput(
                request_id=f"{engine_id}-{first + i}",
                new_token_ids=beam.tokens[prompt_len:],
                new_logprobs=list(beam.logprobs) if with_logprobs else None,
                finish_reason="stop" if ended else "length",
                stop_reason=beam.tokens[-1] if ended else None,
                finished_on_stop_token=ended,
                num_prompt_tokens=prompt_len,
            )
        )
    return outputs


async def search_collector(
    searches: Sequence[tuple[BeamSearch, list[int]]],
    engine_id: str,
    admit: Admit,
    make_collector: Callable[[], OutputCollector],
) -> OutputCollector:
    """Every prompt's search (concurrently; each its own settings, as `max_tokens`
    depends on the prompt's length), its beams the finished outputs of one collector,
    choices numbered prompt by prompt as sampled ones are (`i // n`)."""
    tasks = [
        asyncio.ensure_future(run_search(search, prompt, f"{engine_id}-p{k}", admit))
        for k, (search, prompt) in enumerate(searches)
    ]
    try:
        found = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # one failed (or the client left): stop the others' steps
            task.cancel()
        raise
    collector = make_collector()
    for k, ((search, prompt), beams) in enumerate(zip(searches, found, strict=True)):
        outputs = final_outputs(
            beams, engine_id, k * search.width, len(prompt), search.num_logprobs is not None
        )
        for out in outputs:
            collector.track(out.request_id)
            collector.put(out)
    return collector
