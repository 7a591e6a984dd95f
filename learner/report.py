"""``python -m learner report --data-dir D --out report.html``: the console's learner and experiment views as one file.

For sharing a run: one standalone HTML file (no server, nothing fetched; open it anywhere) with, per
learner, its state, reward and held-out curves per update, the last update's metrics and why it did or
did not train, and per A/B experiment the arms' n, mean reward with 95% CI bars, the always-valid
p-value over time and the decisions. It draws them with the console's own chart code
(``runtime/console/assets/charts.js`` and ``console.css``, read as package data and inlined), so the
report and the live console show the same pictures.

The data is read from files only, the way the runtime serves it: ``<data-dir>/learner/*/status.json``
and ``history.jsonl`` (every update) and the A/B experiments (``learner/records/experiments_store.py``) in the
interaction store's database (``--db``, default ``<data-dir>/interactions.db``), with each arm's rewards since the experiment started summarised as
``GET /admin/experiments/{name}`` does (mean, 95% t-interval, Welch's test for reference; the
always-valid p-values are the stored ones).

Not here: the live console (``GET /console``), training.
"""

from __future__ import annotations

import html
import json
import math
import time
from importlib import resources
from pathlib import Path
from typing import Any

from learner.records.experiments_store import ExperimentStore
from learner.records.store import SqliteStore

ASSETS = ("charts.js", "console.css")


def _asset(name: str) -> str:
    return (resources.files("runtime.console") / "assets" / name).read_text(encoding="utf-8")


def _num(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def arm_summary(rewards: list[float]) -> tuple[float | None, list[float | None] | None]:
    """Mean and the two-sided 95% t-interval ``mean ± t(0.975, n-1) · s / sqrt(n)`` (s with ddof 1)."""
    from scipy import stats

    n = len(rewards)
    if n == 0:
        return None, None
    mean = sum(rewards) / n
    if n == 1:
        return mean, None
    var = sum((r - mean) ** 2 for r in rewards) / (n - 1)
    half = float(stats.t.ppf(0.975, df=n - 1)) * math.sqrt(var / n)
    return mean, [_num(mean - half), _num(mean + half)]


def learners(data_dir: Path) -> list[dict[str, Any]]:
    """Every learner's status with its whole history (what ``GET /admin/learner?history=N`` shows)."""
    out = []
    for path in sorted((Path(data_dir) / "learner").glob("*/status.json")):
        try:
            status = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            status = {"family": path.parent.name, "state": "unknown", "detail": f"unreadable status: {exc}"}
        history = []
        hist = path.parent / "history.jsonl"
        if hist.exists():
            for line in hist.read_text().splitlines():
                try:
                    history.append(json.loads(line))
                except json.JSONDecodeError:  # a line being appended
                    continue
        status["history"] = history
        out.append(status)
    return out


def experiments(store: SqliteStore) -> list[dict[str, Any]]:
    """Every experiment in the shape of ``GET /admin/experiments/{name}`` (config, state, per-arm statistics)."""
    from scipy import stats

    out = []
    for name, config, state in ExperimentStore(store).load():
        champion = state.get("champion")
        since, until = state.get("started_at", 0.0), state.get("ended_at")
        obs = {a["adapter"]: store.arm_observations(a["adapter"], since, config.get("metric"), until=until) for a in config.get("arms", [])}
        arms = []
        for a in config.get("arms", []):
            o = obs[a["adapter"]]
            mean, ci = arm_summary(o["rewards"])
            row: dict[str, Any] = {
                "adapter": a["adapter"],
                "weight": a.get("weight", 1.0),
                "champion": a["adapter"] == champion,
                "stopped": a["adapter"] in state.get("stopped_arms", []),
                "n": len(o["rewards"]),
                "mean_reward": mean,
                "ci95": ci,
                "requests": len(o["latency_s"]),
                "mean_latency_s": sum(o["latency_s"]) / len(o["latency_s"]) if o["latency_s"] else None,
                "tokens_per_s": sum(o["tokens_per_s"]) / len(o["tokens_per_s"]) if o["tokens_per_s"] else None,
            }
            if a["adapter"] != champion:
                row["msprt_p_value"] = state.get("p_values", {}).get(a["adapter"], 1.0)
                base = obs.get(champion, {}).get("rewards", []) if champion else []
                if len(o["rewards"]) >= 2 and len(base) >= 2:
                    row["welch_p_fixed_horizon"] = _num(float(stats.ttest_ind(base, o["rewards"], equal_var=False).pvalue))
            arms.append(row)
        out.append({"name": name, "config": config, **{k: v for k, v in state.items() if k != "p_values"}, "arms": arms})
    return out


def render(data: dict[str, Any]) -> str:
    """The standalone page: inlined CSS and chart code, the data as JSON, and a few lines that draw it."""
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/").replace("<!--", "<\\!--")
    title = html.escape(f"loopwise report · {data['data_dir']}")
    boot = """
(function () {
  const data = JSON.parse(document.getElementById("loopwise-data").textContent);
  const root = document.getElementById("report");
  const width = Math.min(root.clientWidth - 34, 1100);
  const { el, learnerPanel, experimentPanel, fmtDateTime } = window.LW;
  root.append(el("p", { class: "hint", text: `generated ${fmtDateTime(data.generated_at)} from ${data.data_dir}` }));
  root.append(el("h2", { text: "learners" }));
  if (!data.learners.length) root.append(el("p", { class: "empty", text: "no learner has written a status here" }));
  for (const st of data.learners) root.append(learnerPanel(st, { width }));
  root.append(el("h2", { text: "experiments" }));
  if (!data.experiments.length) root.append(el("p", { class: "empty", text: "no experiments in the store" }));
  const exps = data.experiments.slice().sort((a, b) => (b.started_at || 0) - (a.started_at || 0));
  for (const ex of exps) root.append(experimentPanel(ex, { width, now: data.generated_at }));
})();
"""
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{_asset("console.css")}</style>
</head>
<body>
<header class="top"><div class="brand">loopwise <span class="muted">report</span></div></header>
<main id="report"></main>
<script id="loopwise-data" type="application/json">{payload}</script>
<script>{_asset("charts.js")}</script>
<script>{boot}</script>
</body>
</html>
"""


def build_report(data_dir: Path, out: Path, db: Path | str | None = None) -> dict[str, int]:
    """Write the report; returns what it holds (learners, updates, experiments). ``db``: the store's file or
    ``postgresql://`` URL (default ``<data-dir>/interactions.db``)."""
    from learner.records.store import db_path
    from learner.records.store_open import open_store
    from learner.records.store_sql import is_postgres_url

    path = db or db_path(data_dir)
    exps: list[dict[str, Any]] = []
    if is_postgres_url(path) or Path(path).is_file():
        store = open_store(path)
        try:
            exps = experiments(store)
        finally:
            store.close()
    runs = learners(data_dir)
    data = {"data_dir": str(data_dir), "generated_at": time.time(), "learners": runs, "experiments": exps}
    out.write_text(render(data), encoding="utf-8")
    return {"learners": len(runs), "updates": sum(len(s["history"]) for s in runs), "experiments": len(exps)}
