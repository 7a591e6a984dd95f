"""Traffic over the last hour, from the server's own Prometheus counters (what ``GET /admin/traffic`` answers).

Prometheus counters only grow, so a scrape alone cannot say what happened ten minutes ago.
:class:`TrafficHistory` keeps a snapshot of the serving counters every ``interval_s`` (10 s) for
``window_s`` (an hour) and answers with one point per interval: model requests/s and generated
tokens/s (all adapters and per adapter, ``base`` = the base model), latency p50/p95 (interpolated in
the latency histogram's buckets, as Prometheus' ``histogram_quantile`` does), HTTP errors by
status code, and per adapter the chat-path model requests that failed after routing (by status; 499 =
the client left). Model requests are chat completions and agent model calls (``loopwise_adapter_*``); the
console's own admin polling is not traffic and is not counted there, but its errors are (a wrong
admin key shows as 401s).

:meth:`TrafficHistory.series` (served by ``GET /admin/traffic?minutes=60``, ``runtime/admin/traffic.py``)::

    {"interval_s": 10, "points": [{"t": end (unix s), "dt": seconds, "requests_per_s", "tokens_per_s",
      "latency_p50_s", "latency_p95_s", "errors": {"429": 3}, "by_adapter": {"base": {...same four, "errors": {"503": 1}}}}],
     "totals": {"requests", "tokens", "errors": {"code": n}, "errors_by_endpoint": {"endpoint": {"code": n}},
                "by_adapter": {"base": {"requests", "tokens", "share", "errors": {"code": n}}}}}

The last point is partial (``"partial": true``): from the newest snapshot to now, so the console
shows traffic seconds after a start. Memory is bounded: ``window_s / interval_s`` snapshots of
a few hundred numbers each.

Not here: the counters themselves (``runtime/metrics.py``), the route (``runtime/admin/traffic.py``), per-experiment statistics
(``runtime/adapters/experiments.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from runtime.metrics import Metrics

Key = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)


@dataclass(frozen=True)
class Snapshot:
    t: float
    values: dict[Key, float] = field(default_factory=dict)


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The ``q``-quantile of a cumulative histogram ``[(upper bound, count <= bound), ...]`` (with +Inf).

    Prometheus' rule: find the bucket holding rank ``q * total`` and interpolate linearly inside it (the
    first bucket starts at 0); a rank in the +Inf bucket answers the largest finite bound. None when empty.
    """
    pts = sorted(buckets)
    if not pts or pts[-1][1] <= 0:
        return None
    rank = q * pts[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in pts:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


class TrafficHistory:
    """Snapshots of the serving counters (see the module docstring); ``sample`` is called every ``interval_s``."""

    def __init__(self, metrics: Metrics, *, interval_s: float = 10.0, window_s: float = 3600.0) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self.window_s = window_s
        self.snapshots: deque[Snapshot] = deque(maxlen=int(window_s / interval_s) + 1)

    def snapshot(self, now: float | None = None) -> Snapshot:
        m = self.metrics
        values: dict[Key, float] = {}
        for metric in (m.requests, m.adapter_requests, m.adapter_tokens, m.adapter_latency, m.adapter_errors, m.generated_tokens):
            for family in metric.collect():
                for s in family.samples:
                    if s.name.endswith(("_created", "_sum")):
                        continue
                    values[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
        return Snapshot(time.time() if now is None else now, values)

    def sample(self, now: float | None = None) -> None:
        self.snapshots.append(self.snapshot(now))

    async def run(self) -> None:
        """Sample forever (the app's lifespan runs this as a task)."""
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def series(self, minutes: float = 60.0, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        snaps = [s for s in self.snapshots if s.t >= now - minutes * 60 - self.interval_s]
        points = [_point(a, b) for a, b in itertools.pairwise(snaps)]
        if snaps and now - snaps[-1].t >= 1.0:  # the interval in progress
            points.append({**_point(snaps[-1], self.snapshot(now)), "partial": True})
        totals = _totals(snaps[0], self.snapshot(now)) if snaps else _totals(Snapshot(now), Snapshot(now))
        return {"object": "traffic", "interval_s": self.interval_s, "minutes": minutes, "points": points, "totals": totals}


def _delta(a: Snapshot, b: Snapshot) -> dict[Key, float]:
    """Counter increases from ``a`` to ``b`` (a label first seen in ``b`` started at 0)."""
    return {k: v - a.values.get(k, 0.0) for k, v in b.values.items()}


def _labels(key: Key) -> dict[str, str]:
    return dict(key[1])


def _by(delta: dict[Key, float], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, v in delta.items():
        if key[0] == name:
            lab = _labels(key).get(label, "")
            out[lab] = out.get(lab, 0.0) + v
    return out


def _adapter_errors(delta: dict[Key, float]) -> dict[str, dict[str, float]]:
    """Failed model requests per adapter and status (``loopwise_adapter_errors``) in ``delta``."""
    out: dict[str, dict[str, float]] = {}
    for key, n in delta.items():
        if key[0] == "loopwise_adapter_errors_total" and n > 0:
            labels = _labels(key)
            per = out.setdefault(labels.get("adapter", ""), {})
            per[labels.get("status", "")] = per.get(labels.get("status", ""), 0.0) + n
    return out


def _quantiles(delta: dict[Key, float], adapter: str | None) -> tuple[float | None, float | None]:
    """p50 and p95 of the adapter latency histogram's increase (one adapter, or all summed)."""
    buckets: dict[float, float] = {}
    for key, v in delta.items():
        if key[0] != "loopwise_adapter_latency_seconds_bucket":
            continue
        labels = _labels(key)
        if adapter is not None and labels.get("adapter") != adapter:
            continue
        le = float(labels["le"])
        buckets[le] = buckets.get(le, 0.0) + v
    pts = list(buckets.items())
    return histogram_quantile(0.5, pts), histogram_quantile(0.95, pts)


def _point(a: Snapshot, b: Snapshot) -> dict[str, Any]:
    d = _delta(a, b)
    dt = max(b.t - a.t, 1e-9)
    reqs = _by(d, "loopwise_adapter_requests_total", "adapter")
    toks = _by(d, "loopwise_adapter_generated_tokens_total", "adapter")
    p50, p95 = _quantiles(d, None)
    errs = _adapter_errors(d)
    by_adapter = {}
    for adapter in sorted(set(reqs) | set(toks) | set(errs)):
        if not reqs.get(adapter) and not toks.get(adapter) and not errs.get(adapter):
            continue
        a50, a95 = _quantiles(d, adapter)
        by_adapter[adapter] = {
            "requests_per_s": reqs.get(adapter, 0.0) / dt,
            "tokens_per_s": toks.get(adapter, 0.0) / dt,
            "latency_p50_s": a50,
            "latency_p95_s": a95,
            "errors": errs.get(adapter, {}),
        }
    errors = {code: n for code, n in _by(d, "loopwise_requests_total", "status").items() if code.isdigit() and int(code) >= 400 and n > 0}
    return {
        "t": b.t,
        "dt": dt,
        "requests_per_s": sum(reqs.values()) / dt,
        "tokens_per_s": sum(toks.values()) / dt,
        "latency_p50_s": p50,
        "latency_p95_s": p95,
        "errors": errors,
        "by_adapter": by_adapter,
    }


def _totals(a: Snapshot, b: Snapshot) -> dict[str, Any]:
    d = _delta(a, b)
    reqs = _by(d, "loopwise_adapter_requests_total", "adapter")
    toks = _by(d, "loopwise_adapter_generated_tokens_total", "adapter")
    total = sum(reqs.values())
    errors: dict[str, float] = {}
    by_endpoint: dict[str, dict[str, float]] = {}
    for key, n in d.items():
        if key[0] != "loopwise_requests_total" or n <= 0:
            continue
        labels = _labels(key)
        code = labels.get("status", "")
        if code.isdigit() and int(code) >= 400:
            errors[code] = errors.get(code, 0.0) + n
            by_endpoint.setdefault(labels.get("endpoint", ""), {})[code] = n
    errs = _adapter_errors(d)
    by_adapter = {
        adapter: {
            "requests": reqs.get(adapter, 0.0),
            "tokens": toks.get(adapter, 0.0),
            "share": reqs.get(adapter, 0.0) / total if total else 0.0,
            "errors": errs.get(adapter, {}),
        }
        for adapter in sorted(set(reqs) | set(toks) | set(errs))
        if reqs.get(adapter) or toks.get(adapter) or errs.get(adapter)
    }
    return {
        "seconds": b.t - a.t,
        "requests": total,
        "tokens": sum(toks.values()),
        "errors": errors,
        "errors_by_endpoint": by_endpoint,
        "by_adapter": by_adapter,
    }


__all__ = ["TrafficHistory", "histogram_quantile"]
