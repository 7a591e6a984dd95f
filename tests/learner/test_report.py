"""``python -m learner report``: one standalone HTML file with the learner and experiment views, opened in Debian's
Chromium. The experiment's rewards are set here, so its numbers are known from their definition: arm ``f@1`` gets
1, 0, 1, 1, 1 (mean 0.8, 95% t-interval 0.8 ± t(0.975, 4) · sqrt(0.2) / sqrt(5)), arm ``f@2`` gets 0, 0, 1, 0
(mean 0.25, ± t(0.975, 3) · 0.5 / 2)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from learner.records.experiments_store import ExperimentStore
from learner.records.store import SqliteStore
from tests.runtime.test_experiments import add_rewards

ROOT = Path(__file__).resolve().parent.parent.parent
T975 = {4: 2.7764451051977987, 3: 3.182446305284263}  # Student t quantiles (tables)
HOSTILE = "</script><script>window.pwned = 1</script>"


def ci(values: list[float]) -> tuple[float, float, float]:
    n = len(values)
    mean = sum(values) / n
    half = T975[n - 1] * (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 / n**0.5
    return mean, mean - half, mean + half


def make_run(d: Path) -> None:
    fam = d / "learner" / "calc-lora"
    fam.mkdir(parents=True)
    status = {"family": "calc-lora", "state": "ab", "detail": f"experiment f-ab running {HOSTILE}", "version": 3, "champion": "f@1"}
    (fam / "status.json").write_text(json.dumps({**status, "experiment": "f-ab", "updates": 3, "updated_at": time.time()}))
    history = [
        {"version": 1, "metrics": {"optimizer_step": True, "reward_mean": 0.2, "loss": 0.5, "kl": 0.01, "samples": 32, "trained_samples": 24},
         "gate": {"decision": "passed", "new_success": 0.3, "champion_success": 0.25}},
        {"version": 2, "metrics": {"optimizer_step": False, "reward_mean": 0.0, "frac_reward_zero_std": 1.0, "samples": 16},
         "gate": {"decision": "skipped", "reason": "no optimizer step"}},
        {"version": 3, "metrics": {"optimizer_step": True, "reward_mean": 0.45, "loss": 0.3, "kl": 0.02, "samples": 48, "trained_samples": 40},
         "gate": {"decision": "passed", "new_success": 0.5, "champion_success": 0.3}},
    ]  # fmt: skip
    (fam / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    store = SqliteStore(d / "interactions.db")
    add_rewards(store, "f@1", [1.0, 0.0, 1.0, 1.0, 1.0], 0)
    add_rewards(store, "f@2", [0.0, 0.0, 1.0, 0.0], 0)
    config = {"name": "f-ab", "family": "f", "arms": [{"adapter": "f@1", "weight": 1.0}, {"adapter": "f@2", "weight": 1.0}]}
    config |= {"metric": "verifier:exact", "min_samples": 4, "max_samples": None, "alpha": 0.05}
    t0 = time.time() - 600
    state = {"status": "running", "champion": "f@1", "started_at": 0.0, "stopped_arms": [], "p_values": {"f@2": 0.42}, "decisions": []}
    state["p_history"] = {"f@2": [{"t": t0 + 60, "p": 0.9, "n_champion": 4, "n": 4}, {"t": t0 + 300, "p": 0.42, "n_champion": 5, "n": 4}]}
    ExperimentStore(store).save("f-ab", config, state)
    store.close()


def test_report_is_one_standalone_file_with_the_consoles_views(tmp_path, chromium):
    make_run(tmp_path)
    out = tmp_path / "report.html"
    p = subprocess.run(
        [sys.executable, "-m", "learner", "report", "--data-dir", str(tmp_path), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "1 learner(s), 3 update(s), 1 experiment(s)" in p.stderr
    html = out.read_text()
    assert not re.findall(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", html)  # nothing fetched from anywhere
    page = chromium.new_page(viewport={"width": 1200, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(out.as_uri())
    page.wait_for_selector('[data-testid=experiment][data-name="f-ab"] [data-testid=arm-row][data-adapter="f@2"]')
    for adapter, rewards in {"f@1": [1.0, 0.0, 1.0, 1.0, 1.0], "f@2": [0.0, 0.0, 1.0, 0.0]}.items():
        row = f'[data-testid=arm-row][data-adapter="{adapter}"]'
        mean, low, high = ci(rewards)
        assert page.inner_text(f"{row} [data-col=n]") == str(len(rewards))
        assert page.inner_text(f"{row} [data-col=mean]") == f"{mean:.3f}"
        assert page.inner_text(f"{row} [data-col=ci95]") == f"[{low:.3f}, {high:.3f}]"
    assert page.inner_text('[data-testid=arm-row][data-adapter="f@2"] [data-col=p]') == "0.4200"  # the stored always-valid p
    learner = '[data-testid=learner][data-family="calc-lora"]'
    why = page.inner_text(f"{learner} [data-testid=learner-why]")
    assert HOSTILE in why and page.evaluate("window.pwned") is None  # stored text stays text, even inside the file's script
    assert "trained on 40 of 48 samples" in why and "held-out 0.50 vs champion 0.30" in why
    assert page.locator(f"{learner} svg.plot").count() >= 2 and page.locator("[data-testid=experiment] svg.plot").count() == 2
    page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
    assert errors == []
    page.close()


def test_report_needs_a_data_directory(tmp_path):
    p = subprocess.run([sys.executable, "-m", "learner", "report", "--data-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "r.html")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 2 and "no data directory" in p.stderr and not (tmp_path / "r.html").exists()
