"""Engine-side Prometheus metrics (queue, KV cache, token counters, preemptions).

The engine core runs in its own process; with PROMETHEUS_MULTIPROC_DIR set (the
gunicorn master sets it for every process it starts) these values land in the shared
directory and any API worker's /metrics reports them. In-process mode uses the default
registry of this process.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import Counter, Gauge

from engine.core import EngineCore

logger = logging.getLogger("hearth.engine")


def _gauge(name: str, documentation: str) -> Gauge:
    """A gauge whose multiprocess value is the engine's latest (only the core sets it)."""
    return Gauge(name, documentation, multiprocess_mode="mostrecent")


class EngineMetrics:
    _instance: EngineMetrics | None = None

    def __init__(self) -> None:
        self.running = _gauge("hearth:num_requests_running", "Sequences in the running batch")
        self.waiting = _gauge("hearth:num_requests_waiting", "Sequences waiting to be scheduled")
        self.kv_usage = _gauge(
            "hearth:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)"
        )
        self.kv_used_blocks = _gauge(
            "hearth:kv_cache_used_blocks", "KV cache blocks held by sequences"
        )
        self.kv_total_blocks = _gauge("hearth:kv_cache_total_blocks", "KV cache blocks in the pool")
        self.preemptions = Counter("hearth:num_preemptions", "Sequences preempted by recompute")
        self.prefix_queries = Counter(
            "hearth:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = Counter(
            "hearth:prefix_cache_hits", "Prompt tokens served from the prefix cache"
        )
        # Prompt/generation token counters are the API workers' (labelled by model).
        self._last_totals = {"num_preemptions": 0, "num_prefix_queries": 0, "num_prefix_hits": 0}
        """The core's running totals at the last update: counters advance by the difference."""

    @classmethod
    def get(cls) -> EngineMetrics:
        """One set per process: prometheus_client refuses duplicate registration."""
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def update(self, core: EngineCore) -> None:
        sched, bm = core.scheduler, core.block_manager
        self.running.set(sched.num_running)
        self.waiting.set(sched.num_waiting)
        self.kv_usage.set(bm.usage)
        self.kv_used_blocks.set(bm.num_used_blocks)
        self.kv_total_blocks.set(bm.num_blocks)
        totals = {
            "num_preemptions": sched.num_preemptions,
            "num_prefix_queries": bm.num_prefix_queries,
            "num_prefix_hits": bm.num_prefix_hits,
        }
        for name, counter in (
            ("num_preemptions", self.preemptions),
            ("num_prefix_queries", self.prefix_queries),
            ("num_prefix_hits", self.prefix_hits),
        ):
            delta = totals[name] - self._last_totals[name]
            if delta > 0:
                counter.inc(delta)
        self._last_totals = totals


class StatsLogger:
    """The periodic engine log line: throughput, queue and KV use."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._t = time.monotonic()
        self._prompt = 0
        self._gen = 0

    def maybe_log(self, core: EngineCore) -> None:
        now = time.monotonic()
        if now - self._t < self.interval:
            return
        dt = now - self._t
        # Prompt tokens as they are computed, not as they are admitted: a long prefill
        # (a batch of 180 embeddings) shows its real rate, not 0 after a burst.
        prompt, gen = core.num_prefill_tokens_computed, core.num_generation_tokens_total
        if prompt != self._prompt or gen != self._gen or core.has_work():
            logger.info(
                "engine: prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, "
                "KV cache %.1f%%, preemptions %d",
                (prompt - self._prompt) / dt,
                (gen - self._gen) / dt,
                core.scheduler.num_running,
                core.scheduler.num_waiting,
                100 * core.block_manager.usage,
                core.scheduler.num_preemptions,
            )
        self._t, self._prompt, self._gen = now, prompt, gen
