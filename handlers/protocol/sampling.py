"""Sampling fields shared by chat and completion requests, and SamplingParams building.

Ranges are OpenAI's where OpenAI defines the parameter and vLLM's for vLLM's extras.
Checks that need the server's limits read them from the validation context; checks that
need the model (vocabulary, context length) run when the params are built.

`make_sampling_params` is the one constructor of `SamplingParams` on the worker side:
chat, completion and TGI requests all end there, so the vocabulary check, the
min_tokens rule and the numerical-safety clamps exist once (docs/architecture.md,
"Where each rule lives").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from engine.sampling_params import SamplingParams, StructuredOutputSpec, ThinkingBudget
from handlers.errors import BadRequestError
from handlers.protocol.base import (
    FieldError,
    StreamOptions,
    TruncatePromptTokens,
    TruncationSide,
    limits_from,
    reject_negative_ids,
    reject_unsupported,
)
from handlers.protocol.structured import StructuredOutputFields

INT64_MAX = 2**63 - 1
MAX_ALLOWED_TOKEN_IDS = 1 << 18
"""allowed_token_ids entries (more than any vocabulary has): bounds the request's cost."""

MAX_BAD_WORDS = 128
"""bad_words token sequences per request after tokenization (vLLM's
VLLM_MAX_NUM_BAD_WORDS default)."""
MAX_BAD_WORDS_TOKENS = 1024
"""Their ids summed (vLLM's VLLM_MAX_BAD_WORDS_TOTAL_TOKENS default): bounds the
sampler's per-step work for the request."""
MAX_BAD_WORD_CHARS = 1024
"""Characters of one bad word, checked before it is tokenized."""

MAX_LOGPROB_TOKEN_IDS = 128
"""vLLM's cap on chat's `logprob_token_ids`."""

MIN_TEMPERATURE = 1e-2
"""vLLM's floor for a sampling temperature (0 < t < 0.01 becomes 0.01): dividing logits
by less overflows them (1e-320 is 0 in float32) and sampling returns garbage."""
MIN_TOP_P = 1e-8
"""Floor for top_p. The top token's probability is at least 1/vocab_size, so any top_p at
or below that keeps the top token alone: flooring changes nothing but float32 underflow."""
MIN_REPETITION_PENALTY = 1e-8
"""Floor for repetition_penalty: logits are divided by it, so a subnormal one (0 in
float32) would turn them into inf/NaN."""


def numerically_safe(
    temperature: float, top_p: float, repetition_penalty: float
) -> tuple[float, float, float]:
    """(temperature, top_p, repetition_penalty) moved out of the range where float32
    math on the logits breaks down; greedy (temperature 0) stays greedy."""
    if 0.0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    return temperature, max(top_p, MIN_TOP_P), max(repetition_penalty, MIN_REPETITION_PENALTY)


# Fields of the model's generation_config.json that vLLM turns into default sampling
# parameters (`--generation-config auto`), by their SamplingParams names.
GENERATION_CONFIG_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def check_in_vocabulary(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    """The one vocabulary rule for token ids a request names (prompt token ids,
    `stop_token_ids`, `logit_bias` keys): 400 naming the field."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise BadRequestError(
                f"{param}: token id {token_id} is outside the vocabulary (size {vocab_size})",
                param=param,
            )


@dataclass(frozen=True, slots=True)
class SamplingBounds:
    """What building one prompt's SamplingParams needs to know beyond the request: the
    model's context and vocabulary, the prompt's length and the model's sampling
    defaults (`--generation-config auto`)."""

    max_model_len: int
    prompt_len: int
    vocab_size: int
    defaults: Mapping[str, Any] = field(default_factory=dict)
    encode: Callable[[str], list[int]] | None = None
    """The tokenizer, without special tokens (for `bad_words`)."""
    thinking: ThinkingBudget | None = None
    """The request's reasoning cap, resolved against the model's think tags."""


def bad_words_token_ids(
    words: Iterable[str], encode: Callable[[str], list[int]]
) -> list[list[int]]:
    """vLLM's tokenization of `bad_words` (`SamplingParams.update_from_tokenizer`): each
    word without its leading whitespace, and again after one space (the form it takes
    inside a text) when that starts with another token and has as many tokens; 400 for
    a word that is no token at all, or when the sequences pass vLLM's caps."""
    sequences: list[list[int]] = []
    for word in dict.fromkeys(w.lstrip() for w in words):  # " x" is "x": the same ids
        bare = encode(word)
        if not bare:
            raise BadRequestError(
                "bad_words entries must tokenize to at least one token.", param="bad_words"
            )
        sequences.append(bare)
        spaced = encode(" " + word)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORDS:
            raise BadRequestError(
                f"Too many bad words after tokenization: more than {MAX_BAD_WORDS}.",
                param="bad_words",
            )
    total = sum(map(len, sequences))
    if total > MAX_BAD_WORDS_TOKENS:
        raise BadRequestError(
            f"bad_words tokenize to {total} tokens; at most {MAX_BAD_WORDS_TOKENS} are allowed.",
            param="bad_words",
        )
    return sequences


def make_sampling_params(
    *,
    max_tokens: int,
    vocab_size: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    min_tokens: int = 0,
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    logit_bias: Mapping[str, float] | None = None,
    allowed_token_ids: Iterable[int] | None = None,
    bad_words: list[list[int]] | None = None,
    seed: int | None = None,
    logprobs: int | None = None,
    logprob_token_ids: list[int] | None = None,
    structured: StructuredOutputSpec | None = None,
    prompt_logprobs: int | None = None,
    thinking: ThinkingBudget | None = None,
) -> SamplingParams:
    """The engine's SamplingParams from values every API has validated for range: the
    checks that need the model (token ids in the vocabulary, min_tokens within
    max_tokens), the numerical-safety clamps and top_k's "0 is off" happen here, once.
    `logit_bias` keys are token ids as the wire sends them (strings)."""
    stop_token_ids = list(stop_token_ids)
    bias = {int(key): float(value) for key, value in (logit_bias or {}).items()}
    check_in_vocabulary(stop_token_ids, vocab_size, "stop_token_ids")
    check_in_vocabulary(bias, vocab_size, "logit_bias")
    check_in_vocabulary((t for ids in bad_words or () for t in ids), vocab_size, "bad_words")
    check_in_vocabulary(logprob_token_ids or (), vocab_size, "logprob_token_ids")
    allowed = sorted(set(allowed_token_ids)) if allowed_token_ids is not None else None
    if allowed is not None:
        check_in_vocabulary(allowed, vocab_size, "allowed_token_ids")
        if structured is not None:
            raise BadRequestError(
                "allowed_token_ids cannot be combined with structured outputs or a forced "
                "tool call (the two masks could leave no token to sample)",
                param="allowed_token_ids",
            )
    if thinking is not None and structured is not None:
        raise BadRequestError(
            "thinking_token_budget cannot be combined with structured outputs or a forced "
            "tool call (the constraint applies from the first token, reasoning included)",
            param="thinking_token_budget",
        )
    if min_tokens > max_tokens:
        raise BadRequestError(
            f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})",
            param="min_tokens",
        )
    temperature, top_p, repetition_penalty = numerically_safe(
        float(temperature), float(top_p), float(repetition_penalty)
    )
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=-1 if top_k == 0 else int(top_k),
        min_p=float(min_p),
        seed=seed,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
        presence_penalty=float(presence_penalty),
        frequency_penalty=float(frequency_penalty),
        repetition_penalty=repetition_penalty,
        logit_bias=bias or None,
        allowed_token_ids=allowed,
        bad_words_token_ids=bad_words or None,
        logprobs=len(logprob_token_ids) if logprob_token_ids and logprobs is not None else logprobs,
        logprob_token_ids=logprob_token_ids if logprobs is not None else None,
        structured=structured,
        prompt_logprobs=prompt_logprobs,
        thinking=thinking,
    )


class SamplingRequest(StructuredOutputFields):
    """Fields every generation request (chat and completion) accepts, including the
    output constraints (`response_format`, `structured_outputs`, `guided_*`)."""

    n: int = Field(default=1, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    """-1 or 0: disabled (vLLM treats 0 as disabled)."""
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX)
    stop: list[str] = Field(default_factory=list)
    """Stop strings, matched on the detokenized text in the API worker."""
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    """vLLM's: words (strings) that are never generated; see `bad_words_token_ids`."""
    thinking_token_budget: int | None = Field(default=None, ge=-1)
    """vLLM's: at most this many tokens in a `<think>` block, then it is closed (-1 or
    absent: no cap); needs a model that reasons in such blocks."""
    _bad_words_ids: list[list[int]] | None = PrivateAttr(default=None)
    """vLLM: only these token ids can be generated (at most the vocabulary, each inside it)."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    """Accepted for vLLM compatibility; the tokenizer's decoder decides spacing."""
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """Accepted and ignored, as vLLM does."""
    priority: int = Field(default=0, ge=-INT64_MAX - 1, le=INT64_MAX)
    """Lower runs first under --scheduling-policy priority."""
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    prompt_logprobs: int | None = None
    """vLLM: each prompt token's logprob plus the top k (see docs/api.md, Scoring)."""
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    """vLLM: generate from the prompt's last k tokens only (-1: the context length)."""
    truncation_side: TruncationSide | None = None
    """vLLM: which end `truncate_prompt_tokens` cuts ("left", the default: keep the last
    k tokens; "right": keep the first k)."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    """vLLM: prefix-cache blocks are shared only with requests of the same salt."""
    return_token_ids: bool = False
    """vLLM: each choice carries its generated token ids (`token_ids`) and the answer the
    prompt's (`prompt_token_ids`); streamed, the prompt's come in the first chunk (chat)
    or a choice's first chunk (completion) and each chunk has its delta's ids."""
    return_tokens_as_token_ids: bool = False
    """vLLM: logprob tokens are written `token_id:<id>` (text that may not be valid UTF-8
    on its own stays identifiable)."""
    use_beam_search: bool = False
    """vLLM: the `n` best continuations by cumulative logprob (beam search, `n` the beam
    width: handlers/serving/beam_search.py) instead of `n` samples."""
    length_penalty: float = 1.0
    """vLLM: a beam's score is its cumulative logprob over length ** length_penalty
    (beam search only)."""

    unsupported_fields: ClassVar[Mapping[str, str]] = {}
    """Parameters (OpenAI's or vLLM's) that would change the output if honoured, with the
    reason; each request type names its own. Ignoring them silently would hand back
    something the client did not ask for, so a meaningful value is a 400."""

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        reject_unsupported(data, cls.unsupported_fields, beam_search=True)
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _normalize_stop(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise FieldError(None, "must be a string or a list of strings")
        limit = limits_from(info.context).max_stop_strings
        if len(value) > limit:
            raise FieldError(None, f"at most {limit} stop strings are allowed, got {len(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise FieldError(i, "stop strings must be strings")
            if not item:
                raise FieldError(i, "stop strings must not be empty")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value is None:
            return value
        limit = limits_from(info.context).max_stop_token_ids
        if len(value) > limit:
            raise FieldError(None, f"at most {limit} stop token ids are allowed, got {len(value)}")
        reject_negative_ids(value)
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _check_allowed_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return value
        if not value:
            raise FieldError(None, "must not be empty (leave it out to allow every token)")
        if len(value) > MAX_ALLOWED_TOKEN_IDS:
            raise FieldError(None, f"at most {MAX_ALLOWED_TOKEN_IDS} ids are allowed")
        reject_negative_ids(value)
        return value

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, value: list[str] | None) -> list[str] | None:
        if not value:
            return None
        if len(value) > MAX_BAD_WORDS:
            raise FieldError(None, f"at most {MAX_BAD_WORDS} bad words are allowed")
        for i, word in enumerate(value):
            if not word.strip():
                raise FieldError(i, "bad_words cannot contain an empty string")
            if len(word) > MAX_BAD_WORD_CHARS:
                raise FieldError(i, f"a bad word is at most {MAX_BAD_WORD_CHARS} characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(
        cls, value: dict[str, float] | None, info: ValidationInfo
    ) -> dict[str, float] | None:
        if value is None:
            return None
        limit = limits_from(info.context).max_logit_bias
        if len(value) > limit:
            raise FieldError(
                None, f"at most {limit} logit_bias entries are allowed, got {len(value)}"
            )
        for key, bias in value.items():
            try:
                token_id = int(key)
            except ValueError:
                raise FieldError(None, f"keys must be token ids, got {key!r}") from None
            if token_id < 0:
                raise FieldError(None, f"token id {key} is negative")
            if not -100.0 <= bias <= 100.0:
                raise FieldError(None, f"bias {bias} for token {key} is outside [-100, 100]")
        return value

    @model_validator(mode="after")
    def _check_shared(self, info: ValidationInfo) -> SamplingRequest:
        limits = limits_from(info.context)
        if self.n > limits.max_n:
            raise FieldError("n", f"n must be at most {limits.max_n}, got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed with stream=true")
        if self.prompt_logprobs is not None:
            check_prompt_logprobs(self.prompt_logprobs, self.stream, limits.max_logprobs)
        if self.use_beam_search:
            self._check_beam_search(limits.max_logprobs)
        return self

    def _check_beam_search(self, max_logprobs: int) -> None:
        """What beam search cannot honour is a 400 (vLLM ignores it): each step asks for
        2 x width candidates (at most `max_logprobs`), and a choice is a beam, not a
        sample, so the fields that shape a sampled sequence do not apply. Temperature,
        top_p, top_k, min_p and seed change nothing: the search is deterministic."""
        width_cap = max(max_logprobs // 2, 1)
        if self.n > width_cap:
            raise FieldError(
                "n", f"with use_beam_search, n is the beam width: at most {width_cap}, got {self.n}"
            )
        shaping = {
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "min_tokens": self.min_tokens,
            "bad_words": self.bad_words,
            "logit_bias": self.logit_bias,
            "allowed_token_ids": self.allowed_token_ids,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": None
            if self.repetition_penalty == 1.0
            else self.repetition_penalty,
            "thinking_token_budget": self.thinking_budget,
            "prompt_logprobs": self.prompt_logprobs,
            "logprob_token_ids": getattr(self, "logprob_token_ids", None),  # chat's
            **{name: True for name in self._constraint_fields()},
        }
        for name, value in shaping.items():
            if value not in (None, 0, 0.0, [], {}, ""):
                raise FieldError(
                    name, f"{name} is not applied by beam search (use_beam_search); leave it out"
                )

    # -- building ---------------------------------------------------------------------
    def build_sampling_params(
        self,
        *,
        max_tokens: int,
        bounds: SamplingBounds,
        logprobs: int | None,
        logprob_token_ids: list[int] | None = None,
        structured: StructuredOutputSpec | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """SamplingParams for one choice; request values win over the model's defaults.
        `structured` overrides the request's own constraint (chat's forced tool calls)."""
        defaults = bounds.defaults

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return make_sampling_params(
            max_tokens=max_tokens,
            vocab_size=bounds.vocab_size,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", -1),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self._bad_words_token_ids(bounds),
            seed=self.seed,
            logprobs=logprobs,
            logprob_token_ids=logprob_token_ids,
            structured=structured if structured is not None else self.structured_spec(),
            prompt_logprobs=prompt_logprobs,
            thinking=bounds.thinking,
        )

    @property
    def thinking_budget(self) -> int | None:
        """`thinking_token_budget` with vLLM's -1 (no cap) as None."""
        budget = self.thinking_token_budget
        return None if budget is None or budget == -1 else budget

    def _bad_words_token_ids(self, bounds: SamplingBounds) -> list[list[int]] | None:
        """`bad_words` tokenized once per request (every prompt's params share it)."""
        if not self.bad_words:
            return None
        if self._bad_words_ids is None:
            if bounds.encode is None:
                raise BadRequestError("bad_words needs the model's tokenizer", param="bad_words")
            self._bad_words_ids = bad_words_token_ids(self.bad_words, bounds.encode)
        return self._bad_words_ids


def check_prompt_logprobs(value: int, stream: bool, max_logprobs: int) -> None:
    """vLLM's rules for `prompt_logprobs`, with the server's cap (vLLM's -1, the whole
    vocabulary, is always above it)."""
    if value < 0:
        raise FieldError(
            "prompt_logprobs",
            f"prompt_logprobs must be an integer from 0 to {max_logprobs}, got {value}",
        )
    if value > max_logprobs:
        raise FieldError(
            "prompt_logprobs", f"prompt_logprobs must be at most {max_logprobs}, got {value}"
        )
    if stream and value > 0:
        raise FieldError("prompt_logprobs", "prompt_logprobs are not available when stream=true")


def resolve_max_tokens(
    requested: int | None,
    *,
    param: str,
    prompt_len: int,
    max_model_len: int,
    default: int | None = None,
) -> int:
    """vLLM's rule: the default fills the context; an explicit value must fit in it."""
    room = max_model_len - prompt_len
    if requested is None:
        return room if default is None else max(1, min(default, room))
    if requested > room:
        raise BadRequestError(
            f"'{param}' is too large: {requested}. This model's maximum context length is "
            f"{max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({requested} > {max_model_len} - {prompt_len}).",
            param=param,
        )
    return requested


def seed_for_choice(seed: int | None, index: int) -> int | None:
    """Each choice of n gets its own seed (seed + index), so n seeded choices differ but
    the whole response stays reproducible."""
    if seed is None:
        return None
    return (seed + index) % (INT64_MAX + 1)
