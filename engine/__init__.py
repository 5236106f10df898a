"""Tokens in, tokens out: the engine and the client interface the serving layer uses.

Importing this package must stay light (no torch): API workers import it. The torch
side (`engine.core`, `engine.model_runner`, `engine.models`) is imported only by the
engine core process or thread.
"""

from engine.client import EngineClient
from engine.collector import OutputCollector
from engine.config import EngineConfig, ModelInfo
from engine.errors import (
    EngineDeadError,
    EngineError,
    EngineNotReadyError,
    EngineOverloadedError,
    InvalidEngineRequestError,
)
from engine.messages import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

__all__ = [
    "ChatTemplateError",
    "EngineClient",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineNotReadyError",
    "EngineOverloadedError",
    "IncrementalDetokenizer",
    "InvalidEngineRequestError",
    "ModelInfo",
    "OutputCollector",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "Tokenizer",
]
