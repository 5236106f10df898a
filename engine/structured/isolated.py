"""Grammar compiles in a child process that can be killed.

xgrammar has no way to stop a compile once started, and some schemas within every size
cap still take long (a string of `maxLength` 10^8: ~5 s; 64 nested objects of three
properties, 10 KB: ~2.4 s). A thread cannot be stopped either, so each compile slot is
a child process: when its request is aborted or its time is up, the child is killed
(SIGKILL) and the next compile starts a fresh one. A compile still running after 2 s
is demoted to nice 10, so a long compile takes CPU from the engine and the API
workers only when they leave it idle, while ordinary ones (milliseconds) are not slowed
on a busy host. It sends the compiled grammar back serialized (xgrammar's JSON);
the engine deserializes it against its own tokenizer info.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.sampling_params import StructuredOutputSpec
from engine.structured.grammar import GrammarError

CHILD_NICENESS = 10
NICE_AFTER_S = 2.0
"""A compile still running after this is demoted to CHILD_NICENESS."""
POLL_S = 0.05
"""How often a waiting compile looks at its cancel flag and deadline."""


class CompileCancelled(Exception):
    """The request went away (aborted, timed out) while its grammar compiled."""


class CompileTimeout(GrammarError):
    """The compile ran past its deadline; the child was killed."""


def _child_main(
    conn: Connection, model_dir: str, vocab_size: int, eos: list[int], restarted: bool
) -> None:
    # A first start loads at normal priority (as the in-engine compiler did); a restart
    # after a kill loads (and compiles) niced, so aborting compiles over and over costs
    # only idle CPU.
    if restarted:
        _nice()
    from engine.structured.grammar import GrammarCompiler

    compiler = GrammarCompiler(model_dir, vocab_size, eos)
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the engine is gone
            return
        kind, value, any_whitespace, separators = request
        spec = StructuredOutputSpec(
            kind=kind, value=value, any_whitespace=any_whitespace, separators=separators
        )
        answer = _compile_demoting(compiler, spec)
        try:
            conn.send(answer)
        except (EOFError, OSError):
            return


def _compile_demoting(compiler: Any, spec: StructuredOutputSpec) -> tuple[str, str]:
    """Compile on a thread at normal priority; one still running after NICE_AFTER_S
    (an ordinary schema takes milliseconds) is demoted to nice CHILD_NICENESS, so only
    idle CPU goes to it (Linux gives each thread its own nice value)."""
    answer: list[tuple[str, str]] = []
    tid: list[int] = []

    def run() -> None:
        tid.append(threading.get_native_id())
        try:
            answer.append(("ok", compiler.compile(spec).serialize_json()))
        except GrammarError as exc:
            answer.append(("invalid", str(exc)))
        except Exception as exc:  # a library bug: reported, the child serves on
            answer.append(("failed", f"{type(exc).__name__}: {exc}"))

    worker = threading.Thread(target=run, name="compile", daemon=True)
    worker.start()
    worker.join(NICE_AFTER_S)
    if worker.is_alive() and tid:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid[0], CHILD_NICENESS)
    worker.join()
    return answer[0]


def _nice() -> None:
    with contextlib.suppress(OSError):
        os.nice(CHILD_NICENESS)


class CompileProcess:
    """One compile slot: a child process, started on first use and after each kill.
    Used by one thread at a time (the manager hands slots out)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._args = (str(model_dir), vocab_size, list(eos_token_ids))
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self.num_started = 0
        self.num_killed = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the child unless it runs. A plain `python -m` of this module, not a
        multiprocessing spawn, which would re-import the engine's main module (torch
        and all) in every child."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self.close()
        parent, child = socket.socketpair()
        model_dir, vocab_size, eos = self._args
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        argv = [sys.executable, "-m", "engine.structured.isolated", str(child.fileno())]
        argv += [model_dir, str(vocab_size), json.dumps(eos), "1" if self.num_killed else "0"]
        try:
            proc = subprocess.Popen(argv, pass_fds=[child.fileno()], env=env, close_fds=True)
        finally:
            child.close()
        self._proc, self._conn = proc, Connection(parent.detach())
        self.num_started += 1

    def compile(
        self,
        spec: StructuredOutputSpec,
        deadline: float,
        cancelled: threading.Event,
        meanwhile: Callable[[], Any] | None = None,
    ) -> str:
        """The serialized compiled grammar. Raises GrammarError (refused, or past
        `deadline`: CompileTimeout) or CompileCancelled; kills the child in both last cases."""
        self.start()
        assert self._conn is not None and self._proc is not None
        self._conn.send((spec.kind, spec.value, spec.any_whitespace, spec.separators))
        if meanwhile is not None:  # work of the caller's that can overlap the compile
            meanwhile()
        while True:
            if cancelled.is_set():
                self.kill()
                raise CompileCancelled()
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise CompileTimeout("compiling the constraint ran out of time")
            try:
                if self._conn.poll(min(left, POLL_S)):
                    status, payload = self._conn.recv()
                    break
            except (EOFError, OSError):
                self.kill()
                raise GrammarError(
                    "the grammar compiler stopped (the constraint crashed it)"
                ) from None
            if self._proc.poll() is not None:
                self.kill()
                raise GrammarError("the grammar compiler stopped (the constraint crashed it)")
        if status == "ok":
            return payload
        if status == "invalid":
            raise GrammarError(payload)
        raise RuntimeError(payload)

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self.num_killed += 1
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)  # it exits when its socket closes
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def shutdown(self) -> None:
        """Stop the child (it exits when its socket closes; killed if it is compiling)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
            self._proc = None


def deserialize(serialized: str, tokenizer_info: Any) -> Any:
    import xgrammar as xgr

    return xgr.CompiledGrammar.deserialize_json(serialized, tokenizer_info)


if __name__ == "__main__":
    _fd, _model_dir, _vocab, _eos, _restarted = sys.argv[1:6]
    _child_main(Connection(int(_fd)), _model_dir, int(_vocab), json.loads(_eos), _restarted == "1")
