"""Run gunicorn programmatically with one engine core process for all workers.

The master (this process) never imports torch: it spawns the engine core as a fresh
interpreter (`python -m engine.process`) in `on_starting`, waits only until the core
holds its liveness lock (model loading continues while workers start, so /ping can
answer 503 "loading" at once), watches it from a thread, and stops it in `on_exit`
after the workers have drained. If the engine dies, the master shuts down and the
CLI exits non-zero so the platform restarts the container.

The master binds the port before it forks the workers, and from then on the kernel
accepts connections that wait until a worker runs its event loop. So that a probe's
wait stays far below SageMaker's 2 s /ping timeout even on a busy CPU, the master
imports the worker's modules (not torch, no sockets, no ZMQ context, no metric values)
in `on_starting`, before binding: a forked worker then only builds its app.

SIGTERM: the master closes its listening socket and sends SIGTERM to the workers;
each uvicorn worker closes its own, lets running responses (SSE streams included) finish
for up to `--timeout-graceful-shutdown` minus 2 s (container/worker.py), then cancels
what is left; gunicorn SIGKILLs a worker at `graceful_timeout`. Only then does `on_exit`
stop the engine, so draining requests keep being served.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from gunicorn.app.base import BaseApplication

from engine.ipc import engine_is_alive

logger = logging.getLogger("hearth")

ENGINE_START_TIMEOUT_S = 120.0

WORKER_MODULES = (
    "handlers.http.asgi",
    "handlers.http.app",
    "engine.zmq_client",
    "uvicorn.protocols.http.auto",
    "uvicorn.protocols.websockets.auto",
    "uvicorn.lifespan.on",
    "uvicorn.loops.auto",
)
"""What a worker imports before it can answer; imported by the master ahead of the fork."""


def preload_worker_modules() -> None:
    for name in WORKER_MODULES:
        importlib.import_module(name)


class EngineSupervisor:
    """Owns the engine core process on behalf of the gunicorn master."""

    def __init__(self, env: dict[str, str], runtime_dir: str) -> None:
        self.env = env
        self.runtime_dir = runtime_dir
        self.process: subprocess.Popen[bytes] | None = None
        self.died = False
        self._stopping = False

    def start(self) -> None:
        runtime_dir = self.runtime_dir
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine.process", runtime_dir],
            env=self.env,
            # Own session: a terminal's Ctrl-C must not stop the engine before the
            # workers have drained; the master stops it in on_exit.
            start_new_session=True,
        )
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while not engine_is_alive(runtime_dir):
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the engine core exited at start-up (code {self.process.returncode})"
                )
            if time.monotonic() > deadline:
                raise RuntimeError("the engine core did not start")
            time.sleep(0.05)
        threading.Thread(target=self._watch, name="hearth-engine-watch", daemon=True).start()

    def _watch(self) -> None:
        assert self.process is not None
        code = self.process.wait()
        if self._stopping:
            return
        self.died = True
        logger.error("engine core exited unexpectedly (code %s); shutting down", code)
        # Workers see the engine gone within a fraction of a second (/health -> 503,
        # streams end with an error); give them a moment, then stop the master.
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> None:
        self._stopping = True
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class HearthApplication(BaseApplication):
    def __init__(
        self, options: dict[str, Any], supervisor: EngineSupervisor, worker_niceness: int = 0
    ) -> None:
        """`worker_niceness`: how far below the engine (and this master) the API workers
        run. The engine's step serves every request at once; a worker parsing one
        client's bodies should get the CPU the step leaves, not take a core from it."""
        self.options = options
        self.supervisor = supervisor
        self.worker_niceness = worker_niceness
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)
        supervisor = self.supervisor

        def on_starting(server: Any) -> None:
            server.log.info("starting the engine core")
            supervisor.start()
            preload_worker_modules()  # while the engine loads, before the port is bound

        def on_exit(server: Any) -> None:
            server.log.info("stopping the engine core")
            supervisor.stop()

        def child_exit(server: Any, worker: Any) -> None:
            if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(worker.pid)

        worker_niceness = self.worker_niceness

        def post_fork(server: Any, worker: Any) -> None:
            # Each worker, once forked: lowering one's own priority needs no privilege.
            if worker_niceness:
                os.nice(worker_niceness)

        self.cfg.set("on_starting", on_starting)
        self.cfg.set("post_fork", post_fork)
        self.cfg.set("on_exit", on_exit)
        self.cfg.set("child_exit", child_exit)

    def load(self) -> Any:
        # Called in each worker after the fork (no preload): the app, its ZMQ
        # context and its event loop all belong to the worker.
        from handlers.http.asgi import app

        return app
