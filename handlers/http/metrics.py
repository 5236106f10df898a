"""Prometheus metrics of the API worker, and the /metrics exposition.

Names mirror vLLM's under the `hearth:` prefix. With several gunicorn workers each one
writes its samples to `PROMETHEUS_MULTIPROC_DIR` (the container sets it before Python
starts), and /metrics aggregates every process there, the engine's gauges included.
The metric objects are process-wide singletons: building a second app in one process
(tests) reuses them instead of registering duplicates.
"""

from __future__ import annotations

import os
from functools import lru_cache

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)

from handlers.serving.stats import RequestRecord

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class _Metrics:
    def __init__(self) -> None:
        labels = ["model_name"]
        self.ttft = Histogram(
            "hearth:time_to_first_token_seconds",
            "Time to first token of a request, from arrival in the API worker.",
            labels,
            buckets=TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "hearth:inter_token_latency_seconds",
            "Time between consecutive output tokens of a request.",
            labels,
            buckets=ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "hearth:e2e_request_latency_seconds",
            "End-to-end latency of a request in the API worker.",
            labels,
            buckets=E2E_BUCKETS,
        )
        self.success = Counter(
            "hearth:request_success",
            "Finished generation sequences, by finish reason.",
            ["model_name", "finished_reason"],
        )
        self.prompt_tokens = Counter(
            "hearth:prompt_tokens", "Prompt tokens of admitted requests.", labels
        )
        self.generation_tokens = Counter(
            "hearth:generation_tokens", "Generated tokens sent to clients.", labels
        )
        self.lora_requests = Counter(
            "hearth:lora_requests",
            "Finished requests that ran on a LoRA adapter, by adapter.",
            ["model_name", "lora_name"],
        )


@lru_cache(maxsize=1)
def _metrics() -> _Metrics:
    return _Metrics()


class PrometheusStats:
    """StatsSink recording into the worker's Prometheus metrics."""

    def __init__(self, model_name: str) -> None:
        metrics = _metrics()
        self._ttft = metrics.ttft.labels(model_name)
        self._itl = metrics.itl.labels(model_name)
        self._e2e = metrics.e2e.labels(model_name)
        self._prompt_tokens = metrics.prompt_tokens.labels(model_name)
        self._generation_tokens = metrics.generation_tokens.labels(model_name)
        self._success = metrics.success
        self._lora_requests = metrics.lora_requests
        self._model_name = model_name

    def observe_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_finished(self, record: RequestRecord) -> None:
        self._e2e.observe(record.e2e)
        self._prompt_tokens.inc(record.num_prompt_tokens)
        self._generation_tokens.inc(record.num_output_tokens)
        if record.adapter is not None:
            self._lora_requests.labels(self._model_name, record.adapter).inc()
        if record.status != "error":
            for reason in record.finish_reasons:
                self._success.labels(self._model_name, reason).inc()


def render_metrics() -> tuple[bytes, str]:
    """Prometheus text of this process, or of every process in the multiprocess dir."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
