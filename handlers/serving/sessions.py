"""SageMaker's stateful (sticky) sessions on `/invocations`, transport-neutral.

The protocol (AWS's model-hosting-container-standards, `sagemaker/sessions/`):

- a caller invokes with `SessionId=NEW_SESSION` and the body `{"requestType":
  "NEW_SESSION"}`; the answer carries `X-Amzn-SageMaker-New-Session-Id: <id>;
  Expires=<YYYY-MM-DDTHH:MM:SSZ>` and SageMaker routes the session's later calls, which
  carry `X-Amzn-SageMaker-Session-Id: <id>`, to this instance;
- the header `X-Amzn-SageMaker-Session-Id: NEW_SESSION` on an ordinary inference body
  opens a session too and runs that first turn in it (one call instead of two);
- `{"requestType": "CLOSE"}` with the session header closes it; the answer carries
  `X-Amzn-SageMaker-Closed-Session-Id: <id>`;
- an unknown, closed or expired id is a 400, as in the reference.

The table of sessions is the engine's (`engine/sessions.py`): every API worker reaches
it over the IPC, so a session opened through one worker is valid in all of them. What a
session buys is the prefix cache: the engine pins the blocks of its requests, so a
conversation's next turn finds its KV warm even under other load.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from engine.client import EngineClient
from handlers.config import ServerConfig
from handlers.errors import BadRequestError, from_engine_error

SESSION_ID_HEADER = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_ID_HEADER = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_SESSION_ID_HEADER = "X-Amzn-SageMaker-Closed-Session-Id"
NEW_SESSION = "NEW_SESSION"
CLOSE = "CLOSE"
REQUEST_TYPES = (NEW_SESSION, CLOSE)


@dataclass(slots=True)
class SessionStep:
    """What the session protocol made of one `/invocations` call."""

    session_id: str | None = None
    """The session the inference runs in (None: none)."""
    headers: dict[str, str] = field(default_factory=dict)
    """Response headers to send (the new or closed session's id)."""
    reply: str | None = None
    """When set, the call was a session request only: answer 200 with this text."""


def expires_header(session_id: str, expires_at: float) -> str:
    """`<id>; Expires=<YYYY-MM-DDTHH:MM:SSZ>` (UTC, whole seconds, as the reference)."""
    stamp = datetime.fromtimestamp(expires_at, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"{session_id}; Expires={stamp}"


def request_type(body: Any) -> str | None:
    """`requestType` of a session request; None for an ordinary inference body."""
    if not isinstance(body, dict) or "requestType" not in body:
        return None
    kind = body["requestType"]
    if kind not in REQUEST_TYPES:
        raise BadRequestError(
            f"requestType must be {' or '.join(REQUEST_TYPES)}, not {kind!r}.",
            param="requestType",
        )
    return str(kind)


def _refuse_contradictions(body: Any, kind: str | None, header: str | None) -> None:
    """400 for a call that asks two things at once: to close a session it opens, to open
    a session while naming one, or to open one on a streamed call (SageMaker opens
    sessions through InvokeEndpoint only; the stream's caller could not read the id)."""
    if kind == CLOSE and header == NEW_SESSION:
        raise BadRequestError(
            f"A CLOSE request names the session to close in {SESSION_ID_HEADER}, not NEW_SESSION.",
            param=SESSION_ID_HEADER,
        )
    if kind == NEW_SESSION and header and header != NEW_SESSION:
        raise BadRequestError(
            f"A NEW_SESSION request cannot run in an open session: send it without "
            f"{SESSION_ID_HEADER}, or with {SESSION_ID_HEADER}: NEW_SESSION.",
            param=SESSION_ID_HEADER,
        )
    if header == NEW_SESSION and isinstance(body, dict) and body.get("stream") is True:
        raise BadRequestError(
            "A streamed call cannot open a session (SageMaker opens them through "
            "InvokeEndpoint only): open it first, then stream in it.",
            param=SESSION_ID_HEADER,
        )


class ServingSessions:
    def __init__(self, config: ServerConfig, engine: EngineClient) -> None:
        self._enabled = config.enable_stateful_sessions
        self._ttl_s = config.session_ttl
        self._engine = engine

    async def begin(self, body: Any, session_header: str | None) -> SessionStep:
        """Apply the session part of a call: open, close, or name the session to run in.
        The engine checks a named session when it admits the request (400 if gone)."""
        kind = request_type(body)
        header = session_header.strip() if session_header is not None else None
        if kind is None and not header:
            return SessionStep()
        if not self._enabled:
            raise BadRequestError(
                "Stateful sessions are not enabled on this server "
                "(--enable-stateful-sessions, or SAGEMAKER_ENABLE_STATEFUL_SESSIONS=true).",
                param=SESSION_ID_HEADER if header else "requestType",
            )
        _refuse_contradictions(body, kind, header)
        if kind == NEW_SESSION or header == NEW_SESSION:
            session_id, value = await self._open()
            step = SessionStep(session_id, {NEW_SESSION_ID_HEADER: value})
            if kind is not None:
                step.reply = f"Session {session_id} created"
            return step
        if kind == CLOSE:
            if not header:
                raise BadRequestError(
                    f"A CLOSE request needs the {SESSION_ID_HEADER} header naming the session.",
                    param=SESSION_ID_HEADER,
                )
            await self._call(self._engine.close_session(header))
            return SessionStep(None, {CLOSED_SESSION_ID_HEADER: header}, f"Session {header} closed")
        return SessionStep(header)

    async def discard(self, step: SessionStep) -> None:
        """Close the session `step` opened for a first turn that then failed (its body
        refused, the engine full): the caller never learns its id, so it would only hold
        a slot of the table until it expired."""
        if step.session_id is not None and NEW_SESSION_ID_HEADER in step.headers:
            with contextlib.suppress(Exception):  # gone or expired already: nothing held
                await self._engine.close_session(step.session_id)

    async def _open(self) -> tuple[str, str]:
        reply = await self._call(self._engine.open_session(self._ttl_s))
        assert reply.session_id is not None
        return reply.session_id, expires_header(reply.session_id, reply.expires_at)

    @staticmethod
    async def _call(call: Any) -> Any:
        try:
            return await call
        except Exception as exc:
            mapped = from_engine_error(exc)
            if mapped is None:
                raise
            if isinstance(mapped, BadRequestError):
                mapped.param = SESSION_ID_HEADER
            raise mapped from None
