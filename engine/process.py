"""Entry point of the engine core process (`python -m engine.process`).

Started by the gunicorn master with a fresh interpreter (never forked after torch or
CUDA were initialised). Reads its EngineConfig from the environment, holds the
liveness lock, loads and warms the model, announces readiness, then serves the busy
loop until SIGTERM/SIGINT.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import msgspec

from engine.config import EngineConfig
from engine.ipc import (
    ENV_ENGINE_CONFIG,
    ENV_RUNTIME_DIR,
    ZmqEngineTransport,
    hold_engine_lock,
    write_ready,
)

logger = logging.getLogger("hearth.engine")


def config_to_env(config: EngineConfig) -> str:
    return msgspec.json.encode(config).decode()


def config_from_env() -> EngineConfig:
    raw = os.environ.get(ENV_ENGINE_CONFIG)
    return msgspec.json.decode(raw, type=EngineConfig) if raw else EngineConfig()


def main() -> int:
    config = config_from_env()
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s [engine] %(message)s",
        stream=sys.stderr,
    )
    runtime_dir = os.environ[ENV_RUNTIME_DIR]
    lock_fd = hold_engine_lock(runtime_dir)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("engine core: signal %d, stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    from engine.core import EngineCore  # torch import happens here, after the lock
    from engine.core_loop import run_engine_loop

    start = time.monotonic()
    core = EngineCore(config, progress=lambda msg: logger.info("%s", msg))
    transport = ZmqEngineTransport(runtime_dir)
    warm = core.warm_up()
    write_ready(runtime_dir, core.model_info)
    logger.info(
        "engine core ready in %.1f s (warm-up %.2f s), pid %d",
        time.monotonic() - start,
        warm,
        os.getpid(),
    )
    try:
        run_engine_loop(core, transport, stop, log_stats=not config.disable_log_stats)
    finally:
        transport.close()
        os.close(lock_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
