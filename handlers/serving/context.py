"""Per-request facts that come from the transport, not from the body."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestContext:
    """What the HTTP (or Lambda) layer knows about a request before the serving class runs."""

    request_id: str | None = None
    """The client's id (`X-Request-Id`); it becomes the response id, as in vLLM."""
    adapter: str | None = None
    """SageMaker's `X-Amzn-SageMaker-Adapter-Identifier` on /invocations: the LoRA adapter
    to run, whatever the body's `model` says."""
    arrival_time: float = field(default_factory=time.monotonic)
    """Monotonic clock at arrival: the start of TTFT and end-to-end latency."""
    session_id: str | None = None
    """The stateful session the request runs in (SageMaker's `X-Amzn-SageMaker-Session-Id`,
    see `handlers/serving/sessions.py`); the engine keeps its prefix blocks warm."""
