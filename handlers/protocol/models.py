"""`GET /v1/models`: the served model names."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from handlers.protocol.base import WireModel


class ModelCard(WireModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hearth"
    root: str | None = None
    """The model directory the engine loaded (vLLM reports the model path here)."""
    parent: str | None = None
    max_model_len: int | None = None
    architecture: str | None = None
    """The native architecture serving the model (``config.architectures[0]``); absent
    while the engine is still loading."""


class ModelList(WireModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
