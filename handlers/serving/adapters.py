"""LoRA adapter management: register (fetching an s3:// source first), unregister, list.

The registry lives in the engine (one for every API worker): this class only checks
the names, fetches S3 sources off the event loop into the runtime directory, and turns
the engine's answers into typed errors. Which error a bad adapter is depends on the
route family (`invalid_error`): vLLM's routes answer 400, SageMaker's 424 (Failed
Dependency, as AWS's container standards map adapter errors).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from engine.lora_source import (
    AdapterSourceError,
    default_fetch_root,
    discard_fetched,
    listed_source,
    resolve_adapter_source,
)
from engine.messages import AdapterCard, AdapterReply
from handlers.errors import BadRequestError, NotFoundError, ServingError, from_engine_error
from handlers.serving.served_model import ServedModel


class ServingAdapters:
    def __init__(self, served: ServedModel) -> None:
        self.served = served

    @property
    def _fetch_root(self) -> Path:
        runtime = self.served.config.runtime_dir
        return Path(runtime) / "adapters" if runtime else default_fetch_root()

    async def load(
        self, name: str, src: str, invalid_error: type[ServingError] = BadRequestError
    ) -> AdapterReply:
        if name in self.served.names:
            raise BadRequestError(
                f"The adapter name '{name}' is the base model's served name.", param="name"
            )
        try:
            path = await asyncio.to_thread(resolve_adapter_source, src, self._fetch_root)
        except AdapterSourceError as exc:
            raise invalid_error(str(exc), param="src") from None
        try:
            return await self._command("load", name, path, invalid_error, source=listed_source(src))
        finally:  # read into the engine's memory, or refused: an S3 download is done with
            await asyncio.to_thread(discard_fetched, path, self._fetch_root)

    async def unload(self, name: str) -> AdapterReply:
        return await self._command("unload", name, None, BadRequestError)

    async def list(self) -> list[AdapterCard]:
        if not self.served.config.enable_lora:
            return []
        return (await self._command("list", None, None, BadRequestError)).adapters

    async def _command(
        self,
        op: str,
        name: str | None,
        path: str | None,
        invalid_error: type[ServingError],
        source: str | None = None,
    ) -> AdapterReply:
        try:
            reply = await self.served.engine.adapter_command(op, name, path, source)
        except Exception as exc:
            mapped = from_engine_error(exc)
            if mapped is not None:
                raise mapped from None
            raise
        if reply.ok:
            return reply
        message = reply.message or "the adapter command failed"
        if reply.error_kind == "not_found":
            raise NotFoundError(message, param="name")
        if reply.error_kind == "invalid":
            raise invalid_error(message, param="src")
        raise BadRequestError(message, param="name")  # a name taken, LoRA disabled
