"""Transport-neutral serving classes shared by HTTP (`/v1`, `/invocations`) and Lambda.

They take validated protocol models and return a response model, or an async iterator
of SSE payloads for a stream that is already admitted. They never import Falcon.
"""

from handlers.serving.adapters import ServingAdapters
from handlers.serving.base import ServingBase
from handlers.serving.chat import ServingChat
from handlers.serving.completion import ServingCompletion
from handlers.serving.context import RequestContext
from handlers.serving.embedding import ServingEmbedding
from handlers.serving.invocations import ServingInvocations
from handlers.serving.messages import ServingMessages
from handlers.serving.models import ServingModels
from handlers.serving.served_model import ServedModel
from handlers.serving.sse import DONE, SSEStream
from handlers.serving.stats import NullStatsSink, RequestRecord, StatsSink
from handlers.serving.tgi import ServingTGI
from handlers.serving.tokenization import ServingTokenization

__all__ = [
    "DONE",
    "NullStatsSink",
    "RequestContext",
    "RequestRecord",
    "SSEStream",
    "ServedModel",
    "ServingAdapters",
    "ServingBase",
    "ServingChat",
    "ServingCompletion",
    "ServingEmbedding",
    "ServingInvocations",
    "ServingMessages",
    "ServingModels",
    "ServingTGI",
    "ServingTokenization",
    "StatsSink",
]
