"""SageMaker's `POST /invocations`: one route, the API chosen by the body's shape.

`messages` means chat, `prompt` means completion, `inputs` means TGI's generate (what
clients of HF's TGI containers send), `input` means the Responses API. Dispatching on the key rather than on "the
first model that validates" (vLLM's way) keeps the precise 400 of the intended API
instead of a generic "matches nothing".
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from handlers.errors import BadRequestError
from handlers.protocol.base import parse_request
from handlers.protocol.chat import ChatCompletionRequest
from handlers.protocol.completion import CompletionRequest
from handlers.protocol.responses import ResponsesRequest
from handlers.protocol.tgi import TGIRequest
from handlers.serving.chat import ServingChat
from handlers.serving.completion import ServingCompletion
from handlers.serving.context import RequestContext
from handlers.serving.responses import ServingResponses
from handlers.serving.sse import SSEStream
from handlers.serving.tgi import ServingTGI

ACCEPTED_KINDS = (
    "a chat completion request (with 'messages')",
    "a completion request (with 'prompt')",
    "a TGI generate request (with 'inputs')",
    "a Responses request (with 'input')",
)


class ServingInvocations:
    def __init__(
        self,
        chat: ServingChat,
        completion: ServingCompletion,
        tgi: ServingTGI,
        responses: ServingResponses | None = None,
    ) -> None:
        self.chat = chat
        self.completion = completion
        self.tgi = tgi
        self.responses = responses

    async def invoke(self, body: Any, ctx: RequestContext) -> BaseModel | SSEStream:
        """Streams iff the body says `"stream": true`, whatever the API."""
        limits = self.chat.served.limits
        if isinstance(body, dict):
            if "messages" in body:
                chat = parse_request(ChatCompletionRequest, body, limits)
                return await self.chat.create(chat, ctx)
            if "prompt" in body:
                completion = parse_request(CompletionRequest, body, limits)
                return await self.completion.create(completion, ctx)
            if "inputs" in body:
                return await self.tgi.generate(parse_request(TGIRequest, body, limits), ctx)
            if "input" in body and self.responses is not None:
                request = parse_request(ResponsesRequest, body, limits)
                return await self.responses.create(request, ctx)
        raise BadRequestError(
            "The /invocations body must be a JSON object: " + "; ".join(ACCEPTED_KINDS) + ".",
            param=None,
        )
