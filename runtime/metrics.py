"""Prometheus metrics for one app instance (its own registry, so tests can build several apps).

Exposed at ``GET /metrics``: request counts by endpoint and status, request latency and time to first
token, prompt and generated token counters (``rate(loopwise_generated_tokens_total[1m])`` is tokens/s;
``loopwise_generation_tokens_per_second`` is the same over the last 10 s for a glance), queue depth
and running requests (read from the engine at scrape time), and the decode batch size per step.

Per served adapter (``base`` = the base model): model requests, their latency and generated tokens,
counted for chat completions and for agent model calls alike. ``runtime/traffic.py`` turns these
counters into rates over the last hour.

``ReplicaCollector`` adds, for the replicas of an external engine (``runtime/engines/replicas.py``),
``loopwise_engine_replica_up``, ``_in_flight``, ``_adapters`` and ``_requests_total`` per replica
(labels ``replica``, ``url``), read at scrape time.

Not here: per-experiment statistics (``runtime/adapters/experiments.py``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, engine_stats: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("loopwise_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.latency = Histogram("loopwise_request_latency_seconds", "request latency", ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("loopwise_time_to_first_token_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("loopwise_prompt_tokens", "prompt tokens processed", registry=r)
        self.generated_tokens = Counter("loopwise_generated_tokens", "tokens generated", registry=r)
        self.recorded_turns = Counter("loopwise_recorded_turns", "turns committed to the interaction store", registry=r)
        self.record_backpressure = Counter("loopwise_record_backpressure", "requests that waited for room in the recorder queue", registry=r)
        self.record_failures = Counter("loopwise_record_failures", "turns that could not be recorded after retries", registry=r)
        self.adapter_requests = Counter(
            "loopwise_adapter_requests",
            "model requests (chat completions, agent model calls) per served adapter (base = the base model)",
            ["adapter"],
            registry=r,
        )
        self.adapter_latency = Histogram(
            "loopwise_adapter_latency_seconds", "request latency per adapter", ["adapter"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.adapter_tokens = Counter("loopwise_adapter_generated_tokens", "tokens generated per adapter", ["adapter"], registry=r)
        self.adapter_errors = Counter(
            "loopwise_adapter_errors",
            "model requests that failed after routing, per served adapter and HTTP status (499: the client left)",
            ["adapter", "status"],
            registry=r,
        )
        self.throttled_requests = Counter(
            "loopwise_throttled_requests", "requests refused (429) because their API key is throttled (runtime/throttle.py)", registry=r
        )
        self.throttled_keys = Gauge("loopwise_throttled_keys", "API keys throttled now for sending mostly refused requests", registry=r)
        self.batch_size = Histogram("loopwise_batch_size", "rows per engine forward step", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        queue = Gauge("loopwise_queue_depth", "requests waiting for a batch slot", registry=r)
        queue.set_function(lambda: engine_stats().get("waiting", 0.0))
        running = Gauge("loopwise_running_requests", "requests being decoded", registry=r)
        running.set_function(lambda: engine_stats().get("running", 0.0))
        tps = Gauge("loopwise_generation_tokens_per_second", "tokens generated per second over the last 10 s", registry=r)
        tps.set_function(self._recent_rate)
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()

    def on_step(self, rows: int) -> None:
        """Called by the engine thread after each forward step."""
        self.batch_size.observe(rows)
        self.generated_tokens.inc(rows)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, rows))
            while self._recent and self._recent[0][0] < now - 10:
                self._recent.popleft()

    def _recent_rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            total = sum(n for t, n in self._recent if t >= now - 10)
        return total / 10.0

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ReplicaCollector:
    """Per-replica state of an external engine (``status()`` rows: url, up, in_flight, adapters, requests) at scrape time."""

    def __init__(self, status: Callable[[], list[dict[str, Any]]]) -> None:
        self.status = status

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["replica", "url"]
        up = GaugeMetricFamily("loopwise_engine_replica_up", "1 while the engine replica is routed to", labels=labels)
        running = GaugeMetricFamily("loopwise_engine_replica_in_flight", "requests in flight to the replica", labels=labels)
        adapters = GaugeMetricFamily("loopwise_engine_replica_adapters", "adapters loaded on the replica", labels=labels)
        requests = CounterMetricFamily("loopwise_engine_replica_requests", "requests routed to the replica", labels=labels)
        for i, row in enumerate(self.status()):
            key = [str(i), str(row["url"])]
            up.add_metric(key, 1.0 if row["up"] else 0.0)
            running.add_metric(key, float(row["in_flight"]))
            adapters.add_metric(key, float(len(row["adapters"])))
            requests.add_metric(key, float(row["requests"]))
        yield from (up, running, adapters, requests)
