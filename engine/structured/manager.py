"""Compiled-grammar cache and the compile queue, kept off the engine loop.

A request with a constraint is held here, not in the scheduler, until its grammar is
compiled: compiling runs in one of two child processes that can be killed
(`isolated.py`), each driven by a pool thread, so the engine keeps stepping every other
request meanwhile. The loop polls `ready()` between steps; a compile that fails or runs
past the time limit turns into a refused admission (400), answered before any status
line like every other admission.

Every compile is bounded (issue 17): its time limit counts from submission, so a queued
compile times out too; a request that goes (abort, timeout) cancels its compile: a
queued one never runs, a running one's child is killed; at most `max_pending` compiles
wait, beyond that `submit` raises CompileQueueFull (a 503). Only where no child process
can be started at all does a compile run on the pool thread (logged): still bounded in
wait and answer, but a running one then cannot be stopped.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.sampling_params import StructuredOutputSpec
from engine.structured.grammar import GrammarCompiler, GrammarError
from engine.structured.isolated import (
    CompileCancelled,
    CompileProcess,
    CompileTimeout,
    deserialize,
)

logger = logging.getLogger("hearth.engine")

DEFAULT_COMPILE_TIMEOUT_S = 28.0
"""Counted from submission: time queued behind other compiles counts. Below the worker's
admission timeout (`engine.client.ADMISSION_TIMEOUT_S`, 30 s), so a compile that runs
out of time is the 400 naming its field, not a 503 "not admitted"."""
DEFAULT_CACHE_SIZE = 512
DEFAULT_MAX_PENDING = 64
"""Compiles waiting or running at once (cache hits do not count); one more is a 503."""
NUM_COMPILE_SLOTS = 2
"""Child processes (and threads driving them): one pathological grammar stuck until its
deadline must not hold up every later compile."""


class CompileQueueFull(Exception):
    """Too many compiles pending: the request is refused as overloaded (503)."""


@dataclass(slots=True)
class PendingCompile:
    payload: Any
    """Whatever the caller needs to admit the request once compiled (message, client)."""
    future: Future[Any]
    submitted: float
    cancelled: threading.Event
    """Set when the request goes: the compile is dropped before it starts, or its child
    is killed."""


@dataclass(slots=True)
class CompileResult:
    payload: Any
    compiled: Any | None
    """xgrammar's CompiledGrammar, or None when compiling failed."""
    error: str | None = None


def tokenizer_hash(model_dir: str | Path) -> str:
    """Identity of the vocabulary a grammar was compiled against (part of the cache key)."""
    data = (Path(model_dir) / "tokenizer.json").read_bytes()
    return hashlib.sha256(data).hexdigest()[:16]


class StructuredOutputManager:
    def __init__(
        self,
        model_dir: str | Path,
        vocab_size: int,
        eos_token_ids: list[int],
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        cache_size: int = DEFAULT_CACHE_SIZE,
        max_pending: int = DEFAULT_MAX_PENDING,
        isolate: bool = True,
    ) -> None:
        self._model_dir = model_dir
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._tokenizer_hash = tokenizer_hash(model_dir)
        self.compile_timeout_s = compile_timeout_s
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._cache_lock = threading.Lock()
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(
            max_workers=NUM_COMPILE_SLOTS, thread_name_prefix="hearth-grammar"
        )
        self.isolate = isolate
        """Compile in killable child processes (the default; off: on the pool threads,
        which cannot be stopped, for benchmarks that want the library alone). Once off
        by default: a cold burst of 21 distinct schemas missed the limit through the
        children on a loaded 2-vCPU host. The children were demoted to nice 10 after
        2 s of wall time, which on an oversubscribed host caught ordinary compiles
        waiting for a core and starved them behind the decoding engine; they are now
        demoted after 2 s of CPU (docs/reliability.md has the figures)."""
        self._slots: queue.SimpleQueue[CompileProcess] = queue.SimpleQueue()
        self.processes = [
            CompileProcess(model_dir, vocab_size, eos_token_ids) for _ in range(NUM_COMPILE_SLOTS)
        ]
        for proc in self.processes:
            self._slots.put(proc)
        self._pending: dict[str, PendingCompile] = {}
        self._num_misses_pending = 0
        self.num_cache_hits = 0
        self.num_compiles = 0
        self.num_cancelled = 0

    # -- compiling -------------------------------------------------------------------
    def _key(self, spec: StructuredOutputSpec) -> str:
        h = hashlib.sha256()
        layout = f"{spec.any_whitespace}{spec.separators}"
        for part in (self._tokenizer_hash, spec.kind, layout, spec.value):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def _get_compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(
                    self._model_dir, self._vocab_size, self._eos_token_ids
                )
            return self._compiler

    def _cached(self, key: str) -> Any | None:
        with self._cache_lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def compile(
        self,
        spec: StructuredOutputSpec,
        deadline: float | None = None,
        cancelled: threading.Event | None = None,
    ) -> Any:
        """Compile (or fetch from the cache); raises GrammarError. Without a deadline it
        compiles on the calling thread (tests, benchmarks); with one (the queue) in a
        child process that is killed at the deadline or when `cancelled` is set
        (CompileCancelled)."""
        key = self._key(spec)
        compiled = self._cached(key)
        if compiled is not None:
            self.num_cache_hits += 1
            return compiled
        if deadline is None or not self.isolate:
            compiled = self._get_compiler().compile(spec)
        else:
            compiled = self._compile_isolated(spec, deadline, cancelled or threading.Event())
        self.num_compiles += 1
        with self._cache_lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile_isolated(
        self, spec: StructuredOutputSpec, deadline: float, cancelled: threading.Event
    ) -> Any:
        slot = self._slots.get()  # never waits: one slot per pool thread
        try:
            slot.start()  # first, so the child loads while the engine's compiler does
        except Exception:  # a platform without child processes: compile on the thread
            self._slots.put(slot)
            logger.exception("cannot start a grammar compile process; compiling in-process")
            self.isolate = False
            return self._get_compiler().compile(spec)
        try:
            # The engine's own compiler (for the tokenizer info grammars deserialize
            # against; built once) loads while the child compiles.
            serialized = slot.compile(spec, deadline, cancelled, meanwhile=self._get_compiler)
        finally:
            self._slots.put(slot)
        return deserialize(serialized, self._get_compiler().tokenizer_info)

    def start(self) -> None:
        """Start the compile children now (a no-op for those running). The engine's
        runners call it as soon as the model is loaded, before warm-up, not at the
        idle-time prewarm: a child costs the engine no GIL, and loading one (xgrammar,
        torch, the vocabulary: ~2.4 s of CPU, 3-7 s on two busy cores; ~300 MB RSS) by
        the first constrained request kept that request waiting. Not in the
        constructor: an EngineCore that never serves (tests, tools) would pay two
        children each (a set of three engine test files took 109 s instead of 55 s)."""
        if not self.isolate:
            return
        try:
            for proc in self.processes:
                proc.start()
        except Exception:
            logger.exception("cannot start a grammar compile process; compiling in-process")
            self.isolate = False

    def prewarm(self) -> None:
        """Load the grammar library and the vocabulary into it in the background, and
        start a compile child, so the first constrained request does not wait for
        them (the engine loop calls this once, when idle; a repeat finds them built)."""
        self.start()  # a no-op unless one was killed since
        self._pool.submit(self._get_compiler)

    def submit(self, request_id: str, spec: StructuredOutputSpec, payload: Any) -> None:
        """Start compiling for a request; `ready()` hands it back once done. Raises
        CompileQueueFull when `max_pending` compiles are already waiting or running."""
        compiled = self._cached(self._key(spec))
        future: Future[Any]
        now = time.monotonic()
        cancelled = threading.Event()
        if compiled is not None:
            self.num_cache_hits += 1
            future = Future()
            future.set_result(compiled)
        else:
            if self._num_misses_pending >= self.max_pending:
                raise CompileQueueFull(
                    f"The server is at capacity ({self._num_misses_pending} constraints "
                    "compiling); retry later."
                )
            deadline = now + self.compile_timeout_s

            def run() -> Any:
                if cancelled.is_set():
                    raise CompileCancelled()
                started = time.monotonic()
                compiled = self.compile(spec, deadline, cancelled)
                logger.debug(
                    "grammar compiled in %.2f s (%.2f s queued)",
                    time.monotonic() - started,
                    started - now,
                )
                return compiled

            with self._cache_lock:
                self._num_misses_pending += 1
            future = self._pool.submit(run)
            future.add_done_callback(self._miss_done)
        self._pending[request_id] = PendingCompile(payload, future, now, cancelled)

    def _miss_done(self, _future: Future[Any]) -> None:
        # On the pool thread or (cancelled before it ran) on the caller's.
        with self._cache_lock:
            self._num_misses_pending -= 1

    def discard(self, request_id: str) -> bool:
        """Forget a request still compiling (aborted): a queued compile never runs, a
        running one is stopped (its child killed); its result is dropped."""
        item = self._pending.pop(request_id, None)
        if item is None:
            return False
        self._cancel(item)
        return True

    def _cancel(self, item: PendingCompile) -> None:
        if not item.future.done():
            item.cancelled.set()
            item.future.cancel()
            self.num_cancelled += 1

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def pending_payloads(self) -> dict[str, Any]:
        """Each request still compiling, with the payload it was submitted with."""
        return {rid: item.payload for rid, item in self._pending.items()}

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def ready(self) -> list[CompileResult]:
        """Requests whose compile finished, failed or ran out of time, in submit order."""
        if not self._pending:
            return []
        now = time.monotonic()
        done: list[CompileResult] = []
        for rid, item in list(self._pending.items()):
            if item.future.done():
                del self._pending[rid]
                try:
                    done.append(CompileResult(item.payload, item.future.result()))
                except GrammarError as exc:
                    message = (
                        self._timeout_message() if isinstance(exc, CompileTimeout) else str(exc)
                    )
                    done.append(CompileResult(item.payload, None, message))
                except CompileCancelled:  # raced with its own timeout
                    done.append(CompileResult(item.payload, None, self._timeout_message()))
                except Exception as exc:  # a library bug must not kill the engine
                    logger.exception("grammar compile failed for %s", rid)
                    done.append(CompileResult(item.payload, None, f"compile failed: {exc}"))
            elif now - item.submitted >= self.compile_timeout_s:
                del self._pending[rid]
                self._cancel(item)
                done.append(CompileResult(item.payload, None, self._timeout_message()))
        return done

    def _timeout_message(self) -> str:
        return f"compiling the constraint took longer than {self.compile_timeout_s:g} s"

    def shutdown(self) -> None:
        for item in self._pending.values():
            item.cancelled.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for proc in self.processes:
            proc.shutdown()
