"""``GET /admin/learner[?history=N]``, ``POST /admin/learner/update`` and the learner's ``/metrics``: its state, through files.

The learner (``python -m learner run``) keeps ``<data-dir>/learner/<family>/status.json`` current;
this module serves those files and asks for an update by writing ``update.request`` next to them,
which the learner picks up within a second. :class:`LearnerCollector` exports each learner's
last-step metrics (loss, KL, clip fraction, reward mean/std, ``frac_reward_zero_std``, entropy,
tokens/s), version and update count on the server's ``/metrics`` (``loopwise_learner_*{family=...}``),
and the last update's own rollouts (``status.sources``): RODS's pool size, zero-variance fraction and
boundary histogram (``loopwise_learner_rods_*``), PATR's sampled tokens, tool calls, runs and leaves
(``loopwise_learner_patr_*``), read at scrape time. Files keep the runtime free of learner imports and work when the learner runs on
another host that shares the data folder.

Supervision: ``serve.py`` writes ``supervisor.json`` next to a learner's status (``learner/supervisor.py``: restarts,
last exit code or signal and when, the learner's error, the next restart); it is merged into that learner's status
as ``supervisor`` (a learner in backoff or stopped by its supervisor is not ``running``; one that crashed before it
wrote any status is listed from that file alone). The learner's own ``last_error``, ``crashes``, ``failing_batch``
and ``quarantine`` (``learner/quarantine.py``) are in its status. ``/metrics`` adds ``loopwise_learner_restarts_total``,
``loopwise_learner_crashes_total`` and ``loopwise_learner_quarantined_trajectories``.

Not here: training (``learner/``).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from runtime.errors import APIError
from runtime.http_body import read_json
from runtime.identity import check_admin_key
from runtime.services import services

MAX_HISTORY = 1000  # updates per learner one GET /admin/learner returns at most
STALE_S = 120.0  # a status not refreshed for this long belongs to a learner that is not running
SUPERVISOR_FILE = "supervisor.json"  # written by serve.py's supervisor (learner/supervisor.py)
SUPERVISED_DOWN = ("backoff", "stopped", "failed")  # supervisor states in which no learner process runs
router = APIRouter()


def _statuses(root: Path, history: int = 20) -> list[dict[str, Any]]:
    """Every learner's status with its last ``history`` updates (``GET /admin/learner?history=N``; ``/metrics`` asks for none)."""
    out = []
    folders = _learner_folders(root)
    for folder in folders:
        path = folder / "status.json"
        supervisor = _read_supervisor(folder)
        if not path.exists() and supervisor is not None:  # started (and maybe crashed) before it wrote a status
            down = supervisor.get("state") in SUPERVISED_DOWN
            detail = "the learner process exited before it reported" if down else "the learner process is starting"
            state = "error" if down else "starting"
            out.append({"family": folder.name, "state": state, "detail": detail, "running": not down, "supervisor": supervisor})
            continue
        try:
            status = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:  # mid-replace on another host, or damaged: report, don't fail
            out.append({"family": folder.name, "state": "unknown", "detail": f"unreadable status: {exc}"})
            continue
        age = time.time() - float(status.get("updated_at", 0))
        status["running"] = status.get("state") != "stopped" and age < STALE_S
        if supervisor is not None:
            status["supervisor"] = supervisor
            # down since the supervisor's last word, unless a learner (on another host?) wrote its status after that
            down = supervisor.get("state") in SUPERVISED_DOWN and float(status.get("updated_at", 0)) <= float(supervisor.get("updated_at") or 0)
            status["running"] = status["running"] and not down
        status["status_age_s"] = round(age, 1)
        hist = folder / "history.jsonl"
        if history > 0:
            status["history"] = _tail_jsonl(hist, history)
        out.append(status)
    return out


def _learner_folders(root: Path) -> list[Path]:
    """Every learner's folder: one with a status, or one the supervisor started that has not reported yet."""
    return sorted({p.parent for p in root.glob("*/status.json")} | {p.parent for p in root.glob(f"*/{SUPERVISOR_FILE}")})


def _read_supervisor(folder: Path) -> dict[str, Any] | None:
    """``supervisor.json`` of a learner folder, None when absent or unreadable (then the status stands alone)."""
    try:
        data = json.loads((folder / SUPERVISOR_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _tail_jsonl(path: Path, n: int) -> list[dict[str, Any]]:
    """The last ``n`` records of a JSON-lines file; a line being appended right now (not yet whole) is skipped."""
    try:
        lines = path.read_text().splitlines()[-(n + 1) :]
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out[-n:]


LEARNER_GAUGES = {  # status.json's last_metrics key -> (metric name, help)
    "loss": ("loopwise_learner_loss", "policy loss of the last update step"),
    "kl": ("loopwise_learner_kl", "KL to the base model (mean per token) of the last update step"),
    "clip_frac": ("loopwise_learner_clip_fraction", "fraction of tokens whose ratio was clipped in the last update step"),
    "reward_mean": ("loopwise_learner_reward_mean", "mean reward of the last update's samples"),
    "reward_std": ("loopwise_learner_reward_std", "reward std of the last update's samples"),
    "frac_reward_zero_std": ("loopwise_learner_frac_reward_zero_std", "share of groups with equal rewards (nothing to learn) in the last update"),
    "entropy": ("loopwise_learner_entropy", "mean token entropy of the last update step"),
    "tokens_per_s": ("loopwise_learner_tokens_per_second", "forward+backward tokens per second of the last update step"),
    "grad_norm": ("loopwise_learner_grad_norm", "gradient norm (before clipping) of the last update step"),
}


SOURCE_GAUGES = {  # (status.sources part, key) -> (metric name, help)
    ("rods", "pool_size"): ("loopwise_learner_rods_pool_size", "RODS replay pool size after the last update"),
    ("rods", "variants"): ("loopwise_learner_rods_variants", "synthesised items in the RODS pool after the last update"),
    ("rods", "zero_variance_fraction"): (
        "loopwise_learner_rods_zero_variance_fraction",
        "share of the pool items visited in the last update whose rollouts all had the same reward",
    ),
    ("patr", "tokens"): ("loopwise_learner_patr_sampled_tokens", "tokens PATR's trees sampled in the last update"),
    ("patr", "tool_calls"): ("loopwise_learner_patr_tool_calls", "tool calls of PATR's sampled turns in the last update"),
    ("patr", "runs"): ("loopwise_learner_patr_runs", "segment runs PATR made in the last update"),
    ("patr", "leaves"): ("loopwise_learner_patr_leaves", "leaves (the groups' members) of PATR's trees in the last update"),
}


class LearnerCollector:
    """Prometheus collector: each learner's last-step metrics, version and update count, read from its status file at scrape time."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        statuses = [s for s in _statuses(self.root, history=0) if "family" in s and s.get("state") != "unknown"]
        version = GaugeMetricFamily("loopwise_learner_version", "the learner's trainer version", labels=["family"])
        running = GaugeMetricFamily("loopwise_learner_running", "1 while the learner keeps its status fresh", labels=["family"])
        updates = CounterMetricFamily("loopwise_learner_updates", "updates run by the learner", labels=["family"])
        restarts = CounterMetricFamily(
            "loopwise_learner_restarts", "times serve.py restarted the learner process after it exited (this server run)", labels=["family"]
        )
        crashes = CounterMetricFamily(
            "loopwise_learner_crashes", "updates that raised, and learner processes that died mid-update", labels=["family"]
        )
        quarantined = GaugeMetricFamily(
            "loopwise_learner_quarantined_trajectories",
            "trajectories quarantined after their batch failed twice (later updates skip them)",
            labels=["family"],
        )
        gauges = {k: GaugeMetricFamily(name, doc, labels=["family"]) for k, (name, doc) in LEARNER_GAUGES.items()}
        parity = GaugeMetricFamily(
            "loopwise_learner_parity_logp_diff",
            "mean absolute difference of served and trainer logprobs (nats/token) on the parity probe of the last loaded version",
            labels=["family"],
        )
        sources = {k: GaugeMetricFamily(name, doc, labels=["family"]) for k, (name, doc) in SOURCE_GAUGES.items()}
        hist = GaugeMetricFamily(
            "loopwise_learner_rods_boundary_items", "pool items visited in the last update by boundary score bin [lo, hi)", labels=["family", "bin"]
        )
        for st in statuses:
            fam = str(st["family"])
            version.add_metric([fam], float(st.get("version") or 0))
            running.add_metric([fam], 1.0 if st.get("running") else 0.0)
            updates.add_metric([fam], float(st.get("updates") or 0))
            sup = st.get("supervisor")
            if isinstance(sup, dict) and isinstance(sup.get("restarts"), int):
                restarts.add_metric([fam], float(sup["restarts"]))
            crashes.add_metric([fam], float(st.get("crashes") or 0))
            q = st.get("quarantine")
            quarantined.add_metric([fam], float(q.get("trajectories") or 0) if isinstance(q, dict) else 0.0)
            for k, g in gauges.items():
                v = (st.get("last_metrics") or {}).get(k)
                if isinstance(v, int | float):
                    g.add_metric([fam], float(v))
            p = (st.get("last_parity") or {}).get("mean_abs_logp_diff")
            if isinstance(p, int | float):
                parity.add_metric([fam], float(p))
            src = st.get("sources") or {}
            for (part, key), g in sources.items():
                v = (src.get(part) or {}).get(key) if isinstance(src, dict) else None
                if isinstance(v, int | float) and not isinstance(v, bool):
                    g.add_metric([fam], float(v))
            rods = src.get("rods") if isinstance(src, dict) else None
            if isinstance(rods, dict) and isinstance(rods.get("boundary_histogram"), list) and isinstance(rods.get("histogram_edges"), list):
                edges = rods["histogram_edges"]
                for b, n in enumerate(rods["boundary_histogram"][: len(edges) - 1]):
                    if isinstance(n, int | float):
                        hist.add_metric([fam, f"{edges[b]:g}-{edges[b + 1]:g}"], float(n))
        yield version
        yield running
        yield updates
        yield restarts
        yield crashes
        yield quarantined
        yield from gauges.values()
        yield from sources.values()
        yield hist
        yield parity


@router.get("/admin/learner")
async def learner_status(request: Request, history: int = 20) -> dict[str, Any]:
    s = services(request)
    check_admin_key(request, s.admin_key)
    if not 0 <= history <= MAX_HISTORY:
        raise APIError(400, f"history must be between 0 and {MAX_HISTORY}", param="history", code="invalid_value")
    return {"object": "list", "enabled": s.learner_enabled, "data": await asyncio.to_thread(_statuses, s.learner_root, history)}


@router.post("/admin/learner/update", status_code=202)
async def learner_update(request: Request) -> dict[str, Any]:
    root = services(request).learner_root
    check_admin_key(request, services(request).admin_key)
    body = await read_json(request) if int(request.headers.get("content-length") or 0) else {}
    family = body.get("family")
    families = [f.name for f in _learner_folders(root)]  # one not reported yet takes the request when it starts
    if family is not None:
        if family not in families:
            raise APIError(404, f"no learner for family {family!r} (known: {', '.join(families) or 'none'})", param="family", code="not_found")
        families = [family]
    if not families:
        raise APIError(409, "no learner is running: start serve.py without --no-learner, or run python -m learner run", code="no_learner")
    for f in families:
        tmp = root / f / "update.request.tmp"
        tmp.write_text(json.dumps({"requested_at": time.time()}))
        os.replace(tmp, root / f / "update.request")
    return {"requested": families}
