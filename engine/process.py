"""Entry point of the engine core process (`python -m engine.process`).

Started by the gunicorn master with a fresh interpreter (never forked after torch or
CUDA were initialised) as `python -m engine.process RUNTIME_DIR`. Reads its
EngineConfig from `HEARTH_ENGINE_CONFIG`, the one-variable JSON transport the CLI
writes (docs/architecture.md, "Configuration"; not a setting of its own), holds the
liveness lock, loads and warms the model, announces readiness, then serves the busy
loop until SIGTERM/SIGINT.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time

from engine.config import EngineConfig
from engine.ipc import (
    Heartbeat,
    ZmqEngineTransport,
    hold_engine_lock,
    write_ready,
)

logger = logging.getLogger("hearth.engine")

PARENT_CHECK_S = 0.5
ORPHAN_EXIT_GRACE_S = 10.0


def watch_parent(stop: threading.Event) -> None:
    """Stop when the gunicorn master is gone (SIGKILLed: its on_exit never runs, and we
    live in our own session, so nothing else would end us)."""
    parent = os.getppid()

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        logger.error("engine core: the server process (pid %d) is gone; exiting", parent)
        stop.set()
        time.sleep(ORPHAN_EXIT_GRACE_S)  # still loading, or stuck in a step
        os._exit(1)

    threading.Thread(target=run, name="hearth-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m engine.process RUNTIME_DIR", file=sys.stderr)
        return 2
    runtime_dir = args[0]
    config = EngineConfig.from_env()
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s [engine] %(message)s",
        stream=sys.stderr,
    )
    lock_fd = hold_engine_lock(runtime_dir)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("engine core: signal %d, stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    watch_parent(stop)

    from engine.core import EngineCore, freeze_startup_objects  # torch import: after the lock
    from engine.core_loop import run_engine_loop

    start = time.monotonic()
    core = EngineCore(config, progress=lambda msg: logger.info("%s", msg))
    # Undone in reverse order on every way out, warm-up failures included. The
    # grammar-compile children are shut down and waited for: left to notice the closed
    # socket, they outlived the engine by up to a few seconds, reparented to init, where
    # a supervisor stopping the process group after the master exited found them.
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(os.close, lock_fd)
        core.structured.start()  # the grammar compile children load during warm-up
        cleanup.callback(core.structured.shutdown)
        transport = ZmqEngineTransport(runtime_dir)
        cleanup.callback(transport.close)
        warm = core.warm_up()
        freeze_startup_objects()
        heartbeat = Heartbeat(runtime_dir)
        cleanup.callback(heartbeat.close)
        write_ready(runtime_dir, core.model_info)
        logger.info(
            "engine core ready in %.1f s (warm-up %.2f s), pid %d",
            time.monotonic() - start,
            warm,
            os.getpid(),
        )
        run_engine_loop(
            core,
            transport,
            stop,
            log_stats=not config.disable_log_stats,
            heartbeat=heartbeat,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
