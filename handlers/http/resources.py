"""Falcon resources: parse the body, call one serving method, write the response.

Everything about OpenAI semantics lives in the serving classes; these only know HTTP.
A serving method returns a pydantic model (sent as JSON) or an already-admitted SSE
stream, which is framed as server-sent events here.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import AsyncGenerator, Awaitable, Callable
from http import HTTPStatus
from typing import Any, Generic, TypeVar

import falcon
import falcon.asgi
from pydantic import BaseModel

from engine.client import EngineClient
from handlers.config import ServerConfig
from handlers.errors import FailedDependencyError, ServiceUnavailableError, ServingError
from handlers.http.errors import error_response
from handlers.http.media import parse_json, read_body, read_json
from handlers.http.metrics import render_metrics
from handlers.protocol.adapters import (
    LoadLoRAAdapterRequest,
    RegisterAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from handlers.protocol.anthropic import CountTokensRequest, MessagesRouteRequest
from handlers.protocol.base import ModelT, RequestLimits, parse_request
from handlers.protocol.chat import ChatCompletionRequest, parse_batch_chat
from handlers.protocol.completion import CompletionRequest
from handlers.protocol.control import StartProfileRequest
from handlers.protocol.derender import DerenderChatRequest, DerenderCompletionRequest
from handlers.protocol.generate import GenerateRequest
from handlers.protocol.responses import ResponsesRequest
from handlers.protocol.tokenize import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from handlers.serving.adapters import ServingAdapters
from handlers.serving.chat import ServingChat
from handlers.serving.completion import ServingCompletion
from handlers.serving.context import RequestContext
from handlers.serving.control import ServingControl
from handlers.serving.derender import ServingDerender
from handlers.serving.generate import ServingGenerate
from handlers.serving.generate_render import ServingGenerateRender
from handlers.serving.invocations import ServingInvocations
from handlers.serving.jsonlines import JSONLINES_MEDIA_TYPE, ServingJsonLines, is_jsonlines
from handlers.serving.messages import ServingMessages, anthropic_dialect
from handlers.serving.models import ServingModels
from handlers.serving.responses import ServingResponses
from handlers.serving.sessions import SESSION_ID_HEADER, ServingSessions
from handlers.serving.sse import SSEEvent, SSEStream
from handlers.serving.tokenization import ServingTokenization

RequestT = TypeVar("RequestT", bound=BaseModel)

ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"
"""SageMaker's adapter selector on /invocations (an adapter inference component's name)."""


def request_context(req: falcon.asgi.Request) -> RequestContext:
    ctx = RequestContext(request_id=getattr(req.context, "request_id", None))
    arrival = getattr(req.context, "arrival_time", None)
    if arrival is not None:
        ctx.arrival_time = arrival
    return ctx


def send_model(resp: falcon.asgi.Response, model: BaseModel) -> None:
    resp.content_type = falcon.MEDIA_JSON
    resp.data = model.__pydantic_serializer__.to_json(model)


KEEP_ALIVE_COMMENT = b": ping\n\n"


async def sse_frames(payloads: SSEStream) -> AsyncGenerator[bytes, None]:
    """Serving payloads framed as server-sent events (`data: ...`, blank line).

    `None` is a keep-alive tick, sent as a comment; the serving layer yields one only
    when `--sse-keep-alive-interval` is set. A client disconnect cancels the request
    (`CancelOnDisconnect`); the payload stream's own `finally` then aborts the engine
    requests, and closing it here covers an iteration that stops for any other reason.
    """
    try:
        async for payload in payloads:
            if payload is None:
                yield KEEP_ALIVE_COMMENT
            elif isinstance(payload, SSEEvent):
                yield b"event: " + payload.name.encode() + b"\ndata: " + payload.data + b"\n\n"
            else:
                yield b"data: " + payload + b"\n\n"
    finally:
        await payloads.aclose()


def send_result(resp: falcon.asgi.Response, result: BaseModel | SSEStream) -> None:
    if isinstance(result, BaseModel):
        send_model(resp, result)
        return
    # NOTE: resp.stream rather than resp.sse: Falcon's SSE loop adds a disconnect watcher
    # task and an SSEvent per chunk, and CancelOnDisconnect already watches.
    resp.content_type = "text/event-stream"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")
    resp.stream = sse_frames(result)


class _JsonBody:
    """Base of the POST resources: the body cap and the validation limits."""

    any_content_type = False

    def __init__(self, config: ServerConfig) -> None:
        self._limit = config.max_request_body_bytes

    async def body(self, req: falcon.asgi.Request) -> Any:
        return await read_json(req, self._limit, any_content_type=self.any_content_type)


class ChatCompletions(_JsonBody):
    def __init__(self, config: ServerConfig, serving: ServingChat) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        request = parse_request(
            ChatCompletionRequest, await self.body(req), self._serving.served.limits
        )
        send_result(resp, await self._serving.create(request, request_context(req)))


class BatchChatCompletions(_JsonBody):
    """vLLM's `POST /v1/chat/completions/batch`: several conversations, one choice each."""

    def __init__(self, config: ServerConfig, serving: ServingChat) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        requests = parse_batch_chat(await self.body(req), self._serving.served.limits)
        send_model(resp, await self._serving.create_batch(requests, request_context(req)))


class Completions(_JsonBody):
    def __init__(self, config: ServerConfig, serving: ServingCompletion) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        request = parse_request(
            CompletionRequest, await self.body(req), self._serving.served.limits
        )
        send_result(resp, await self._serving.create(request, request_context(req)))


class PooledRoute(_JsonBody, Generic[RequestT]):
    """A pooling API's POST route (OpenAI's `/v1/embeddings`; vLLM's `/pooling`,
    `/classify`, `/score`, `/rerank`, `/generative_scoring`; Cohere's `/v2/embed`): the
    body validated as `request_model`
    (under the server's limits), answered by `answer`, never streamed."""

    def __init__(
        self,
        config: ServerConfig,
        request_model: type[RequestT],
        answer: Callable[[RequestT, RequestContext], Awaitable[BaseModel]],
        limits: RequestLimits,
    ) -> None:
        super().__init__(config)
        self._model = request_model
        self._answer = answer
        self._limits = limits

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        request = parse_request(self._model, await self.body(req), self._limits)
        send_model(resp, await self._answer(request, request_context(req)))


class Messages(_JsonBody):
    """Anthropic's `POST /v1/messages` and, as the `count_tokens` suffix route,
    `POST /v1/messages/count_tokens` (errors in Anthropic's shape: `handle_error`)."""

    def __init__(self, config: ServerConfig, serving: ServingMessages) -> None:
        super().__init__(config)
        self._serving = serving

    async def _parse(self, req: falcon.asgi.Request, model: type[ModelT]) -> ModelT:
        with anthropic_dialect():
            return parse_request(model, await self.body(req), self._serving.chat.served.limits)

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        request = await self._parse(req, MessagesRouteRequest)
        send_result(resp, await self._serving.create(request, request_context(req)))

    async def on_post_count_tokens(
        self, req: falcon.asgi.Request, resp: falcon.asgi.Response
    ) -> None:
        request = await self._parse(req, CountTokensRequest)
        send_model(resp, await self._serving.count_tokens(request))


class RenderMessages(Messages):
    """vLLM's `POST /v1/messages/render`: the generate request a Messages call would run
    (Anthropic's error shape, as on /v1/messages)."""

    def __init__(
        self, config: ServerConfig, serving: ServingMessages, render: ServingGenerateRender
    ) -> None:
        super().__init__(config, serving)
        self._render = render

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        request = await self._parse(req, MessagesRouteRequest)
        resp.media = await self._render.render_messages(request)


class Responses(_JsonBody):
    """`POST /v1/responses`."""

    def __init__(self, config: ServerConfig, serving: ServingResponses) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        request = parse_request(ResponsesRequest, await self.body(req), self._serving.limits)
        send_result(resp, await self._serving.create(request, request_context(req)))


class RenderResponses(_JsonBody):
    """vLLM's `POST /v1/responses/render`: the generate request a Responses call would run."""

    def __init__(
        self, config: ServerConfig, serving: ServingResponses, render: ServingGenerateRender
    ) -> None:
        super().__init__(config)
        self._serving = serving
        self._render = render

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        request = parse_request(ResponsesRequest, await self.body(req), self._serving.limits)
        resp.media = await self._render.render_responses(request, self._serving)


class ResponseById:
    """`GET` and `DELETE /v1/responses/{response_id}`; `POST .../cancel` (suffix)."""

    def __init__(self, serving: ServingResponses) -> None:
        self._serving = serving

    async def on_get(
        self, req: falcon.asgi.Request, resp: falcon.asgi.Response, response_id: str
    ) -> None:
        """With `?stream=true` (and `starting_after=N`), a background response's events
        after event N, then as they come (`ServingResponses.stream_stored`)."""
        if req.get_param_as_bool("stream", default=False):
            after = req.get_param_as_int("starting_after", min_value=0, default=-1)
            send_result(resp, await self._serving.stream_stored(response_id, after))
            return
        send_model(resp, await self._serving.retrieve(response_id))

    async def on_delete(
        self, req: falcon.asgi.Request, resp: falcon.asgi.Response, response_id: str
    ) -> None:
        send_model(resp, await self._serving.delete(response_id))

    async def on_post_cancel(
        self, req: falcon.asgi.Request, resp: falcon.asgi.Response, response_id: str
    ) -> None:
        send_model(resp, await self._serving.cancel(response_id))


class Invocations(_JsonBody):
    """SageMaker's one inference route; any Content-Type, dispatch by body. A JSON Lines
    body (batch transform) runs every record; the session headers are SageMaker's
    stateful sessions (`handlers/serving/sessions.py`)."""

    any_content_type = True

    def __init__(
        self,
        config: ServerConfig,
        serving: ServingInvocations,
        sessions: ServingSessions,
        lines: ServingJsonLines,
    ) -> None:
        super().__init__(config)
        self._serving = serving
        self._sessions = sessions
        self._lines = lines

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        jsonlines = is_jsonlines(req.content_type)
        body = await read_body(req, self._limit) if jsonlines else await self.body(req)
        step = await self._sessions.begin(
            None if jsonlines else body, req.get_header(SESSION_ID_HEADER)
        )
        if step.reply is not None:
            resp.set_headers(step.headers)
            resp.content_type = falcon.MEDIA_TEXT
            resp.text = step.reply
            return
        ctx = request_context(req)
        ctx.adapter = req.get_header(ADAPTER_HEADER) or None
        ctx.session_id = step.session_id
        try:
            if jsonlines:
                data = await self._lines.invoke_lines(json_lines(body), ctx)
            else:
                result = await self._serving.invoke(body, ctx)
        except BaseException:
            await self._sessions.discard(step)  # a refused first turn opens no session
            raise
        resp.set_headers(step.headers)  # the new session's id, once its first turn runs
        if jsonlines:
            resp.content_type = JSONLINES_MEDIA_TYPE
            resp.data = data
            return
        send_result(resp, result)


def json_lines(data: bytes) -> list[Any | ServingError]:
    """Each non-blank line decoded, or the 400 that decoding it raised (the record's own
    error line; the others still run)."""
    records: list[Any | ServingError] = []
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            records.append(parse_json(line))
        except ServingError as exc:
            records.append(exc)
    return records


class ExecutionParameters:
    """`GET /execution-parameters`: what a SageMaker batch transform job should send,
    asked before the job starts. From the engine's capacity: it runs `max_num_seqs`
    sequences at once, and every record of a MultiRecord payload joins that batch; the
    payload cap is the body limit (SageMaker allows at most 100 MB)."""

    def __init__(self, config: ServerConfig, engine: EngineClient) -> None:
        self._max_body = config.max_request_body_bytes
        self._engine = engine

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        info = self._engine.model_info
        if info is None:
            error_response(resp, ServiceUnavailableError("The model is still loading."))
            return
        resp.media = {
            "MaxConcurrentTransforms": max(1, info.max_num_seqs),
            "BatchStrategy": "MULTI_RECORD",
            "MaxPayloadInMB": max(1, min(MAX_BATCH_PAYLOAD_MB, self._max_body >> 20)),
        }


MAX_BATCH_PAYLOAD_MB = 100
"""SageMaker's upper bound of a transform job's MaxPayloadInMB."""


class Tokenize(_JsonBody):
    def __init__(self, config: ServerConfig, serving: ServingTokenization) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await self.body(req)
        kind = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else None
        request = parse_request(kind or TokenizeCompletionRequest, body)
        send_model(resp, await self._serving.tokenize(request))


class Detokenize(_JsonBody):
    def __init__(self, config: ServerConfig, serving: ServingTokenization) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        request = parse_request(DetokenizeRequest, await self.body(req))
        send_model(resp, await self._serving.detokenize(request))


class TokenizerInfo:
    """vLLM's `GET /tokenizer_info` (with --enable-tokenizer-info-endpoint)."""

    def __init__(self, serving: ServingTokenization) -> None:
        self._serving = serving

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.media = self._serving.tokenizer_info()


class Generate(_JsonBody):
    """vLLM's `POST /inference/v1/generate`: token ids in, token ids out."""

    def __init__(self, config: ServerConfig, serving: ServingGenerate) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        request = parse_request(GenerateRequest, await self.body(req), self._serving.served.limits)
        send_result(resp, await self._serving.generate(request, request_context(req)))


class RenderChat(_JsonBody):
    """vLLM's `POST /v1/chat/completions/render`: the generate request a chat would run."""

    def __init__(self, config: ServerConfig, serving: ServingGenerateRender) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        request = parse_request(
            ChatCompletionRequest, await self.body(req), self._serving.served.limits
        )
        resp.media = await self._serving.render_chat(request)


class RenderCompletion(_JsonBody):
    """vLLM's `POST /v1/completions/render`: one generate request per prompt."""

    def __init__(self, config: ServerConfig, serving: ServingGenerateRender) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        request = parse_request(
            CompletionRequest, await self.body(req), self._serving.served.limits
        )
        resp.media = await self._serving.render_completion(request)


class DerenderChat(_JsonBody):
    """vLLM's `POST /v1/chat/completions/derender`: a generate response's tokens as the
    chat response they make."""

    def __init__(self, config: ServerConfig, serving: ServingDerender) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        request = parse_request(
            DerenderChatRequest, await self.body(req), self._serving.served.limits
        )
        send_model(resp, await self._serving.derender_chat(request))


class DerenderCompletion(_JsonBody):
    """vLLM's `POST /v1/completions/derender`: one generate response per prompt as the
    completion response they make."""

    def __init__(self, config: ServerConfig, serving: ServingDerender) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        request = parse_request(
            DerenderCompletionRequest, await self.body(req), self._serving.served.limits
        )
        send_model(resp, await self._serving.derender_completion(request))


class ResetPrefixCache:
    """vLLM's `POST /reset_prefix_cache[?reset_running_requests=true]` (--server-dev-mode)."""

    def __init__(self, serving: ServingControl) -> None:
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        reset_running = req.get_param_as_bool("reset_running_requests", default=False)
        resp.media = await self._serving.reset_prefix_cache(reset_running)


class NoCacheToReset:
    """vLLM's `/reset_mm_cache` and `/reset_encoder_cache` (--server-dev-mode): hearth
    serves text models and keeps neither cache, so there is nothing to reset; 200 as
    vLLM answers, so sweeps that call all three resets work."""

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.status = HTTPStatus.OK
        resp.data = b""


class ServerInfo:
    """vLLM's `GET /server_info` (--server-dev-mode): the configuration, secrets left out."""

    def __init__(self, serving: ServingControl) -> None:
        self._serving = serving

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.media = self._serving.server_info()


class StartProfile(_JsonBody):
    """vLLM's `POST /start_profile` (--profiler-config); the body is optional."""

    def __init__(self, config: ServerConfig, serving: ServingControl) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await self.body(req) if req.content_length else {}
        await self._serving.start_profile(parse_request(StartProfileRequest, body))
        resp.status = HTTPStatus.OK
        resp.data = b""


class StopProfile:
    """vLLM's `POST /stop_profile`: 200 once the trace is written (its paths are logged by
    the engine)."""

    def __init__(self, serving: ServingControl) -> None:
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self._serving.stop_profile()
        resp.status = HTTPStatus.OK
        resp.data = b""


class Models:
    def __init__(self, serving: ServingModels) -> None:
        self._serving = serving

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        send_model(resp, await self._serving.list())


class ModelById:
    """`GET /v1/models/{model}`: one model card (the name may hold slashes:
    ``org/name``)."""

    def __init__(self, serving: ServingModels) -> None:
        self._serving = serving

    async def on_get(
        self, req: falcon.asgi.Request, resp: falcon.asgi.Response, model: str
    ) -> None:
        send_model(resp, await self._serving.retrieve(model))


class Ping:
    """SageMaker readiness: 200 only once the engine is warm. Never waits on the engine."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if self._engine.is_dead():
            error_response(resp, ServiceUnavailableError("The engine has stopped."))
        elif not self._engine.is_ready():
            error_response(resp, ServiceUnavailableError("The model is still loading."))
        else:
            resp.status = HTTPStatus.OK
            resp.data = b""

    on_post = on_get


class Health:
    """Liveness: 200 until the engine is dead (a loading engine is alive)."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if self._engine.is_dead():
            error_response(resp, ServiceUnavailableError("The engine has stopped."))
        else:
            resp.status = HTTPStatus.OK
            resp.data = b""


def server_version() -> str:
    try:
        return importlib.metadata.version("hearth")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0+unknown"


class Version:
    """The server version, plus (once the engine is warm) the weights mode and kernels it
    chose for this host, so a deployment can check what it runs."""

    def __init__(self, engine: EngineClient | None = None) -> None:
        self._engine = engine

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body: dict[str, str] = {"version": server_version()}
        info = self._engine.model_info if self._engine is not None else None
        if info is not None:
            body["quantization"] = info.quantization
            body["kernels"] = info.kernels
            body["architecture"] = info.architecture
        resp.media = body


class Load:
    """In-flight engine requests of this worker (vLLM's /load)."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.media = {"server_load": self._engine.num_in_flight}


class Metrics:
    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        data, content_type = render_metrics()
        resp.content_type = content_type
        resp.data = data


def send_text(resp: falcon.asgi.Response, text: str) -> None:
    """The adapter routes answer plain text on success, as vLLM and SageMaker's do."""
    resp.content_type = falcon.MEDIA_TEXT
    resp.text = text


class Adapters(_JsonBody):
    """SageMaker's `POST /adapters {"name", "src"}`: register an adapter."""

    def __init__(self, config: ServerConfig, serving: ServingAdapters) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = parse_request(RegisterAdapterRequest, await self.body(req))
        await self._serving.load(body.name, body.src, invalid_error=FailedDependencyError)
        send_text(resp, f"Adapter {body.name} registered")


class Adapter:
    """SageMaker's `DELETE /adapters/{adapter_name}`: unregister it."""

    def __init__(self, serving: ServingAdapters) -> None:
        self._serving = serving

    async def on_delete(
        self, req: falcon.asgi.Request, resp: falcon.asgi.Response, adapter_name: str
    ) -> None:
        await self._serving.unload(adapter_name)
        send_text(resp, f"Adapter {adapter_name} unregistered")


class LoadLoRAAdapter(_JsonBody):
    """vLLM's `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`."""

    def __init__(self, config: ServerConfig, serving: ServingAdapters) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = parse_request(LoadLoRAAdapterRequest, await self.body(req))
        await self._serving.load(body.lora_name, body.lora_path)
        send_text(resp, f"Success: LoRA adapter '{body.lora_name}' added successfully.")


class UnloadLoRAAdapter(_JsonBody):
    """vLLM's `POST /v1/unload_lora_adapter {"lora_name"}`."""

    def __init__(self, config: ServerConfig, serving: ServingAdapters) -> None:
        super().__init__(config)
        self._serving = serving

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = parse_request(UnloadLoRAAdapterRequest, await self.body(req))
        await self._serving.unload(body.lora_name)
        send_text(resp, f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
