"""Compiled-grammar cache and the compile queue, kept off the engine loop.

A request with a constraint is held here, not in the scheduler, until its grammar is
compiled: compiling runs on a worker thread, so the engine keeps stepping every other
request meanwhile. The loop polls `ready()` between steps; a compile that fails or runs
past the time limit turns into a refused admission (400), answered before any status
line like every other admission.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.sampling_params import StructuredOutputSpec
from engine.structured.grammar import GrammarCompiler, GrammarError

logger = logging.getLogger("hearth.engine")

DEFAULT_COMPILE_TIMEOUT_S = 30.0
"""Counted from when compiling starts (time queued behind other compiles is free)."""
DEFAULT_CACHE_SIZE = 512


@dataclass(slots=True)
class PendingCompile:
    payload: Any
    """Whatever the caller needs to admit the request once compiled (message, client)."""
    future: Future[Any]
    started: list[float]
    """Set by the compile thread when it starts (a list: written from that thread)."""


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
        # Two threads: one pathological grammar stuck past its deadline must not hold
        # up every later compile.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hearth-grammar")
        self._pending: dict[str, PendingCompile] = {}
        self.num_cache_hits = 0
        self.num_compiles = 0

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

    def compile(self, spec: StructuredOutputSpec) -> Any:
        """Compile (or fetch from the cache) on the calling thread; raises GrammarError."""
        key = self._key(spec)
        compiled = self._cached(key)
        if compiled is not None:
            self.num_cache_hits += 1
            return compiled
        compiled = self._get_compiler().compile(spec)
        self.num_compiles += 1
        with self._cache_lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def prewarm(self) -> None:
        """Load the grammar library and the vocabulary into it in the background, so the
        first constrained request does not wait for it (the engine loop calls this once,
        when idle; a repeat would find the compiler built)."""
        self._pool.submit(self._get_compiler)

    def submit(self, request_id: str, spec: StructuredOutputSpec, payload: Any) -> None:
        """Start compiling for a request; `ready()` hands it back once done."""
        compiled = self._cached(self._key(spec))
        future: Future[Any]
        if compiled is not None:
            self.num_cache_hits += 1
            future = Future()
            future.set_result(compiled)
        started: list[float] = []
        if compiled is not None:
            started.append(time.monotonic())
        else:

            def run() -> Any:
                started.append(time.monotonic())
                return self.compile(spec)

            future = self._pool.submit(run)
        self._pending[request_id] = PendingCompile(payload, future, started)

    def discard(self, request_id: str) -> bool:
        """Forget a request still compiling (aborted); its result will be dropped."""
        return self._pending.pop(request_id, None) is not None

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

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
                    done.append(CompileResult(item.payload, None, str(exc)))
                except Exception as exc:  # a library bug must not kill the engine
                    logger.exception("grammar compile failed for %s", rid)
                    done.append(CompileResult(item.payload, None, f"compile failed: {exc}"))
            elif item.started and now - item.started[0] >= self.compile_timeout_s:
                del self._pending[rid]
                item.future.cancel()
                done.append(
                    CompileResult(
                        item.payload,
                        None,
                        f"compiling the constraint took longer than {self.compile_timeout_s:g} s",
                    )
                )
        return done

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
