"""The bodies of vLLM's profiler route (`POST /start_profile`); the other operator routes
take query parameters or nothing."""

from __future__ import annotations

from pydantic import Field

from handlers.protocol.base import OpenAIBaseModel


class StartProfileRequest(OpenAIBaseModel):
    """vLLM's optional overrides for one profiling session (an empty body: none)."""

    profile_prefix: str | None = Field(default=None, max_length=256)
    """Names the session's files (path characters become '_')."""
    delay_iterations: int | None = Field(default=None, ge=0, le=1_000_000)
    """Engine steps to let pass before recording."""
    max_iterations: int | None = Field(default=None, ge=0, le=1_000_000)
    """Stop by itself after this many recorded steps."""
