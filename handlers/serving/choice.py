"""One choice's output: token ids in, released text deltas out.

Combines the incremental detokenizer (multi-byte characters split across tokens come
out whole), the stop-string matcher (hold-back, then stop) and vLLM's rule that the
stop token's own text (EOS or a `stop_token_ids` entry) is not part of the output
unless `include_stop_str_in_output` is set. Which token stopped a request is the
engine's to say (`RequestOutput.finished_on_stop_token`): the worker never re-derives
the EOS ids, `ignore_eos` or `min_tokens` to guess it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.messages import RequestOutput, TokenLogprob
from engine.tokenizer import Tokenizer
from handlers.errors import InternalServerError
from handlers.serving.stop import StopStringMatcher

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ChoiceDelta:
    """What one engine output adds to a choice, ready for a chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """The prompt's own entries (first is None), on the choice's first delta when asked for."""


@dataclass(slots=True, kw_only=True)
class ChoiceOptions:
    skip_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0


class Choice:
    """The state of one choice across the engine outputs of its request."""

    def __init__(self, index: int, tokenizer: Tokenizer, options: ChoiceOptions) -> None:
        self.index = index
        self._options = options
        self._detokenizer = tokenizer.incremental_detokenizer(options.skip_special_tokens)
        self._matcher = StopStringMatcher(options.stop, options.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self._pieces: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.text_ends: list[int] = []
        """Per token: how many characters of `text` had been released once it was folded
        in (text a stop-string check holds back counts for the token that releases it),
        so a part of the text can be traced back to its tokens."""
        self._released = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        """Per prompt token (the first is None), when the request asked the engine for them."""

    @property
    def text(self) -> str:
        """All text released so far (joined on demand: appending to a str attribute
        per token would copy the whole output each time)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_by_string(self) -> bool:
        """Finished by a stop string: the engine does not know and must be told (abort)."""
        return isinstance(self.stop_reason, str)

    def process(self, output: RequestOutput) -> ChoiceDelta:
        """Fold one engine output into the choice; raises InternalServerError if the engine
        reports that generation failed."""
        if self.finished:
            return ChoiceDelta("", [], None)
        if output.finish_reason == "error":
            logger.error("engine failed request %r: %s", output.request_id, output.error)
            raise InternalServerError("The engine failed while generating this response.")
        self.num_prompt_tokens = self.num_prompt_tokens or output.num_prompt_tokens
        self.num_cached_tokens = self.num_cached_tokens or output.num_cached_tokens
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        options = self._options
        pieces: list[str] = []
        stop: str | None = None
        new_ids = output.new_token_ids
        hidden = (
            len(new_ids) - 1
            if output.finished_on_stop_token and not options.include_stop_str_in_output
            else -1
        )
        kept = 0
        for k, token_id in enumerate(new_ids):
            hide = k == hidden
            piece = "" if hide else self._detokenizer.step(token_id)
            self.token_ids.append(token_id)
            kept += 1
            result = self._matcher.feed(piece, check=len(self.token_ids) >= options.min_tokens)
            pieces.append(result.text)
            self._released += len(result.text)
            self.text_ends.append(self._released)
            if result.stop is not None:
                stop = result.stop
                break
        logprobs = list(output.new_logprobs[:kept]) if output.new_logprobs is not None else None
        if logprobs:
            self.logprobs.extend(logprobs)
        if stop is not None:
            self.finish_reason, self.stop_reason = "stop", stop
        elif output.finish_reason is not None:
            flushed = self._matcher.flush()
            pieces.append(flushed)
            self._released += len(flushed)
            if self.text_ends:
                self.text_ends[-1] = self._released
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason
        text = "".join(pieces)
        if text:
            self._pieces.append(text)
        return ChoiceDelta(
            text,
            new_ids[:kept],
            logprobs,
            self.finish_reason,
            self.stop_reason if self.finish_reason else None,
            output.prompt_logprobs,
        )

    def abandon(self, reason: str = "abort") -> None:
        """Mark unfinished (client went away, or the request failed) for stats."""
        if not self.finished:
            self.finish_reason = reason
