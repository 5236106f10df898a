"""vLLM's render routes (`POST /v1/chat/completions/render`, `/v1/completions/render`): a
chat or completion request turned into the `/inference/v1/generate` request(s) that
would run it, without running anything.

Why: the other half of the token-in-token-out split. A router or trainer renders here
(the chat template, tools, truncation and the model's sampling defaults applied exactly
as the chat and completion routes apply them), keeps or edits the token ids, then sends
them to `/inference/v1/generate` on any replica. The answer's `sampling_params` are
vLLM's `SamplingParams` names, resolved (`max_tokens` filled from the context, the
model's generation-config defaults in place), so a render fed back into generate runs
the very request the chat or completion route would have run.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from engine.sampling_params import SamplingParams, StructuredOutputSpec
from handlers.protocol.anthropic import MessagesRequest
from handlers.protocol.chat import ChatCompletionRequest
from handlers.protocol.completion import CompletionRequest
from handlers.protocol.responses import ResponsesRequest
from handlers.protocol.sampling import SamplingBounds, SamplingRequest
from handlers.protocol.structured import whitespace_pattern
from handlers.serving.anthropic_convert import to_chat_request
from handlers.serving.base import ServingBase
from handlers.serving.chat import ServingChat
from handlers.serving.completion import ServingCompletion
from handlers.serving.messages import anthropic_dialect
from handlers.serving.responses import ServingResponses
from handlers.serving.responses_input import responses_params
from handlers.serving.tool_render import forced_tool_spec


class ServingGenerateRender(ServingBase):
    kind = "render"

    def __init__(self, chat: ServingChat, completion: ServingCompletion) -> None:
        super().__init__(chat.served)
        self.chat = chat
        self.completion = completion

    async def render_chat(self, request: ChatCompletionRequest) -> dict[str, Any]:
        self.model_name(request.model)
        template, _, prompt_ids = await self.chat.render_prompt(request, offload=True)
        bounds = self._bounds(prompt_ids, "messages")
        params = request.to_sampling_params(bounds, forced_tool_spec(request))
        body = self._generate_request("chatcmpl", request, prompt_ids, params)
        if template.harmony:  # as the chat route runs it: the channels' tokens are kept
            body["sampling_params"]["skip_special_tokens"] = False
        return body

    async def render_messages(self, request: MessagesRequest) -> dict[str, Any]:
        """Anthropic's Messages request, rendered as `/v1/messages` renders it (converted
        to the chat it runs as); errors in Anthropic's shape."""
        with anthropic_dialect():
            return await self.render_chat(to_chat_request(request, self.served.limits))

    async def render_responses(
        self, request: ResponsesRequest, responses: ServingResponses
    ) -> dict[str, Any]:
        """A Responses request rendered as `/v1/responses` runs it: the chat it becomes,
        the stored conversation of `previous_response_id` included (vLLM's render
        refuses that field; here the store is the server's own); errors name the
        Responses fields."""
        chat = await responses.as_chat(request)
        with responses_params():
            return await self.render_chat(chat)

    async def render_completion(self, request: CompletionRequest) -> list[dict[str, Any]]:
        self.model_name(request.model)
        prompts = await self.completion.tokenize(request)
        return [
            self._generate_request(
                "cmpl",
                request,
                p.token_ids,
                request.to_sampling_params(self._bounds(p.token_ids, p.param)),
            )
            for p in prompts
        ]

    def _bounds(self, prompt_ids: list[int], param: str) -> SamplingBounds:
        """What the request's params are resolved against (the route's own checks: the
        prompt leaves room for a token)."""
        served = self.served
        served.check_prompt_len(len(prompt_ids), param)
        return SamplingBounds(
            served.info().max_model_len,
            len(prompt_ids),
            served.vocab_size(),
            served.sampling_defaults(),
            served.encode_plain,
        )

    @staticmethod
    def _generate_request(
        prefix: str, request: SamplingRequest, prompt_ids: list[int], params: SamplingParams
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "request_id": f"{prefix}-{request.request_id or uuid.uuid4().hex}",
            "token_ids": list(prompt_ids),
            "sampling_params": vllm_sampling_params(request, params),
            "model": getattr(request, "model", None),
            "stream": request.stream,
            "stream_options": request.stream_options.model_dump()
            if request.stream and request.stream_options is not None
            else None,
            "cache_salt": request.cache_salt,
            "priority": request.priority,
        }
        return body


def vllm_sampling_params(request: SamplingRequest, params: SamplingParams) -> dict[str, Any]:
    """The engine's resolved parameters under vLLM's `SamplingParams` names (what
    `/inference/v1/generate` takes); text-level fields (stop strings, bad words, the
    detokenizer's switches) come from the request, since the engine never sees them."""
    fields: dict[str, Any] = {
        "n": request.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": max(params.top_k, 0),
        "min_p": params.min_p,
        "seed": request.seed,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "stop": list(request.stop),
        "stop_token_ids": list(request.stop_token_ids or []),
        "ignore_eos": params.ignore_eos,
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "skip_special_tokens": request.skip_special_tokens,
        "spaces_between_special_tokens": request.spaces_between_special_tokens,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "logit_bias": dict(params.logit_bias) if params.logit_bias else None,
        "allowed_token_ids": params.allowed_token_ids,
        "bad_words": list(request.bad_words) if request.bad_words else None,
        "structured_outputs": _structured_outputs(params.structured),
    }
    if params.logprob_token_ids:
        fields["logprob_token_ids"] = list(params.logprob_token_ids)
    if request.thinking_budget is not None:
        fields["thinking_token_budget"] = request.thinking_budget
    return fields


def _structured_outputs(spec: StructuredOutputSpec | None) -> dict[str, Any] | None:
    """The constraint as vLLM's `structured_outputs` object (one member set; a JSON
    constraint's layout as the `whitespace_pattern` that gives it back)."""
    if spec is None:
        return None
    if spec.kind in ("json", "json_object"):
        out: dict[str, Any] = (
            {"json": json.loads(spec.value)} if spec.kind == "json" else {"json_object": True}
        )
        pattern = whitespace_pattern(spec.any_whitespace, spec.separators)
        if pattern is not None:
            out["whitespace_pattern"] = pattern
        return out
    if spec.kind == "choice":
        return {"choice": json.loads(spec.value)}
    return {spec.kind: spec.value}  # regex, grammar, structural_tag: the text as given
