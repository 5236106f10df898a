"""Per-request timing and counters, reported to a sink (Prometheus in the HTTP app).

The serving classes time requests because only they see tokens arrive; what is done
with the numbers (metrics, nothing) is the transport's choice, so no metrics library
is imported here. Every finished request also gets one log line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger("handlers.requests")

_MAX_LOGGED_ID = 300


def loggable(text: str) -> str:
    """A client-chosen id as it may appear in a log line: control characters (a newline
    forging a second log line, terminal escapes) escaped, length capped."""
    if not (text.isascii() and text.isprintable()):
        text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= _MAX_LOGGED_ID else text[:_MAX_LOGGED_ID] + "..."


@dataclass(slots=True)
class RequestRecord:
    """One finished API request (all of its choices)."""

    request_id: str
    kind: str
    """'chat', 'completion' or 'tgi'."""
    status: str
    """'ok', 'error' (failed after admission) or 'aborted' (client went away)."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    finish_reasons: list[str] = field(default_factory=list)
    adapter: str | None = None
    """The LoRA adapter it ran on (None: the base model)."""


class StatsSink(Protocol):
    def observe_first_token(self, seconds: float) -> None: ...

    def observe_inter_token(self, seconds: float) -> None: ...

    def observe_finished(self, record: RequestRecord) -> None: ...


class NullStatsSink:
    """Discards everything (tests, Lambda)."""

    def observe_first_token(self, seconds: float) -> None:
        pass

    def observe_inter_token(self, seconds: float) -> None:
        pass

    def observe_finished(self, record: RequestRecord) -> None:
        pass


class RequestTracker:
    """Times one API request from arrival to its last output."""

    def __init__(self, sink: StatsSink, request_id: str, kind: str, arrival_time: float) -> None:
        self._sink = sink
        self._arrival = arrival_time
        self._first_token: float | None = None
        self._last_output: dict[int, float] = {}
        self.record = RequestRecord(request_id=request_id, kind=kind, status="ok")
        self._closed = False

    def on_output(self, index: int, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        now = time.monotonic()
        if self._first_token is None:
            self._first_token = now
            self._sink.observe_first_token(now - self._arrival)
        last = self._last_output.get(index)
        if last is not None:
            self._sink.observe_inter_token((now - last) / num_new_tokens)
        self._last_output[index] = now

    def finish(
        self,
        status: str,
        *,
        num_prompt_tokens: int,
        num_output_tokens: int,
        num_cached_tokens: int,
        finish_reasons: list[str],
    ) -> None:
        """Record and log once; later calls are ignored."""
        if self._closed:
            return
        self._closed = True
        record = self.record
        record.status = status
        record.num_prompt_tokens = num_prompt_tokens
        record.num_output_tokens = num_output_tokens
        record.num_cached_tokens = num_cached_tokens
        record.finish_reasons = finish_reasons
        record.e2e = time.monotonic() - self._arrival
        record.ttft = None if self._first_token is None else self._first_token - self._arrival
        try:
            self._sink.observe_finished(record)
        except Exception:  # a metrics failure must never fail a request
            logger.exception("stats sink failed")
        logger.info(
            "request %s %s: status=%s prompt_tokens=%d output_tokens=%d cached_tokens=%d "
            "ttft=%s e2e=%.3fs finish=%s",
            loggable(record.request_id),
            record.kind,
            status,
            num_prompt_tokens,
            num_output_tokens,
            num_cached_tokens,
            "-" if record.ttft is None else f"{record.ttft:.3f}s",
            record.e2e,
            ",".join(finish_reasons) or "-",
        )
