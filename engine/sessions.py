"""Stateful sessions (SageMaker's sticky sessions): the engine's table of open ones.

The table lives in the engine core, beside the KV blocks a session keeps warm, rather
than in the API workers or a file: every worker reaches the engine over the IPC it
already has, so a session opened through one worker is known to all of them at once;
the pins and the table change together in one process (no lock, no cross-process
file); and when the engine goes, both go (a restarted container starts without stale
sessions, as SageMaker expects). Plain Python, no torch.

Ids come from `secrets` (unguessable: a session id is the only thing that lets a
caller reach a conversation's cached prefix); expiry is wall-clock, because it is
reported to callers as a date (`Expires=`) and must mean the same in every process.
"""

from __future__ import annotations

import heapq
import secrets
import time
from collections.abc import Callable

from engine.block_manager import BlockManager

MAX_SESSIONS = 4096
"""Open sessions at most; another NEW_SESSION is refused (503) until one closes or
expires. Pins never take blocks from new requests, so this only bounds the table."""


class SessionTableFull(RuntimeError):
    """No room for another open session."""


class SessionTable:
    def __init__(
        self,
        block_manager: BlockManager,
        max_sessions: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._blocks = block_manager
        self.max_sessions = max_sessions
        self._clock = clock
        self._expires_at: dict[str, float] = {}
        self._due: list[tuple[float, str]] = []
        """(expires_at, id) heap; entries of closed sessions are skipped lazily."""

    def __len__(self) -> int:
        return len(self._expires_at)

    def open(self, ttl_s: float) -> tuple[str, float]:
        """A new session's (id, expiry as Unix time)."""
        self.expire()
        if len(self._expires_at) >= self.max_sessions:
            raise SessionTableFull(
                f"{len(self._expires_at)} stateful sessions are open, the most this server "
                "keeps; close one or retry later."
            )
        session_id = secrets.token_urlsafe(24)
        while session_id in self._expires_at:  # 192 random bits: never, but cheap
            session_id = secrets.token_urlsafe(24)
        expires_at = self._clock() + ttl_s
        self._expires_at[session_id] = expires_at
        heapq.heappush(self._due, (expires_at, session_id))
        self._blocks.open_session(session_id)
        return session_id, expires_at

    def is_live(self, session_id: str) -> bool:
        """Open and not expired (an expired one is closed here and now)."""
        expires_at = self._expires_at.get(session_id)
        if expires_at is None:
            return False
        if expires_at <= self._clock():
            self.close(session_id)
            return False
        return True

    def close(self, session_id: str) -> bool:
        """Close an open session (its blocks become ordinary cache); False if it was not
        open (unknown, closed or expired)."""
        if self._expires_at.pop(session_id, None) is None:
            return False
        self._blocks.close_session(session_id)
        return True

    def expire(self) -> int:
        """Close every session whose time is up; cheap when none is (a heap peek), so the
        engine loop calls it every iteration."""
        now = self._clock()
        closed = 0
        while self._due and self._due[0][0] <= now:
            expires_at, session_id = heapq.heappop(self._due)
            if self._expires_at.get(session_id) == expires_at:
                self.close(session_id)
                closed += 1
        return closed
