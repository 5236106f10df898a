"""Grammar compiles in a child process that can be killed.

xgrammar has no way to stop a compile once started, and some schemas within every size
cap still take long (a string of `maxLength` 10^8: ~5 s; 64 nested objects of three
properties, 10 KB: ~2.4 s). A thread cannot be stopped either, so each compile slot is
a child process: when its request is aborted or its time is up, the child is killed
(SIGKILL) and the next compile starts a fresh one. A compile starts at nice 5 (below
the engine, a little above the API workers) and is demoted to nice 19 once it has used
0.25 s of CPU, so a long compile takes CPU from the engine and the API workers only when
they leave it idle, while ordinary ones (milliseconds of CPU) keep their priority however
long a loaded host makes them wait for a core (a wall-clock trigger niced them too).

It sends the compiled grammar back as xgrammar's JSON, the one serialized form it has
(its CompiledGrammar does not pickle), as raw bytes (no pickling of a multi-MB
string); the engine deserializes it on the pool thread that waited for it, which
releases the GIL meanwhile.
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
"""A restarted child loads its compiler (~3 s of CPU) at this nice value: aborting
compiles over and over costs little beside the engine, yet the slot is back in seconds
on a loaded host, where nice 19 could take minutes."""
SLOW_COMPILE_NICENESS = 19
"""What a compile past NICE_AFTER_CPU_S runs at. At nice 10, two such compiles (a
string of `maxLength` 10^9: ~2.3 s of CPU each, one per compile slot) made a
sequential client's chat p50 9.4x its quiet figure on a 2-vCPU host: the engine's two
OpenMP threads wait for each other at every barrier, so a co-runner that holds either
core for a time slice stalls both. At 19: 1.12x (`tests/reliability/hostile_mix.py`
with HOSTILE_ONLY=schemas)."""
COMPILE_NICENESS = 5
"""Every compile starts at this nice value, below the engine, whose step serves every
request, and a little above the API workers (`hearth serve --worker-niceness`, 7): an
ordinary compile is milliseconds that an admitted request waits on. At nice 0, a slow
schema's first 2 s of CPU beside a decoding engine took that CPU from the step."""
NICE_AFTER_CPU_S = 0.25
"""A compile that has used this much CPU is demoted to SLOW_COMPILE_NICENESS (ordinary
schemas take milliseconds)."""
POLL_S = 0.05
"""How often a waiting compile looks at its cancel flag and deadline."""


OK, INVALID, FAILED = b"o", b"i", b"f"
"""The first byte of a child's answer: compiled (the rest is the grammar's JSON), refused
(the rest is the message: a 400) or failed (a library error)."""


class CompileCancelled(Exception):
    """The request went away (aborted, timed out) while its grammar compiled."""


class CompileTimeout(GrammarError):
    """The compile ran past its deadline; the child was killed."""


def _child_main(
    conn: Connection, model_dir: str, vocab_size: int, eos: list[int], restarted: bool
) -> None:
    compiler = _load(model_dir, vocab_size, eos, niced=restarted)
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the engine is gone
            return
        kind, value, any_whitespace, separators = request
        spec = StructuredOutputSpec(
            kind=kind, value=value, any_whitespace=any_whitespace, separators=separators
        )
        status, payload = _compile_demoting(compiler, spec)
        try:
            conn.send_bytes(status + payload.encode())
        except (EOFError, OSError):
            return


def _compile_demoting(compiler: Any, spec: StructuredOutputSpec) -> tuple[bytes, str]:
    """Compile on a thread at normal priority; one that has used NICE_AFTER_CPU_S of CPU
    (an ordinary schema takes milliseconds) is demoted to nice SLOW_COMPILE_NICENESS, so
    only idle CPU goes to it (Linux gives each thread its own nice value). CPU time, not wall
    time: on a busy host an ordinary compile can wait seconds for a core, and demoting
    it then would starve it behind the engine."""
    answer: list[tuple[bytes, str]] = []

    def run() -> None:
        _demote(threading.get_native_id(), COMPILE_NICENESS)
        try:
            answer.append((OK, compiler.compile(spec).serialize_json()))
        except GrammarError as exc:
            answer.append((INVALID, str(exc)))
        except Exception as exc:  # a library bug: reported, the child serves on
            answer.append((FAILED, f"{type(exc).__name__}: {exc}"))

    worker = threading.Thread(target=run, name="compile", daemon=True)
    worker.start()
    clock = _cpu_clock(worker)
    while worker.is_alive():
        worker.join(POLL_S)
        if clock is not None and worker.is_alive():
            try:
                used = time.clock_gettime(clock)
            except OSError:  # it just ended
                break
            if used >= NICE_AFTER_CPU_S:
                _demote(worker.native_id, SLOW_COMPILE_NICENESS)
                clock = None
    worker.join()
    return answer[0]


def _cpu_clock(worker: threading.Thread) -> int | None:
    """The CPU-time clock of a running thread (None where the platform has none: the
    compile is then never demoted)."""
    try:
        assert worker.ident is not None
        return time.pthread_getcpuclockid(worker.ident)
    except (AttributeError, OSError):
        return None


def _demote(tid: int | None, niceness: int) -> None:
    """Nice one thread to `niceness`, never less nice than it is (a server started
    under `nice -n 19` by root would otherwise have its compile raised to 10)."""
    if tid is None:
        return
    with contextlib.suppress(OSError):
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(current, niceness))


def _load(model_dir: str, vocab_size: int, eos: list[int], niced: bool) -> Any:
    """The child's compiler: xgrammar (with the torch and transformers it imports) and
    the vocabulary read into it, ~3 s of CPU. A first start loads at normal priority (as
    the in-engine compiler did); a restart after a kill loads on a thread niced to
    CHILD_NICENESS, so aborting compiles over and over costs only idle CPU, while the
    compiles that child runs later start at normal priority again (threads inherit
    the nice value of the thread that creates them, and an unprivileged process could
    not lower its own again)."""
    from engine.structured.grammar import GrammarCompiler

    if not niced:
        return GrammarCompiler(model_dir, vocab_size, eos)
    built: list[Any] = []

    def load() -> None:
        _demote(threading.get_native_id(), CHILD_NICENESS)
        built.append(GrammarCompiler(model_dir, vocab_size, eos))

    loader = threading.Thread(target=load, name="load", daemon=True)
    loader.start()
    loader.join()
    if not built:
        raise RuntimeError("the grammar compiler did not load")
    return built[0]


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
                    answer = self._conn.recv_bytes()
                    break
            except (EOFError, OSError):
                self.kill()
                raise GrammarError(
                    "the grammar compiler stopped (the constraint crashed it)"
                ) from None
            if self._proc.poll() is not None:
                self.kill()
                raise GrammarError("the grammar compiler stopped (the constraint crashed it)")
        status, payload = answer[:1], str(memoryview(answer)[1:], "utf-8")
        if status == OK:
            return payload
        if status == INVALID:
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
