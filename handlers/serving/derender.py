"""vLLM's derender routes: a generate response's token ids back into the chat or completion
response the chat or completion route gives for them (`handlers/protocol/derender.py` says
why and what is bounded).

Each choice's ids go through the same `Choice` the routes fold engine outputs into (the
detokenizer, the request's stop strings, the stop token's text left out), and a chat
choice through the chat route's own `finished_choice` (reasoning split, tool calls,
logprobs as the request asked): for the same ids and the same request, the same message.
"""

from __future__ import annotations

import dataclasses
import time

from engine.messages import RequestOutput, TokenLogprob
from handlers.errors import BadRequestError
from handlers.protocol.base import UsageInfo
from handlers.protocol.chat import (
    ChatCompletionLogProbs,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
)
from handlers.protocol.completion import CompletionResponse, CompletionResponseChoice
from handlers.protocol.derender import (
    DerenderChatRequest,
    DerenderChoice,
    DerenderCompletionRequest,
    GeneratedTokens,
)
from handlers.serving.base import ServingBase
from handlers.serving.chat import ServingChat
from handlers.serving.chat_template import choose_chat_template
from handlers.serving.choice import Choice, ChoiceOptions
from handlers.serving.completion import ServingCompletion
from handlers.serving.logprobs import chat_logprobs, completion_logprobs


class ServingDerender(ServingBase):
    kind = "derender"

    def __init__(self, chat: ServingChat, completion: ServingCompletion) -> None:
        super().__init__(chat.served)
        self.chat = chat
        self.completion = completion

    async def derender_chat(self, request: DerenderChatRequest) -> ChatCompletionResponse:
        chat = request.chat_request
        model_name = self.model_name(request.model or (chat.model if chat else None))
        generated = request.generate_response
        self._check_ids(generated, "generate_response")
        options = ChoiceOptions()
        template = None
        if chat is not None:
            template = choose_chat_template(self.served, chat)
            options = self.sequence_options(chat)
            if template.harmony:  # the parser reads the channels' special tokens
                options = dataclasses.replace(options, skip_special_tokens=False)
        choices = []
        for given in generated.choices:
            seq = self._decoded(given, options)
            if chat is not None and template is not None:
                choices.append(self.chat.finished_choice(chat, template, seq, seq.text))
                continue
            choices.append(
                ChatCompletionResponseChoice(
                    index=given.index,
                    message=ChatMessage(role=self.served.config.response_role, content=seq.text),
                    logprobs=self._chat_logprobs(seq) if given.logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        prompt = request.usage_prompt_tokens()
        completion = sum(len(c.token_ids) for c in generated.choices)
        return ChatCompletionResponse(
            id=generated.request_id,
            created=int(time.time()),
            model=model_name,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
            ),
        )

    async def derender_completion(self, request: DerenderCompletionRequest) -> CompletionResponse:
        original = request.completion_request
        model_name = self.model_name(request.model or (original.model if original else None))
        options = ChoiceOptions() if original is None else self.sequence_options(original)
        texts = self.served.token_texts(bool(original and original.return_tokens_as_token_ids))
        for at, generated in enumerate(request.generate_responses):
            self._check_ids(generated, f"generate_responses[{at}]")
        choices = []
        for generated in request.generate_responses:
            for given in generated.choices:
                seq = self._decoded(given, options)
                num_top = self._num_top(given) if original is None else original.logprobs
                logprobs = None
                if given.logprobs and num_top is not None:
                    logprobs = completion_logprobs(seq.logprobs, seq.token_ids, texts, num_top, 0)
                choices.append(
                    CompletionResponseChoice(
                        index=len(choices),
                        text=seq.text,
                        logprobs=logprobs,
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                    )
                )
        prompt = sum(request.usage_prompt_tokens())
        completion = sum(len(c.token_ids) for r in request.generate_responses for c in r.choices)
        return CompletionResponse(
            id=request.generate_responses[0].request_id,
            created=int(time.time()),
            model=model_name,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
            ),
        )

    # -- one choice -------------------------------------------------------------------
    def _check_ids(self, generated: GeneratedTokens, field: str) -> None:
        """What the request model cannot know: ids inside the model's vocabulary, at most
        its context length per choice (checked before anything is decoded)."""
        vocab, max_len = self.served.vocab_size(), self.served.info().max_model_len
        for i, choice in enumerate(generated.choices):
            where = f"{field}.choices[{i}]"
            if len(choice.token_ids) > max_len:
                raise BadRequestError(
                    f"{len(choice.token_ids)} token ids is more than the model's context "
                    f"length ({max_len}).",
                    param=f"{where}.token_ids",
                )
            for j, token_id in enumerate(choice.token_ids):
                if token_id >= vocab:
                    raise BadRequestError(
                        f"token id {token_id} is outside the model's vocabulary (0 to "
                        f"{vocab - 1}).",
                        param=f"{where}.token_ids[{j}]",
                    )
            content = choice.logprobs.content if choice.logprobs else None
            for j, entry in enumerate(content or ()):
                ids = [entry.token_id, *(top.token_id for top in entry.top_logprobs)]
                if any(t is None or t >= vocab for t in ids):
                    raise BadRequestError(
                        f"a logprob names a token outside the model's vocabulary (0 to "
                        f"{vocab - 1}).",
                        param=f"{where}.logprobs.content[{j}]",
                    )

    def _decoded(self, given: DerenderChoice, options: ChoiceOptions) -> Choice:
        """`given`'s ids folded into a `Choice` as one final engine output: decoded, cut at
        a stop string of the request, the stop token's text left out."""
        seq = Choice(given.index, self.served.tokenizer(), options)
        ids = given.token_ids
        stop_token = given.finish_reason == "stop" and (
            ids[-1] in self.served.info().eos_token_ids or given.stop_reason == ids[-1]
        )
        seq.process(
            RequestOutput(
                request_id="derender",
                new_token_ids=list(ids),
                new_logprobs=_engine_logprobs(given),
                finish_reason=given.finish_reason or "stop",
                stop_reason=given.stop_reason if isinstance(given.stop_reason, int) else None,
                finished_on_stop_token=stop_token,
            )
        )
        if isinstance(given.stop_reason, str):  # a stop string the generate call matched
            seq.stop_reason = given.stop_reason
        if given.finish_reason is None:  # an unfinished generation stays so (as vLLM says it)
            seq.finish_reason = seq.stop_reason = None
        return seq

    def _chat_logprobs(self, seq: Choice) -> ChatCompletionLogProbs:
        texts = self.served.token_texts()
        return ChatCompletionLogProbs(
            content=chat_logprobs(
                seq.logprobs, texts, max((len(e.top) for e in seq.logprobs), default=0)
            )
        )

    @staticmethod
    def _num_top(given: DerenderChoice) -> int:
        content = given.logprobs.content if given.logprobs else None
        return max((len(e.top_logprobs) for e in content or ()), default=0)


def _engine_logprobs(given: DerenderChoice) -> list[TokenLogprob] | None:
    """The choice's logprobs as the engine reports them (ids, values, alternatives)."""
    content = given.logprobs.content if given.logprobs else None
    if content is None:
        return None
    return [
        TokenLogprob(
            token_id=int(entry.token_id or 0),
            logprob=entry.logprob,
            rank=entry.rank or 0,
            top=[(int(top.token_id or 0), top.logprob) for top in entry.top_logprobs],
        )
        for entry in content
    ]
