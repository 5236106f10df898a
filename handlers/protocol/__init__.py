"""The wire schema (pydantic v2), with OpenAI's own model names.

Request models validate ranges and build engine `SamplingParams`; response models
are what the serving classes return. Nothing here knows about HTTP.
"""

from handlers.protocol.base import (
    ErrorInfo,
    ErrorResponse,
    FieldError,
    OpenAIBaseModel,
    PromptTokensDetails,
    RequestLimits,
    StreamOptions,
    UsageInfo,
    WireModel,
    parse_request,
)
from handlers.protocol.chat import (
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    ChatMessageParam,
    DeltaMessage,
)
from handlers.protocol.completion import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from handlers.protocol.models import ModelCard, ModelList
from handlers.protocol.structured import ResponseFormat, StructuredOutputsParams
from handlers.protocol.tgi import (
    TGIDetails,
    TGIParameters,
    TGIRequest,
    TGIResponse,
    TGIResponses,
    TGIStreamDetails,
    TGIStreamResponse,
    TGIToken,
)
from handlers.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

__all__ = [
    "ChatCompletionChunk",
    "ChatCompletionChunkChoice",
    "ChatCompletionLogProb",
    "ChatCompletionLogProbs",
    "ChatCompletionLogProbsContent",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatMessage",
    "ChatMessageParam",
    "CompletionLogProbs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionResponseChoice",
    "CompletionResponseStreamChoice",
    "CompletionStreamResponse",
    "DeltaMessage",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorInfo",
    "ErrorResponse",
    "FieldError",
    "ModelCard",
    "ModelList",
    "OpenAIBaseModel",
    "PromptTokensDetails",
    "RequestLimits",
    "ResponseFormat",
    "StreamOptions",
    "StructuredOutputsParams",
    "TGIDetails",
    "TGIParameters",
    "TGIRequest",
    "TGIResponse",
    "TGIResponses",
    "TGIStreamDetails",
    "TGIStreamResponse",
    "TGIToken",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeResponse",
    "UsageInfo",
    "WireModel",
    "parse_request",
]
