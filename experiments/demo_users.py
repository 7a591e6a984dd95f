"""Synthetic users for ``serve.py --demo``: task traffic with verifier rewards, and a console report.

Each user round picks a problem of the demo task (training seeds, never the gate's held-out seed) and
runs the demo agent on it ``group`` times at once with different sampling seeds, so the learner gets
groups to compare: sent together, a group's runs end together and settle into one learner update
(sent one after another, the learner's window split them: one update got 75 runs in 13 partial groups). The
agent's verifier rewards every run. The status (runs so far, recent success rate per serving version,
and the learner's state: version, champion, running experiment, read from ``GET /admin/learner``) is
one live line at the bottom of the terminal with ``live=True`` (``learner.logs.StatusLine``: log lines
print above it), else a ``demo status`` log event every ``report_s`` seconds.

Not here: training (the learner process does it).
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import structlog

from learner.logs import StatusLine

log = structlog.get_logger(__name__)


class DemoUsers:
    def __init__(
        self,
        base_url: str,
        admin_key: str,
        agent: str,
        task: str,
        *,
        users: int = 4,
        group: int = 4,
        report_s: float = 30.0,
        problems: int = 2000,
        seed: int = 0,
        live: bool = False,
    ) -> None:
        self.base_url, self.admin_key, self.agent, self.task = base_url.rstrip("/"), admin_key, agent, task
        self.users, self.group, self.report_s, self.problems = users, group, report_s, problems
        self.rng = random.Random(seed)
        self.recent: dict[str, deque[bool]] = defaultdict(lambda: deque(maxlen=200))
        self.runs = 0
        self.errors = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.status = StatusLine() if live else None

    def start(self) -> None:
        for i in range(self.users):
            t = threading.Thread(target=self._user, args=(i,), name=f"demo-user-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._reporter, name="demo-report", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        if self.status is not None:
            self.status.stop()

    def _user(self, i: int) -> None:
        limits = httpx.Limits(max_connections=self.group, max_keepalive_connections=self.group)
        with httpx.Client(base_url=self.base_url, timeout=900, limits=limits) as client, ThreadPoolExecutor(self.group) as pool:
            while not self._stop.is_set():
                with self._lock:
                    problem = self.rng.randrange(self.problems)
                for f in [pool.submit(self._run, client, i, problem, k) for k in range(self.group)]:
                    f.result()

    def _run(self, client: httpx.Client, i: int, problem: int, k: int) -> None:
        body = {"task": self.task, "problem_index": problem, "seed": 0, "sample_seed": 1000 * i + k, "user": f"demo-user-{i}"}
        try:
            r = client.post(f"/v1/agents/{self.agent}/runs", json=body, headers={"X-Session-Id": f"demo-{i}-{problem}-{k}"})
            if r.status_code != 200:
                raise httpx.HTTPStatusError(f"{r.status_code}: {r.text[:300]}", request=r.request, response=r)
        except httpx.HTTPError as exc:
            with self._lock:
                self.errors += 1
            log.warning("demo run failed", error=str(exc))
            self._stop.wait(2.0)
            return
        run = r.json()
        with self._lock:
            self.runs += 1
            self.recent[run.get("adapter") or "base"].append(bool(run.get("correct")))

    def snapshot(self) -> dict[str, Any]:
        """Runs, errors and the recent success rate per serving version (the last 200 runs of each)."""
        with self._lock:
            success = {v: {"rate": round(sum(d) / len(d), 3), "n": len(d)} for v, d in sorted(self.recent.items()) if d}
            return {"runs": self.runs, "errors": self.errors, "success": success}

    def line(self, learner: str | None = None) -> str:
        snap = self.snapshot()
        rates = ", ".join(f"{v} {s['rate']:.2f} (n={s['n']})" for v, s in snap["success"].items())
        learner = self._learner() if learner is None else learner
        return f"demo: {snap['runs']} runs ({snap['errors']} errors) │ recent success {rates or 'n/a'} │ learner {learner}"

    def _learner(self) -> str:
        try:
            r = httpx.get(f"{self.base_url}/admin/learner?history=0", headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=10)
            r.raise_for_status()
            data: list[dict[str, Any]] = r.json()["data"]
        except httpx.HTTPError as exc:
            return f"unavailable ({exc})"
        if not data:
            return "starting"
        s = data[0]
        return f"{s.get('state')} v{s.get('version')} champion={s.get('champion')} experiment={s.get('experiment')} ({s.get('detail', '')})"

    def _reporter(self) -> None:
        if self.status is not None:
            self.status.start()
            learner, last_poll = "starting", 0.0
            while not self._stop.wait(1.0):  # the line's run counts move every second; the learner is asked every 5 s
                if time.monotonic() - last_poll >= 5.0:
                    learner, last_poll = self._learner(), time.monotonic()
                self.status.update(self.line(learner))
            return
        while not self._stop.wait(self.report_s):
            log.info("demo status", **self.snapshot(), learner=self._learner())
