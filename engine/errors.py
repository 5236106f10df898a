"""Typed engine errors that the serving layer maps to HTTP statuses."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine reports to a caller."""


class EngineDeadError(EngineError):
    """The engine core process is gone; the server answers 503 and the container restarts."""


class EngineNotReadyError(EngineError):
    """The engine is still loading or warming up (503)."""


class EngineOverloadedError(EngineError):
    """Admission refused: the waiting queue is full (503, answered before any status line)."""


class InvalidEngineRequestError(EngineError):
    """The engine refused a request as malformed (400); the serving layer should catch it first."""

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownAdapterError(EngineError):
    """The request names a LoRA adapter the engine has not registered (404, as vLLM
    answers an unknown `model`)."""


class EngineShuttingDownError(EngineDeadError):
    """The server's drain deadline came before this request finished (503)."""
