"""The envelope and usage rules every OpenAI stream shares (chat and completion chunks)."""

from __future__ import annotations

from typing import Any

from handlers.protocol.base import ChunkModel, StreamOptions, UsageInfo
from handlers.serving.base import Run
from handlers.serving.sse import encode_chunk


class StreamChunks:
    """Encodes the chunks of one run's stream as `stream_options` asks for them.

    Chat and completion streams differ only in their choices; the id/created/model
    envelope, when `usage` is set (and so serialized), the continuous usage of vLLM and
    the final usage-only chunk are one rule for both.
    """

    def __init__(
        self,
        run: Run,
        chunk_type: type[ChunkModel],
        options: StreamOptions | None,
        *,
        include_cached: bool,
    ) -> None:
        self.run = run
        self.chunk_type = chunk_type
        self.include_usage = bool(options and options.include_usage)
        self.continuous = bool(options and options.include_usage and options.continuous_usage_stats)
        self.include_cached = include_cached

    def chunk(self, choices: list[Any], usage: UsageInfo | None, **extra: Any) -> bytes:
        """One chunk; `usage` is left unset (so absent from the JSON) when None; `extra`:
        more envelope fields of this chunk (chat's first `prompt_token_ids`)."""
        fields: dict[str, Any] = {
            "id": self.run.response_id,
            "created": self.run.created,
            "model": self.run.model_name,
            "choices": choices,
            **extra,
        }
        if usage is not None:
            fields["usage"] = usage
        return encode_chunk(self.chunk_type(**fields))

    def running_usage(self) -> UsageInfo | None:
        """The usage so far for every chunk (`continuous_usage_stats`), else None."""
        return self.run.usage(include_cached=self.include_cached) if self.continuous else None

    def tail(self) -> list[bytes]:
        """The last chunk, `choices: []` with the whole usage, when `include_usage`."""
        if not self.include_usage:
            return []
        return [self.chunk([], self.run.usage(include_cached=self.include_cached))]
