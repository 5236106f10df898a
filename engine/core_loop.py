"""The engine core's busy loop, independent of how messages arrive.

Between steps it drains every pending message (adds, aborts), then runs one step and
sends each worker its outputs as one frame. When there is no work it blocks on the
transport instead of spinning, so an idle engine costs no CPU.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Protocol

from engine.core import EngineCore
from engine.messages import (
    AbortRequest,
    AdapterCommand,
    AddRequest,
    Admission,
    ControlCommand,
    EngineMessage,
    Hello,
    OutputBatch,
    RequestOutput,
    SessionCommand,
    WorkerMessage,
)
from engine.metrics import EngineMetrics, StatsLogger
from engine.structured.manager import CompileQueueFull

if TYPE_CHECKING:
    from engine.ipc import Heartbeat

IDLE_POLL_MS = 100
COMPILE_POLL_MS = 5
"""Poll interval while only grammar compiles are pending (no step to run)."""
PREWARM_AFTER_IDLE_S = 2.0
"""How long the engine must have had nothing to do before it loads the grammar library
(xgrammar and the transformers it imports: ~2 s holding the GIL). Done at ready, it
slowed the first requests by over a second; a constrained request that comes first loads
it on its own compile anyway."""


class EngineTransport(Protocol):
    def poll(self, timeout_ms: int) -> list[tuple[bytes, EngineMessage]]:
        """Messages that arrived, waiting up to timeout_ms for the first one."""

    def send(self, client_id: bytes, message: WorkerMessage) -> None:
        """Deliver in order; never drops a frame for a worker that is alive."""

    def take_gone_clients(self) -> set[bytes]:
        """Workers found dead since the last call (their requests must be aborted)."""


def handle_message(
    core: EngineCore, transport: EngineTransport, client_id: bytes, message: EngineMessage
) -> None:
    if isinstance(message, AddRequest):
        try:
            admission = core.add_request(message, client_id)
        except CompileQueueFull as exc:  # too many constraints compiling: a 503
            admission = Admission(
                request_id=message.request_id,
                accepted=False,
                error_kind="overloaded",
                message=str(exc),
            )
        if admission is not None:  # None: answered by poll_compiled once compiled
            transport.send(client_id, admission)
    elif isinstance(message, AbortRequest):
        core.abort(message.request_ids)
    elif isinstance(message, AdapterCommand):
        transport.send(client_id, core.adapter_command(message))
    elif isinstance(message, SessionCommand):
        transport.send(client_id, core.session_command(message))
    elif isinstance(message, ControlCommand):
        transport.send(client_id, core.control_command(message))
    elif isinstance(message, Hello):
        pass


def run_engine_loop(
    core: EngineCore,
    transport: EngineTransport,
    stop: threading.Event,
    log_stats: bool = True,
    heartbeat: Heartbeat | None = None,
) -> None:
    """Serve until `stop` is set. `heartbeat` hears of every iteration (idle ones too, at
    least every IDLE_POLL_MS) and of every step, so a stuck loop shows as a stale one."""
    metrics = EngineMetrics.get()
    stats = StatsLogger()
    metrics.update(core)
    idle_since: float | None = time.monotonic()
    prewarmed = False
    while not stop.is_set():
        if heartbeat is not None:
            heartbeat.loop()
        if core.has_work():
            timeout = 0
            idle_since = None
        else:
            timeout = COMPILE_POLL_MS if core.num_compiling else IDLE_POLL_MS
            now = time.monotonic()
            if idle_since is None:
                idle_since = now
            elif not prewarmed and now - idle_since >= PREWARM_AFTER_IDLE_S:
                core.structured.prewarm()
                prewarmed = True
        messages = transport.poll(timeout)
        core.sessions.expire()
        for client_id, message in messages:
            handle_message(core, transport, client_id, message)
        changed = bool(messages)
        for client_id, admission in core.poll_compiled():
            transport.send(client_id, admission)
        for client_id in transport.take_gone_clients():
            # A dead worker's requests would run to max_tokens for nobody.
            changed = core.abort_client(client_id) > 0 or changed
        if not core.has_work():
            if changed:
                metrics.update(core)  # an abort may just have freed blocks
            continue
        per_client: dict[bytes, list[RequestOutput]] = defaultdict(list)
        with heartbeat.step() if heartbeat is not None else contextlib.nullcontext():
            step_outputs = core.step()
        for client_id, output in step_outputs:
            per_client[client_id].append(output)
        for client_id, outputs in per_client.items():
            transport.send(client_id, OutputBatch(outputs))
        metrics.update(core)
        if log_stats:
            stats.maybe_log(core)
