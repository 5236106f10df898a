"""`create_app()`: the Falcon ASGI app over one engine client.

Builds the serving classes once per worker and wires the route table
(docs/architecture.md, "Routes"); the app runs inside `CancelOnDisconnect`, so a
client that goes away cancels its request wherever it waits.
Tests pass a fake engine and a small tokenizer; production passes the ZMQ client
(`asgi.py`).
"""

from __future__ import annotations

import logging
from typing import Any

import falcon
import falcon.asgi

from engine.client import EngineClient
from engine.tokenizer import Tokenizer
from handlers.config import ServerConfig
from handlers.http import resources
from handlers.http.disconnect import CancelOnDisconnect
from handlers.http.errors import handle_error
from handlers.http.media import json_handler
from handlers.http.metrics import PrometheusStats
from handlers.http.middleware import ApiKeyAuth, ConfiguredCORS, EngineLifespan, RequestSetup
from handlers.protocol.cohere_embed import CohereEmbedRequest
from handlers.protocol.embedding import ClassificationRequest, EmbeddingRequest, PoolingRequest
from handlers.protocol.generative_scoring import GenerativeScoringRequest
from handlers.protocol.score import RerankRequest, ScoreRequest
from handlers.serving import (
    ServedModel,
    ServingAdapters,
    ServingChat,
    ServingCompletion,
    ServingEmbedding,
    ServingInvocations,
    ServingMessages,
    ServingModels,
    ServingTGI,
    ServingTokenization,
    StatsSink,
)
from handlers.serving.classification import ServingClassification
from handlers.serving.cohere_embed import ServingCohereEmbed
from handlers.serving.control import ServingControl
from handlers.serving.derender import ServingDerender
from handlers.serving.generate import ServingGenerate
from handlers.serving.generate_render import ServingGenerateRender
from handlers.serving.generative_scoring import ServingGenerativeScoring
from handlers.serving.jsonlines import ServingJsonLines
from handlers.serving.pooling import ServingPooling
from handlers.serving.response_store import ResponseStore
from handlers.serving.responses import ServingResponses
from handlers.serving.score import ServingScores
from handlers.serving.sessions import ServingSessions


def create_app(
    config: ServerConfig,
    engine: EngineClient,
    tokenizer: Tokenizer | None = None,
    *,
    stats: StatsSink | None = None,
) -> CancelOnDisconnect:
    """The app. `tokenizer` defaults to `Tokenizer(config.model_dir)`, or to the engine's
    model directory once it is known when the config names none; `stats` defaults to
    the Prometheus metrics of this process."""
    # --disable-log-requests: the per-request info line goes; warnings and errors stay.
    logging.getLogger("handlers.requests").setLevel(
        logging.WARNING if config.disable_log_requests else logging.NOTSET
    )
    if tokenizer is None and config.model_dir:
        tokenizer = Tokenizer(config.model_dir)
    served = ServedModel(config, engine, tokenizer)
    stats = stats if stats is not None else PrometheusStats(config.metrics_label)
    chat = ServingChat(served, stats)
    completion = ServingCompletion(served, stats)
    tgi = ServingTGI(served, stats)
    embedding = ServingEmbedding(served, stats)
    scores = ServingScores(served, stats)
    messages = ServingMessages(chat)
    tokenization = ServingTokenization(served)
    responses = ServingResponses(
        chat,
        ResponseStore(
            config.runtime_dir,
            max_entries=config.responses_store_max_entries,
            max_bytes=config.responses_store_max_bytes,
            ttl_s=config.responses_store_ttl,
        ),
    )

    lifespan = EngineLifespan(engine, before_close=[responses.background.shutdown])
    middleware: list[object] = [RequestSetup(config), ApiKeyAuth(config), lifespan]
    if config.allowed_origins:
        middleware.insert(0, ConfiguredCORS(config))
    app = falcon.asgi.App(middleware=middleware)
    handler = json_handler()
    app.req_options.media_handlers[falcon.MEDIA_JSON] = handler
    app.resp_options.media_handlers[falcon.MEDIA_JSON] = handler
    app.req_options.strip_url_path_trailing_slash = True

    app.add_route("/v1/chat/completions", resources.ChatCompletions(config, chat))
    app.add_route("/v1/chat/completions/batch", resources.BatchChatCompletions(config, chat))
    app.add_route("/v1/completions", resources.Completions(config, completion))
    app.add_route(
        "/inference/v1/generate", resources.Generate(config, ServingGenerate(served, stats))
    )
    render = ServingGenerateRender(chat, completion)
    app.add_route("/v1/chat/completions/render", resources.RenderChat(config, render))
    app.add_route("/v1/completions/render", resources.RenderCompletion(config, render))
    derender = ServingDerender(chat, completion)
    app.add_route("/v1/chat/completions/derender", resources.DerenderChat(config, derender))
    app.add_route("/v1/completions/derender", resources.DerenderCompletion(config, derender))
    app.add_route(
        "/v1/embeddings",
        resources.PooledRoute(config, EmbeddingRequest, embedding.create, served.limits),
    )
    add_pooling_routes(app, config, served, stats, scores)
    adapters = ServingAdapters(served)
    models = ServingModels(served, adapters)
    app.add_route("/v1/models", resources.Models(models))
    app.add_route("/v1/models/{model:path}", resources.ModelById(models))
    if config.enable_lora and config.enable_runtime_lora_updating:
        app.add_route("/adapters", resources.Adapters(config, adapters))
        # names may hold "/" (org/sql), as /v1/models/{model:path} serves them
        app.add_route("/adapters/{adapter_name:path}", resources.Adapter(adapters))
        app.add_route("/v1/load_lora_adapter", resources.LoadLoRAAdapter(config, adapters))
        app.add_route("/v1/unload_lora_adapter", resources.UnloadLoRAAdapter(config, adapters))
    anthropic = resources.Messages(config, messages)
    app.add_route("/v1/messages", anthropic)
    app.add_route("/v1/messages/count_tokens", anthropic, suffix="count_tokens")
    app.add_route("/v1/messages/render", resources.RenderMessages(config, messages, render))
    app.add_route("/v1/responses", resources.Responses(config, responses))
    app.add_route("/v1/responses/render", resources.RenderResponses(config, responses, render))
    response_by_id = resources.ResponseById(responses)
    app.add_route("/v1/responses/{response_id}", response_by_id)
    app.add_route("/v1/responses/{response_id}/cancel", response_by_id, suffix="cancel")
    invocations = ServingInvocations(
        chat, completion, tgi, embedding, messages=messages, responses=responses, scores=scores
    )
    app.add_route(
        "/invocations",
        resources.Invocations(
            config,
            invocations,
            ServingSessions(config, engine),
            ServingJsonLines(invocations),
        ),
    )
    app.add_route("/execution-parameters", resources.ExecutionParameters(config, engine))
    app.add_route("/tokenize", resources.Tokenize(config, tokenization))
    app.add_route("/detokenize", resources.Detokenize(config, tokenization))
    app.add_route("/ping", resources.Ping(engine))
    app.add_route("/health", resources.Health(engine))
    app.add_route("/version", resources.Version(engine))
    app.add_route("/metrics", resources.Metrics())
    if config.enable_tokenizer_info_endpoint:
        app.add_route("/tokenizer_info", resources.TokenizerInfo(tokenization))
    if config.enable_server_load_tracking:
        app.add_route("/load", resources.Load(engine))
    add_control_routes(app, config, ServingControl(config, engine))

    app.add_error_handler(Exception, handle_error)
    app.add_error_handler(falcon.HTTPError, handle_error)
    return CancelOnDisconnect(app)


def add_control_routes(app: falcon.asgi.App, config: ServerConfig, control: ServingControl) -> None:
    """vLLM's developer routes (--server-dev-mode) and profiler routes (--profiler-config);
    absent (404) otherwise, as in vLLM."""
    if config.server_dev_mode:
        app.add_route("/reset_prefix_cache", resources.ResetPrefixCache(control))
        no_cache = resources.NoCacheToReset()
        app.add_route("/reset_mm_cache", no_cache)
        app.add_route("/reset_encoder_cache", no_cache)
        app.add_route("/server_info", resources.ServerInfo(control))
    if config.enable_profiler_routes:
        app.add_route("/start_profile", resources.StartProfile(config, control))
        app.add_route("/stop_profile", resources.StopProfile(control))


def add_pooling_routes(
    app: falcon.asgi.App,
    config: ServerConfig,
    served: ServedModel,
    stats: StatsSink,
    scores: ServingScores,
) -> None:
    """vLLM's pooling APIs beside /v1/embeddings, and Cohere's embed."""
    limits = served.limits
    pooling = ServingPooling(served, stats)
    classification = ServingClassification(served, stats)
    cohere = ServingCohereEmbed(served, stats)
    generative = ServingGenerativeScoring(served, stats)
    routes: list[tuple[tuple[str, ...], resources.PooledRoute[Any]]] = [
        (
            ("/pooling",),
            resources.PooledRoute(config, PoolingRequest, pooling.create_pooling, limits),
        ),
        (
            ("/classify",),
            resources.PooledRoute(
                config, ClassificationRequest, classification.create_classification, limits
            ),
        ),
        (
            ("/v2/embed",),
            resources.PooledRoute(config, CohereEmbedRequest, cohere.create_cohere, limits),
        ),
        (
            ("/generative_scoring",),
            resources.PooledRoute(config, GenerativeScoringRequest, generative.create, limits),
        ),
        (
            ("/score", "/v1/score"),
            resources.PooledRoute(config, ScoreRequest, scores.score, limits),
        ),
        (
            ("/rerank", "/v1/rerank", "/v2/rerank"),
            resources.PooledRoute(config, RerankRequest, scores.rerank, limits),
        ),
    ]
    for paths, resource in routes:
        for path in paths:
            app.add_route(path, resource)
