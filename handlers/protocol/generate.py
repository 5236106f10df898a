"""vLLM's token-in-token-out API (`POST /inference/v1/generate`): token ids and vLLM's
`SamplingParams` in, token ids (and text, with `output_mode: "text"`) out.

Why it exists: a client that tokenizes and renders its own prompts (an RL trainer that
must score exactly the tokens it sampled, a router that renders templates itself) needs
the tokens to go in and come out untouched; a text round trip can re-tokenize them
differently. The sampling fields are vLLM's `SamplingParams` names, which are the
completion API's names too, so the request is checked by `CompletionRequest`'s own rules
(`to_completion_body`), and an error names the field as `sampling_params.<name>`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from handlers.protocol.base import (
    FieldError,
    OpenAIBaseModel,
    PromptLogprob,
    StreamOptions,
    UsageInfo,
    WireModel,
    reject_negative_ids,
)
from handlers.protocol.chat import ChatCompletionLogProbs
from handlers.protocol.sampling import INT64_MAX

SAMPLING_FIELDS = frozenset(
    {
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "max_tokens",
        "min_tokens",
        "logprobs",
        "prompt_logprobs",
        "logprob_token_ids",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "structured_outputs",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "thinking_token_budget",
        "truncate_prompt_tokens",
    }
)
"""vLLM `SamplingParams` fields hearth runs: passed to the completion rules by name."""

IGNORED_SAMPLING_FIELDS = frozenset(
    {
        "detokenize",  # checked against output_mode, then the server decides
        "output_kind",  # the route decides: deltas when streaming, else the final output
        "stream_interval",
        "skip_clone",
        "flat_logprobs",
        "extra_args",
        "output_text_buffer_length",
        "skip_reading_prefix_cache",
        "routed_experts_prompt_start",
        "trace_decode_token_ids",
        "_eos_token_id",
        "_all_stop_token_ids",
        "_watermarking_skipped",
        "_bad_words_token_ids",
    }
)
"""Fields a vLLM client may send (a `SamplingParams` dumped whole carries them all) that
change nothing here: accepted, not applied."""

REFUSED_SAMPLING_FIELDS = {
    "watermarking": "watermarking is not supported",
    "repetition_detection": "repetition detection is not supported",
    "prompt_logprob_token_ids": "prompt_logprob_token_ids is not supported; use prompt_logprobs",
    "prompt_logprob_start": "prompt_logprob_start is not supported; use prompt_logprobs",
}
"""Fields that would change the output: a 400 when set (to anything but null)."""

KNOWN_SAMPLING_FIELDS = SAMPLING_FIELDS | IGNORED_SAMPLING_FIELDS | REFUSED_SAMPLING_FIELDS.keys()


class GenerateRequest(OpenAIBaseModel):
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = Field(default=0, ge=-INT64_MAX - 1, le=INT64_MAX)
    return_token_ids: bool | None = None
    """Answer with `prompt_token_ids` too."""
    output_mode: Literal["tokens", "text"] = "tokens"
    """'tokens': token ids only; 'text': the decoded text too, and logprobs with strings."""
    features: Any = None
    content_parts: Any = None
    kv_transfer_params: dict[str, Any] | None = None
    """Disaggregated serving's: accepted and ignored (one engine here)."""
    ec_transfer_params: dict[str, Any] | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, value: list[int]) -> list[int]:
        reject_negative_ids(value, message="token_ids must not contain negative values")
        return value

    @field_validator("features", "content_parts")
    @classmethod
    def _no_multimodal(cls, value: Any) -> Any:
        if value:
            raise FieldError(None, "multimodal inputs are not supported (text models only)")
        return value

    @field_validator("sampling_params")
    @classmethod
    def _known_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name, setting in value.items():
            if name in REFUSED_SAMPLING_FIELDS and setting is not None:
                raise FieldError(name, REFUSED_SAMPLING_FIELDS[name])
            if name not in KNOWN_SAMPLING_FIELDS:
                raise FieldError(name, f"unknown sampling parameter {name!r}")
        if value.get("detokenize") is False and value.get("stop"):
            raise FieldError("stop", "stop strings need detokenize; use stop_token_ids")
        return value

    def to_completion_body(self) -> dict[str, Any]:
        """The same request as `/v1/completions` takes it: token ids as the prompt, the
        sampling fields by their shared names. `max_tokens` left out fills the context
        (vLLM's generate route does the same; its SamplingParams default of 16 would
        cut every generation short)."""
        sampling = {k: v for k, v in self.sampling_params.items() if k in SAMPLING_FIELDS}
        bias = sampling.get("logit_bias")
        if isinstance(bias, dict):  # vLLM's keys are ints; the completion API's strings
            sampling["logit_bias"] = {str(k): v for k, v in bias.items()}
        sampling.setdefault("max_tokens", None)
        if sampling.get("logprobs") == -1:
            sampling["logprobs"] = 1 << 30  # vLLM's "every token": refused by the cap
        return {
            **sampling,
            "prompt": self.token_ids,
            "model": self.model,
            "stream": self.stream,
            "stream_options": self.stream_options.model_dump() if self.stream_options else None,
            "cache_salt": self.cache_salt,
            "priority": self.priority,
            "request_id": self.request_id,
            "return_token_ids": True,
        }

    @property
    def detokenize(self) -> bool:
        return self.sampling_params.get("detokenize", True) is not False


# -- responses ----------------------------------------------------------------------
class GenerateLogProb(WireModel):
    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    top_logprobs: list[GenerateLogProb] = Field(default_factory=list)


class GenerateLogProbs(WireModel):
    content: list[GenerateLogProbsContent] | None = None


class GenerateChoice(WireModel):
    """A choice of `output_mode: "tokens"` (vLLM's shape has no `text` there)."""

    index: int
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    logprobs: GenerateLogProbs | ChatCompletionLogProbs | None = None


class GenerateTextChoice(GenerateChoice):
    """A choice of `output_mode: "text"`: the decoded text too (a delta when streaming)."""

    text: str = ""


class GenerateResponse(WireModel):
    request_id: str
    model: str | None = None
    created: int | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    choices: list[GenerateTextChoice] | list[GenerateChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class GenerateStreamResponse(WireModel):
    request_id: str
    output_mode: Literal["tokens", "text"] = "tokens"
    choices: list[GenerateTextChoice] | list[GenerateChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
