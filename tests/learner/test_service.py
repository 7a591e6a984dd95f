"""The learner process end to end against ``serve.py``'s app on a real port (tiny model): data → train → publish → load → gate → A/B.

Rewards come from the task's verifier plus ``/v1/feedback`` (the tiny model is random, so feedback
gives each group reward variance). Everything is real: the server, the SQLite store, the adapter
files, the admin API and the runs endpoint the gate uses.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from learner.config import LearnerSettings
from learner.service import REQUEST_FILE, LearnerService, ServiceConfig, learner_dir

ADMIN = "learner-admin"
AGENT = {
    "name": "learn-agent",
    "temperature": 1.0,
    "max_turns": 1,
    "max_tokens_per_turn": 8,
    "task": "basic_arithmetic",
    "adapter_family": "fam",
}
ROOT = Path(__file__).resolve().parent.parent.parent


def admin(server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, server.base_url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120, **kw)


def traffic(server, problems: range, samples: int, model: str | None = None) -> None:
    """``samples`` runs per problem (one group each), with alternating feedback so every group has variance (served by
    ``model`` where given, else by the agent's own family)."""
    for p in problems:
        for k in range(samples):
            body: dict[str, Any] = {"task": "basic_arithmetic", "problem_index": p, "seed": 0, "sample_seed": k}
            if model is not None:
                body["model"] = model
            r = httpx.post(server.url + "/agents/learn-agent/runs", json=body, timeout=120)
            assert r.status_code == 200, r.text
            fb = httpx.post(server.url + "/feedback", json={"trajectory_id": r.json()["trajectory_id"], "reward": float(k % 2)}, timeout=60)
            assert fb.status_code == 200, fb.text


def settings() -> LearnerSettings:
    return LearnerSettings.model_validate(
        {
            "family": "fam",
            "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "trainer": {"lr": 1e-3, "progress": False},
            # the tiny model is random: its verifier rewards are all 0, so these tests reward through /v1/feedback
            "samples": {"settle_s": 0, "reward_sources": ["feedback"]},
        }
    )


def gate_runs_by_model(store) -> dict[str | None, int]:
    """How many eval (gate) runs each serving model made, from the store (None: the base model)."""
    counts: dict[str | None, int] = {}
    for row in store.list_trajectories(limit=100_000):
        traj = store.get_trajectory(row["trajectory_id"])
        if row["meta"].get("eval") and traj is not None and traj.turns:
            counts[traj.turns[0].adapter] = counts.get(traj.turns[0].adapter, 0) + 1
    return counts


def stale_after(updates: int) -> LearnerSettings:
    base = settings()
    return base.model_copy(update={"samples": base.samples.model_copy(update={"max_staleness": updates})})


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    # every test publishes its own family, and an alias target is never evicted: room for all of them
    return start_server(
        "--admin-key", ADMIN, "--agent", json.dumps(AGENT), "--max-loaded-adapters", "16", data_dir=tmp_path_factory.mktemp("learner-data")
    )  # fmt: skip


def test_learner_publishes_a_champion_then_starts_an_ab_experiment(server, tiny_model_path):
    data = server.data_dir
    cfg = ServiceConfig(
        data_dir=data,
        admin_url=server.base_url,
        admin_key=ADMIN,
        base_model=tiny_model_path,
        settings=settings(),
        agent="learn-agent",
        min_new_trajectories=8,
        gate_n=3,
        gate_tolerance=1.0,  # the tiny model is random: the gate must not block this test
        ab_min_samples=4,
        poll_s=0.1,
    )
    svc = LearnerService(cfg)
    assert svc.tick() is False and svc.status.state == "waiting"  # nothing yet
    traffic(server, range(2), 4)
    assert svc.tick() is True
    adapters = admin(server, "GET", "/admin/adapters").json()
    assert adapters["aliases"] == {"fam": "fam@1"} and svc.status.champion == "fam@1"
    assert (data / "adapters" / "fam" / "v1").is_dir()
    history = [json.loads(x) for x in (learner_dir(data, "fam") / "history.jsonl").read_text().splitlines()]
    assert history[-1]["metrics"]["optimizer_step"] is True and history[-1]["gate"]["decision"] == "passed"
    timings = history[-1]["timings"]  # where the update's time went: the parts add up to the whole, the release took the gate's runs
    parts = ("data_s", "train_s", "checkpoint_s", "release_s")
    assert all(timings[k] >= 0 for k in parts) and sum(timings[k] for k in parts) == pytest.approx(timings["total_s"], abs=1e-3)
    assert timings["train_s"] >= history[-1]["metrics"]["step_s"] and timings["release_s"] > 0
    assert timings["started_at"] + timings["total_s"] >= history[-1]["at"]
    assert (learner_dir(data, "fam") / "reward.png").stat().st_size > 0
    # eval-gate runs are recorded but marked, so they never count as new training data
    assert svc.scheduler.count_new() == 0

    # the agent now serves the champion; its runs train version 2, which goes into an A/B against fam@1
    traffic(server, range(2, 4), 4)
    assert svc.tick() is True
    assert svc.status.experiment == "fam-v2" and svc.status.state == "ab"
    exp = admin(server, "GET", "/admin/experiments/fam-v2").json()
    assert sorted(a["adapter"] for a in exp["arms"]) == ["fam@1", "fam@2"]
    # the gate's problems and seeds are fixed: fam@1's runs from its own gate are its runs as the champion, not made again
    gates = [json.loads(x)["gate"] for x in (learner_dir(data, "fam") / "history.jsonl").read_text().splitlines()]
    assert [g["champion_runs"] for g in gates] == ["run", "reused"] and [g["champion"] for g in gates] == [svc.state.base_model_name(), "fam@1"]
    assert gate_runs_by_model(svc.store) == {None: 3, "fam@1": 3, "fam@2": 3}
    assert svc.tick() is False  # no new data yet: nothing to train

    # training goes on while the experiment runs, but the new version is held, not published
    traffic(server, range(4, 6), 4)
    assert svc.tick() is True
    assert svc.status.version == 3 and svc.status.experiment == "fam-v2" and svc.status.state == "ab"
    exp = admin(server, "GET", "/admin/experiments/fam-v2").json()
    assert exp["config"]["max_samples"] == 256 and exp["config"]["metric"] == "verifier:basic_arithmetic"
    assert sum(a["n"] for a in exp["arms"]) == 8  # the verifier's outcome rewards of the arms' runs, on their trajectories
    assert not (data / "adapters" / "fam" / "v3").exists()
    history = [json.loads(x) for x in (learner_dir(data, "fam") / "history.jsonl").read_text().splitlines()]
    assert history[-1]["version"] == 3 and history[-1]["gate"]["decision"] == "held"
    # the learner's own runs (re-rollouts, siblings, data engines) sample the held weights, never the experiment's arms:
    # an unaliased fam@3, which the release below then uses as it is
    assert svc.steps.rollout_model(svc.state.get_trainer()) == "fam@3"
    assert json.loads((data / "adapters" / "fam" / "v3" / "manifest.json").read_text())["held"] is True
    assert admin(server, "GET", "/admin/adapters").json()["aliases"] == {"fam": "fam@1"}
    # once the experiment has decided (here: stopped by hand), the held version is published, gated and put up against the champion
    assert admin(server, "POST", "/admin/experiments/fam-v2/stop", json={}).status_code == 200
    assert svc.tick() is True
    assert (data / "adapters" / "fam" / "v3").is_dir() and svc.status.experiment == "fam-v3"
    history = [json.loads(x) for x in (learner_dir(data, "fam") / "history.jsonl").read_text().splitlines()]
    assert history[-1]["held"] is True and history[-1]["gate"]["decision"] == "passed" and history[-1]["metrics"] == {}

    status = admin(server, "GET", "/admin/learner").json()
    [fam] = [s for s in status["data"] if s["family"] == "fam"]
    assert fam["version"] == 3 and fam["state"] == "ab" and len(fam["history"]) == 4
    # the last step's metrics are on the server's /metrics, per family
    prom = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert 'loopwise_learner_version{family="fam"} 3.0' in prom and 'loopwise_learner_updates_total{family="fam"} 3.0' in prom
    for name in ("loss", "kl", "clip_fraction", "reward_mean", "reward_std", "frac_reward_zero_std", "entropy", "tokens_per_second"):
        assert f'loopwise_learner_{name}{{family="fam"}}' in prom, name
    assert admin(server, "POST", "/admin/learner/update", json={"family": "fam"}).status_code == 202
    assert (learner_dir(data, "fam") / REQUEST_FILE).exists()
    assert admin(server, "POST", "/admin/learner/update", json={"family": "nope"}).status_code == 404
    # a promotion makes the winner the learner's champion (not the experiment's starting champion)
    assert admin(server, "POST", "/admin/experiments/fam-v3/promote", json={"arm": "fam@3"}).status_code == 200
    assert svc.release.experiment_running("fam-v3") is False
    assert svc.status.champion == "fam@3" and svc.status.experiment is None


def test_the_gate_runs_while_the_parity_probe_decodes_and_a_refused_version_abandons_it(server, tiny_model_path, monkeypatch):
    import threading

    import learner.release as release_mod

    cfg = ServiceConfig(
        data_dir=server.data_dir,
        admin_url=server.base_url,
        admin_key=ADMIN,
        base_model=tiny_model_path,
        settings=settings().model_copy(update={"family": "ovl"}),
        agent="learn-agent",
        min_new_trajectories=8,
        gate_n=3,
        gate_tolerance=1.0,
        poll_s=0.1,
    )
    svc = LearnerService(cfg)
    gate_started, abandons = threading.Event(), []
    real_gate, real_parity = svc.release.gate, svc.release.parity

    def gate(new, champion, abandon=None):
        abandons.append(abandon)
        gate_started.set()
        return real_gate(new, champion, abandon)

    def parity(trainer, model, *a, **kw):
        # run one after the other (the probe first), the gate would not have begun: this wait would time out
        assert gate_started.wait(60), "the gate did not start while the parity probe ran"
        return real_parity(trainer, model, *a, **kw)

    monkeypatch.setattr(svc.release, "gate", gate)
    monkeypatch.setattr(svc.release, "parity", parity)
    traffic(server, range(6, 8), 4, model=svc.state.base_model_name())  # whatever the agent's own family serves
    assert svc.tick() is True
    [record] = [json.loads(x) for x in (learner_dir(server.data_dir, "ovl") / "history.jsonl").read_text().splitlines()]
    gate_record = record["gate"]
    assert gate_record["decision"] == "passed" and gate_record["parity"]["tokens"] > 0 and gate_record["champion_runs"] == "run"
    assert gate_record["new"] == "ovl@1" and svc.status.champion == "ovl@1" and not abandons[0].is_set()

    # a version the probe refuses: its gate is abandoned (runs not yet sent are not sent), nothing of it is kept or served
    gate_started.clear()
    monkeypatch.setattr(release_mod, "refusal", lambda report, threshold: "parity: refused by this test")
    traffic(server, range(8, 10), 4, model="ovl")
    assert svc.tick() is True
    gate_record = [json.loads(x) for x in (learner_dir(server.data_dir, "ovl") / "history.jsonl").read_text().splitlines()][-1]["gate"]
    assert gate_record["decision"] == "refused" and gate_record["reason"].startswith("parity:"), gate_record
    assert abandons[1].is_set() and svc.release._gate_key("ovl@2") not in svc.release._gate_cache
    assert "ovl@2" not in {a["name"] for a in admin(server, "GET", "/admin/adapters").json()["data"]}
    assert svc.status.champion == "ovl@1" and svc.state.restart is True


def test_zero_variance_data_skips_the_step_and_keeps_the_version(server, tiny_model_path, tmp_path):
    cfg = ServiceConfig(
        data_dir=server.data_dir,
        admin_url=server.base_url,
        admin_key=ADMIN,
        base_model=tiny_model_path,
        settings=LearnerSettings.model_validate({**settings().model_dump(), "family": "flat"}),
        agent="nobody",  # no runs of this agent: nothing to learn from
        gate_n=0,
    )
    svc = LearnerService(cfg)
    record = svc.update()
    assert record["metrics"]["optimizer_step"] is False and record["version"] == 0  # no step, no new weights, no new version
    assert record["gate"]["decision"] == "skipped"
    assert "flat" not in admin(server, "GET", "/admin/adapters").json()["aliases"]
    again = svc.update()  # the cursor moved on (the checkpoint of version 0 was re-saved), the version did not
    assert again["version"] == 0 and svc.state.get_trainer().cursor.get("update_versions", []) == []
    assert svc.scheduler.staleness_floor(svc.state.get_trainer()) == 0  # the base model's runs are not stale for nothing


def test_learner_cli_refuses_without_an_admin_key(tiny_model_path, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "learner", "run", "--base-model", str(tiny_model_path), "--data-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2 and "admin key" in proc.stderr
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "LOOPWISE_ADMIN_KEY": "k"}
    cmd = [sys.executable, "-m", "learner", "run", "--base-model", str(tiny_model_path), "--data-dir", str(tmp_path)]
    proc = subprocess.run([*cmd, "--ab-min-samples", "64", "--ab-max-samples", "10"], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "--ab-max-samples" in proc.stderr


def test_serve_starts_the_learner_and_keeps_the_admin_api_closed_to_others(start_server, tmp_path_factory):
    import time

    data = tmp_path_factory.mktemp("with-learner")
    server = start_server("--learner", "--learner-min-trajectories", "1000", data_dir=data)
    status_file = learner_dir(data, "calc-lora") / "status.json"
    deadline = time.monotonic() + 180
    while not status_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # written whole (os.replace): no half-read file
    status = json.loads(status_file.read_text())
    assert status["family"] == "calc-lora" and status["state"] == "waiting"  # it reached the admin API and the store
    assert status["traffic"]["agents"] == ["calc-agent"] and status["traffic"]["chat"] is False
    # next to the agent's learner, serve.py starts the chat learner: plain chat traffic, one-off prompts against a baseline
    chat_file = learner_dir(data, "chat-lora") / "status.json"
    while not chat_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    chat = json.loads(chat_file.read_text())
    assert chat["traffic"] == {"chat": True, "agents": [], "models": None, "tags": None} and chat["state"] == "waiting"
    # before its first version, a learner's family is served by the base model (clients can ask for it from the start)
    assert "chat-lora" in {m["id"] for m in httpx.get(server.url + "/models", timeout=30).json()["data"]}
    r = httpx.post(
        server.url + "/chat/completions", json={"model": "chat-lora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200 and r.json()["loopwise"]["adapter"] is None
    # no --admin-key: the learner holds an internal key; to anyone else the admin API is disabled
    r = httpx.get(server.base_url + "/admin/stats", headers={"Authorization": "Bearer guess"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
    server.stop()
    deadline = time.monotonic() + 30
    while {json.loads(f.read_text())["state"] for f in (status_file, chat_file)} != {"stopped"} and time.monotonic() < deadline:
        time.sleep(0.5)
    assert json.loads(status_file.read_text())["state"] == "stopped"  # the learner stops with the server
    assert json.loads(chat_file.read_text())["state"] == "stopped"


MULTI_AGENT = {
    "name": "multi-agent",
    "temperature": 1.0,
    "stop_policy": "fixed",
    "max_turns": 3,
    "max_tokens_per_turn": 6,
    "task": "basic_arithmetic",
    "adapter_family": "rt",
}


def multi_traffic(server, problems: range, samples: int) -> list[str]:
    """Three-turn runs (fixed stop policy), alternating feedback per problem so groups have variance."""
    if "multi-agent" not in {a["name"] for a in admin(server, "GET", "/admin/agents").json()["data"]}:
        assert admin(server, "POST", "/admin/agents", json=MULTI_AGENT).status_code == 201
    ids = []
    for p in problems:
        for k in range(samples):
            body = {"task": "basic_arithmetic", "problem_index": p, "seed": 0, "sample_seed": k}
            r = httpx.post(server.url + "/agents/multi-agent/runs", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["turns"] == 3
            ids.append(r.json()["trajectory_id"])
            httpx.post(server.url + "/feedback", json={"trajectory_id": ids[-1], "reward": float(k % 2)}, timeout=60).raise_for_status()
    return ids


def rr_service(server, tiny_model_path, family: str, estimator: str, rerollouts: dict) -> LearnerService:
    s = settings().model_dump()
    s.update(family=family, rerollouts=rerollouts)
    s["samples"]["reward_sources"] = ["feedback", "verifier:*"]  # backbones: feedback; the branches: the verifier only
    s["trainer"]["estimator"] = estimator
    cfg = ServiceConfig(
        data_dir=server.data_dir,
        admin_url=server.base_url,
        admin_key=ADMIN,
        base_model=tiny_model_path,
        settings=LearnerSettings.model_validate(s),
        agent="multi-agent",
        gate_n=0,
    )
    return LearnerService(cfg)


def trajectory_feedback(traj) -> float:
    return next(r.value for r in traj.rewards if r.target == "trajectory" and r.source == "feedback")


def test_rtpo_sweeps_turns_in_reverse_with_siblings_from_the_exact_stored_contexts(server, tiny_model_path, monkeypatch):
    from learner.records.store import SqliteStore
    from learner.rerollout import BranchRunner
    from learner.trainer import LoRATrainer

    store = SqliteStore(server.data_dir / "interactions.db")
    backbones = multi_traffic(server, range(2), 4)
    # The tiny model is random: its verifier scores every run 0, so scored by the verifier alone no sibling set ever had
    # reward variance (every sibling advantage was 0). The branches are rated here as the backbones are, by feedback: a
    # backbone with reward r gets its refreshed continuation rated r and its siblings 1 - r, so every sibling set differs
    real_run = BranchRunner.run

    def run_and_rate(self, points, *, n, model, kind, **kw):
        runs = real_run(self, points, n=n, model=model, kind=kind, **kw)
        for r in runs:
            if r.trajectory is not None:
                r_backbone = trajectory_feedback(r.point.trajectory)
                value = r_backbone if kind == "rtpo_refresh" else 1.0 - r_backbone
                body = {"trajectory_id": r.trajectory.trajectory_id, "reward": value}
                assert admin(server, "POST", "/admin/feedback", json=body).status_code == 200
                deadline = time.monotonic() + 30
                traj = store.get_trajectory(body["trajectory_id"])
                while not any(x.source == "feedback" for x in traj.rewards):
                    assert time.monotonic() < deadline, "the feedback was not stored"
                    time.sleep(0.05)
                    traj = store.get_trajectory(body["trajectory_id"])
                assert trajectory_feedback(traj) == value
                r.trajectory = traj  # the sweep reads the branch with its rating
        return runs

    trained: list[tuple[object, float]] = []  # (sample, advantage) as each trainer step got them
    real_step = LoRATrainer.step

    def step(self, samples, advantages, **kw):
        trained.extend(zip(samples, list(advantages), strict=True))
        return real_step(self, samples, advantages, **kw)

    monkeypatch.setattr(BranchRunner, "run", run_and_rate)
    monkeypatch.setattr(LoRATrainer, "step", step)
    svc = rr_service(server, tiny_model_path, "rt", "rtpo", {"branches": 1, "siblings": 2, "refresh": True})
    record = svc.update()
    rr = record["rerollouts"]
    assert rr["backbones"] == 8 and rr["branch_points"] == 8 and rr["sibling_runs"] == 16 and rr["failed"] == 0
    # buckets latest first; the turn-0 bucket has no branch point, so it trains in turn 1's step
    assert [b["turns"] for b in rr["steps"]] == [[2], [0, 1]]
    assert rr["siblings"] == 16 and sum(b["siblings"] for b in rr["steps"]) == 16
    # RTPO's sibling advantage, by hand: over the sibling set at one exact context, A = (G - mean G) / (std G + eps), G the
    # return of the whole continuation (outcome rewards only, gamma 1: its trajectory's reward), std the sample std, eps 1e-6.
    # Each set here is the backbone's turn (continued by its refresh, or by its own run at its last turn) with G = r and two
    # siblings with G = 1 - r: {0, 1, 1} or {1, 0, 0}, mean 2/3 or 1/3, std sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3), so
    # r = 0: A(backbone) = -(2/3) / sd, A(sibling) = (1/3) / sd;  r = 1: A(backbone) = (2/3) / sd, A(sibling) = -(1/3) / sd
    sd = math.sqrt(1 / 3) + 1e-6
    sets: dict[str, list[tuple[str, float]]] = {}
    for sample, adv in trained:
        if "|branch:" not in sample.group_id:
            continue  # an un-branched backbone turn: trajectory GRPO
        bb_id, t = sample.group_id.rsplit("|branch:", 1)[1].rsplit(":", 1)
        bb = store.get_trajectory(bb_id)
        assert sample.turn_index == int(t) and sample.context_ids == bb.turns[int(t)].context_ids
        r = trajectory_feedback(bb)
        if sample.turn_id == bb.turns[int(t)].turn_id:
            role, want = "backbone", (2 / 3 if r == 1.0 else -2 / 3) / sd
        else:
            role, want = "sibling", (-1 / 3 if r == 1.0 else 1 / 3) / sd
        assert adv == pytest.approx(want, rel=1e-6), (role, r, adv)
        sets.setdefault(sample.group_id, []).append((role, adv))
    assert len(sets) == rr["branch_points"] == 8  # every branch point trained its sibling set, each advantage non-zero
    assert all(sorted(role for role, _ in v) == ["backbone", "sibling", "sibling"] for v in sets.values())
    rows = store.list_trajectories(limit=1000)
    branches = [t for t in rows if t["meta"].get("rerollout") == "rtpo"]
    refreshes = [t for t in rows if t["meta"].get("rerollout") == "rtpo_refresh"]
    assert len(branches) == 16
    n_turn1 = sum(1 for r in branches if r["meta"]["branch_turn"] == 1) // 2
    assert len(refreshes) == rr["refresh_runs"] == n_turn1  # turn-1 branch points: the backbone's own turns 2.. re-rolled
    for row in branches + refreshes:
        branch = store.get_trajectory(row["trajectory_id"])
        backbone = store.get_trajectory(branch.meta["branch_of"])
        t = branch.meta["branch_turn"]
        assert backbone.trajectory_id in backbones and t in (1, 2)
        assert branch.turns[0].index == t and branch.turns[0].context_ids == backbone.turns[t].context_ids  # byte-identical
        assert branch.turns[0].parent_turn_id == backbone.turns[t - 1].turn_id
        assert len(branch.turns) == 3 - t  # rolled to the end of the run
    # the sweep's intermediate versions served only its re-rollouts: unloaded again; later siblings used them
    loaded = {a["name"] for a in admin(server, "GET", "/admin/adapters").json()["data"]}
    assert not loaded & set(rr["refreshed"])
    # turn 2's step trains (the un-branched backbones' turn 2 has feedback variance), so turn 1's siblings and the
    # refreshed continuations were sampled by the just-updated policy
    assert rr["steps"][0]["optimizer_step"] and len(rr["refreshed"]) == 1
    later = {store.get_trajectory(r["trajectory_id"]).turns[0].adapter for r in branches + refreshes if r["meta"]["branch_turn"] in (1, 2)}
    later_sibs = {store.get_trajectory(r["trajectory_id"]).turns[0].adapter for r in branches if r["meta"]["branch_turn"] == 1}
    assert later_sibs == {rr["refreshed"][0]} and rr["refreshed"][0] in later
    assert record["gate"]["decision"] in ("passed", "skipped")
    # the live stream never takes the branches again
    from learner.samples import Cursor, collect_samples

    batch = collect_samples(store, family="rt", current_version=9, cursor=Cursor(), cfg=svc.cfg.settings.samples)
    assert batch.counts.rerollout >= sum(3 - r["meta"]["branch_turn"] for r in branches + refreshes)
    assert not any(s.meta.get("rerollout") for s in batch.samples)


def test_rtpo_without_refresh_samples_no_refresh_runs(server, tiny_model_path):
    """refresh = false: siblings only, the backbones keep their recorded continuations (it used to sample refresh runs)."""
    multi_traffic(server, range(30, 32), 4)
    svc = rr_service(server, tiny_model_path, "rn", "rtpo", {"branches": 1, "siblings": 2, "refresh": False})
    rr = svc.update(publish=False)["rerollouts"]  # publishes nothing: the module's server has room for 8 adapters
    assert rr["branch_points"] >= 1 and rr["sibling_runs"] == 2 * rr["branch_points"]
    assert rr["refresh_runs"] == 0 and rr["refreshed"] == [] and rr["refresh_failed_points"] == 0


RTPO_RR = {"branches": 1, "siblings": 2, "refresh": True}


def test_a_learner_killed_between_an_intermediate_checkpoint_and_its_publish_resumes_the_sweep(server, tiny_model_path, monkeypatch):
    # An RTPO sweep checkpoints its step 1 (version 1) before publishing it as rk@1 for step 2's siblings. Killed in
    # between, the restarted learner publishes rk@1 from that checkpoint and goes on with step 2: version 2. It used to
    # redo the whole sweep on version 1's weights: step 1 applied a second time, version 3, step 2's siblings from rk@2.
    import learner.release as release
    from learner.records.store import SqliteStore

    multi_traffic(server, range(20, 22), 4)
    real = release.checkpoint_and_publish
    killed: list[Path] = []

    def checkpoint_then_die(trainer, ckpt_root, *args, **kw):
        if killed:
            return real(trainer, ckpt_root, *args, **kw)
        killed.append(trainer.save_checkpoint(ckpt_root))
        raise SystemExit("killed")

    monkeypatch.setattr(release, "checkpoint_and_publish", checkpoint_then_die)
    svc = rr_service(server, tiny_model_path, "rk", "rtpo", RTPO_RR)
    with pytest.raises(SystemExit):
        svc.update()
    data = server.data_dir
    assert not (data / "adapters" / "rk" / "v1").exists()
    sweep = json.loads((killed[0] / "state.json").read_text())["cursor"]["rtpo_sweep"]
    assert sweep["version"] == 1 and sweep["start_version"] == 0 and sweep["done"] == 1 and sweep["segments"] == [[2], [0, 1]]
    resumed = rr_service(server, tiny_model_path, "rk", "rtpo", RTPO_RR)
    record = resumed.update()
    info = record["rerollouts"]
    assert record["version"] == 2 and info["resumed"] == {"step": 2, "of": 2, "version": 1, "start_version": 0}
    assert [s["turns"] for s in info["steps"]] == [[2], [0, 1]] and info["refreshed"] == ["rk@1"]
    assert (data / "adapters" / "rk" / "v1").is_dir() and (data / "adapters" / "rk" / "v2").is_dir()
    assert not (data / "adapters" / "rk" / "v3").exists()
    # step 2's re-rollouts (the only ones sampled by a version of rk) came from the checkpoint's weights, published on resume
    store = SqliteStore(data / "interactions.db")
    rows = [r for r in store.list_trajectories(limit=2000) if r["meta"].get("rerollout") in ("rtpo", "rtpo_refresh")]
    adapters = {store.get_trajectory(r["trajectory_id"]).turns[0].adapter for r in rows}
    assert {a for a in adapters if a and a.startswith("rk@")} == {"rk@1"}


def test_a_learner_that_dies_in_a_later_sweep_step_never_applies_the_earlier_steps_twice(server, tiny_model_path, monkeypatch):
    # Killed in step 2's trainer step (step 1 checkpointed as version 1 and published as rs@1, step 2's siblings sampled
    # by it), the restarted learner resumes the sweep at step 2 on the same batch and plan: its trainer steps turns 0-1
    # once, and turn 2's step, already in version 1, is not applied again. It used to redo the sweep on version 1's
    # weights (a new plan, turn 2 trained a second time, three versions for a two-step sweep).
    from learner.trainer import LoRATrainer

    multi_traffic(server, range(40, 42), 4)
    calls: list[tuple[str, list[int]]] = []  # (which process, the turn indices one trainer step trained)
    process = ["first"]
    real = LoRATrainer.step

    def step(self, samples, advantages, **kw):
        calls.append((process[0], sorted({s.turn_index for s in samples})))
        if process[0] == "first" and len(calls) == 2:
            raise RuntimeError("the learner process died here")
        return real(self, samples, advantages, **kw)

    monkeypatch.setattr(LoRATrainer, "step", step)
    svc = rr_service(server, tiny_model_path, "rs", "rtpo", RTPO_RR)
    with pytest.raises(RuntimeError, match="died here"):
        svc.update(publish=False)  # publishes nothing final: the module's server has room for 8 adapters
    assert calls == [("first", [2]), ("first", [0, 1])]
    one_step = svc.state.trainer.optimizer_steps  # step 1's optimizer steps (its epochs)
    assert svc.state.trainer.version == 1 and one_step > 0

    process[0] = "resumed"
    resumed = rr_service(server, tiny_model_path, "rs", "rtpo", RTPO_RR)  # a new process on the same data folder
    record = resumed.update(publish=False)
    assert calls[2:] == [("resumed", [0, 1])]  # steps 2..2 only
    trainer = resumed.state.trainer
    assert record["version"] == trainer.version == 2 and trainer.optimizer_steps == 2 * one_step
    info = record["rerollouts"]
    where = {"step": 2, "of": 2, "version": 1, "start_version": 0}
    assert info["resumed"] == where and [s["turns"] for s in info["steps"]] == [[2], [0, 1]] and info["refreshed"] == ["rs@1"]
    status = json.loads((learner_dir(server.data_dir, "rs") / "status.json").read_text())
    assert {k: status["resumed"][k] for k in where} == where
    # the update's own checkpoint carries no sweep any more; rs@1 served the sweep's re-rollouts only
    ckpt = learner_dir(server.data_dir, "rs") / "checkpoints" / "ckpt-00000002" / "state.json"
    assert "rtpo_sweep" not in json.loads(ckpt.read_text())["cursor"]
    assert "rs@1" not in {a["name"] for a in admin(server, "GET", "/admin/adapters").json()["data"]}


def test_tcpo_scores_one_step_counterfactuals_of_high_surprisal_turns(server, tiny_model_path, monkeypatch):
    import learner.rollout_steps as rollout_steps

    seen: list = []
    real = rollout_steps.counterfactual_scores
    monkeypatch.setattr(rollout_steps, "counterfactual_scores", lambda runs: (seen.extend(runs), real(runs))[1])
    multi_traffic(server, range(10, 11), 4)
    svc = rr_service(server, tiny_model_path, "tc", "tcpo", {"cf_top_q": 0.25, "cf_samples": 2})
    record = svc.update()
    info = record["rerollouts"]
    assert info["selected_turns"] >= 1 and info["counterfactual_runs"] == 2 * info["branch_points"] and info["failed"] == 0
    # the backbones' turns have no per-turn score (feedback only) and the one-step alternatives are scored by their
    # runs' reward: comparable only at a backbone's last turn (turn 2 of these 3-turn runs), dropped elsewhere
    last = {(r.point.trajectory.trajectory_id, r.point.turn) for r in seen if r.point.turn == len(r.point.trajectory.turns) - 1}
    assert len(seen) == info["counterfactual_runs"] and info["scored_turns"] == len(last)
    assert record["metrics"]["optimizer_step"] is True and record["metrics"]["trained_samples"] >= 12  # 4 runs x 3 turns, + others' runs


def test_a_learner_dies_with_the_server_that_started_it(tmp_path):
    """die_with_parent: a parent killed with SIGKILL (no cleanup) takes its learner process with it."""
    child = (
        "import os, signal, time\nfrom learner.service import die_with_parent\n"
        "assert die_with_parent(int(os.environ['P']), signal.SIGKILL)\nprint('armed', flush=True)\ntime.sleep(120)"
    )
    parent = (
        "import os, subprocess, sys\n"
        f"c = subprocess.Popen([sys.executable, '-c', {child!r}], env={{**os.environ, 'P': str(os.getpid())}}, stdout=subprocess.PIPE, text=True)\n"
        "assert c.stdout.readline().strip() == 'armed'\n"
        "print(c.pid, flush=True)\n"
        "import time; time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.time() + 10
    while time.time() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in state  # a zombie has exited; only its parent (now init) has not reaped it yet


def test_staleness_counts_updates_held_during_an_experiment(tmp_path, tiny_model_path):
    # versions 3..6 were trained while an A/B experiment ran (held, not published): the policy moved four updates
    # past fam@2 all the same, so with max_staleness 2 the freshest allowed data is from version 4 on (counting only
    # published versions, the bound never moved while the experiment ran)
    from types import SimpleNamespace

    for v in (1, 2):
        (tmp_path / "adapters" / "fam" / f"v{v}").mkdir(parents=True)
        (tmp_path / "adapters" / "fam" / f"v{v}" / "manifest.json").write_text("{}")
    cfg = ServiceConfig(data_dir=tmp_path, admin_url="http://127.0.0.1:9", admin_key="k", base_model=tiny_model_path, settings=stale_after(2))
    svc = LearnerService(cfg)
    trainer = SimpleNamespace(version=6, cursor={"since": 1.0, "update_versions": [3, 4, 5, 6]})
    assert svc.scheduler.staleness_floor(trainer) == 4
    # an RTPO sweep's intermediate versions are not updates: 10 and 13 ended updates, 11 and 12 were mid-sweep
    trainer = SimpleNamespace(version=13, cursor={"update_versions": [7, 10, 13]})
    assert svc.scheduler.staleness_floor(trainer) == 7
    # a checkpoint from before update_versions: one version per update
    assert svc.scheduler.staleness_floor(SimpleNamespace(version=6, cursor={"since": 1.0})) == 4
    svc.store.close()


def test_a_restart_from_the_champion_makes_the_traffic_it_serves_fresh_again(tmp_path, tiny_model_path):
    # fam@8 is the champion; the trainer went on to v9, v10, v11 (held during an experiment), and v11 was then refused.
    # Users are served by fam@8 only, so with max_staleness 2 (floor: version 9) every new trajectory was stale and
    # the learner waited forever (seen in the 45-minute demo). Restarting from fam@8 makes its line the trainer's:
    # the floor counts from 8 again, and moves on with the updates trained from it.
    from types import SimpleNamespace

    from safetensors.torch import save_file

    folder = tmp_path / "adapters" / "fam" / "v8"
    folder.mkdir(parents=True)
    save_file({"w": torch.zeros(1)}, str(folder / "adapter_model.safetensors"))
    (folder / "manifest.json").write_text("{}")
    cfg = ServiceConfig(data_dir=tmp_path, admin_url="http://127.0.0.1:9", admin_key="k", base_model=tiny_model_path, settings=stale_after(2))
    svc = LearnerService(cfg)
    svc.state.champion = lambda: "fam@8"  # type: ignore[method-assign]
    loaded: list[object] = []
    trainer = SimpleNamespace(version=11, cursor={"since": 1.0, "update_versions": [9, 10, 11]}, restart_from=loaded.append)
    assert svc.scheduler.staleness_floor(trainer) == 9  # fam@8's traffic is stale
    (svc.dir / "restart.request").touch()
    svc.release.restart_from_champion(trainer)
    assert len(loaded) == 1 and torch.equal(loaded[0]["w"], torch.zeros(1))  # the champion's weights
    assert trainer.cursor["update_versions"] == [8] and trainer.cursor["since"] == 1.0
    assert svc.scheduler.staleness_floor(trainer) == 8  # fresh again
    assert (svc.dir / "restart.request").exists()  # until the next checkpoint: a learner killed now restarts again
    for v, floor in ((12, 8), (13, 8), (14, 12)):  # updates from fam@8's weights: the bound moves as usual
        trainer.cursor["update_versions"] = [*trainer.cursor["update_versions"], v][-3:]
        assert svc.scheduler.staleness_floor(trainer) == floor, v
    # the champion's earlier updates still in the list stay its line; the rejected ones after it leave
    trainer = SimpleNamespace(version=11, cursor={"update_versions": [5, 8, 11]}, restart_from=loaded.append)
    svc.release.restart_from_champion(trainer)
    assert trainer.cursor["update_versions"] == [5, 8] and svc.scheduler.staleness_floor(trainer) == 5
    # no champion yet: back to the base model, version 0
    svc.state.champion = lambda: None  # type: ignore[method-assign]
    trainer = SimpleNamespace(version=4, cursor={"update_versions": [2, 3, 4]}, restart_from=loaded.append)
    svc.release.restart_from_champion(trainer)
    assert loaded[-1] is None and trainer.cursor["update_versions"] == [0] and svc.scheduler.staleness_floor(trainer) == 0
    svc.store.close()


def test_waiting_on_stale_traffic_names_the_experiment_that_holds_serving(tmp_path, tiny_model_path):
    # an experiment serves fam@1 and fam@2 while the trainer went on to v5: every new trajectory is stale, and the
    # status must say so and name what the learner waits for (not "no settled samples yet")
    from learner.reasons import unused_reasons

    cfg = ServiceConfig(data_dir=tmp_path, admin_url="http://127.0.0.1:9", admin_key="k", base_model=tiny_model_path, settings=settings())
    svc = LearnerService(cfg)
    why = unused_reasons({"stale": 12}, [], [])
    assert svc._nothing_to_train(why) == f"nothing to train on: {why['top']}"
    assert why["top"].startswith("stale")
    svc.status.experiment = "fam-v2"
    assert svc._nothing_to_train(why) == f"nothing to train on: {why['top']}; experiment fam-v2 serves its arms until it decides"
    held = "; experiment fam-v2 serves its arms until it decides"
    assert svc._nothing_to_train(unused_reasons({}, [], [])) == "nothing to train on: no rewarded trajectories" + held
    svc.store.close()


def test_reroll_estimators_are_refused_where_they_cannot_work(server, tiny_model_path, tmp_path):
    from learner.service import LearnerConfigError

    # an agent without a task: nothing to replay, no verifier to score counterfactuals with
    if "no-task-agent" not in {a["name"] for a in admin(server, "GET", "/admin/agents").json()["data"]}:
        assert admin(server, "POST", "/admin/agents", json={"name": "no-task-agent", "adapter_family": "nt"}).status_code == 201
    for estimator in ("tcpo", "rtpo"):
        s = settings().model_dump()
        s.update(family="nt")
        s["trainer"]["estimator"] = estimator
        cfg = ServiceConfig(
            data_dir=server.data_dir,
            admin_url=server.base_url,
            admin_key=ADMIN,
            base_model=tiny_model_path,
            settings=LearnerSettings.model_validate(s),
            agent="no-task-agent",
            gate_n=0,
        )
        svc = LearnerService(cfg)
        with pytest.raises(LearnerConfigError, match="has no task"):
            svc.update()
        assert svc.state.trainer is None  # refused before any model was loaded
        # without re-rollouts TCPO trains on whatever rewards exist (outcome fallback): accepted
        s["rerollouts"] = {"enabled": False}
        LearnerService(replace(cfg, settings=LearnerSettings.model_validate(s))).check_setup()
    # on the command line, before anything is loaded: re-rollouts without an agent
    conf = tmp_path / "tcpo.toml"
    conf.write_text('[trainer]\nestimator = "tcpo"\n')
    cmd = [
        sys.executable,
        "-m",
        "learner",
        "run",
        "--base-model",
        str(tiny_model_path),
        "--data-dir",
        str(tmp_path),
        "--agent",
        "",
        "--config",
        str(conf),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "LOOPWISE_ADMIN_KEY": "k"}
    )
    assert proc.returncode == 2 and "needs --agent" in proc.stderr


def test_leap_runs_its_data_engine_before_each_update(tmp_path, tiny_model_path, monkeypatch):
    # [leap] enabled: each update first probes the next problems, prunes them with DCP and expands the rest
    # (learner.leap_expand, tested against a scripted server in test_leap_expand.py); the problem cursor advances
    from types import SimpleNamespace

    import learner.leap_expand as le

    calls = []

    def fake_expand(url, key, agent, problems, G, max_turns, **kw):
        calls.append((agent, problems, G, max_turns, kw["sample_seed"], kw["model"]))
        report = {"n_probed": len(problems), "fraction_pruned": 0.5, "expanded": ["p1"], "compile_calls": {}, "elapsed_s": 0.1}
        return SimpleNamespace(to_dict=lambda: {**report, "dcp": {"pruned": {"p0": {"class": "catastrophic"}}}})

    monkeypatch.setattr(le, "expand", fake_expand)
    s = settings().model_dump()
    s["leap"] = {"enabled": True, "problems_per_update": 3, "group": 2, "max_turns": 4}
    cfg = ServiceConfig(
        data_dir=tmp_path,
        admin_url="http://127.0.0.1:9",
        admin_key="k",
        base_model=tiny_model_path,
        settings=LearnerSettings.model_validate(s),
        agent="kernel-agent",
    )
    svc = LearnerService(cfg)
    # the probes and episodes sample the learner's current policy, never the agent's alias (an experiment's arms)
    monkeypatch.setattr(svc.steps, "rollout_model", lambda trainer: f"kfam@{trainer.version}")
    trainer = SimpleNamespace(version=2, cursor={"leap_next_problem": 6})
    out = svc._data_engines(trainer).leap
    assert out is not None and calls == [("kernel-agent", [6, 7, 8], 2, 4, 2000, "kfam@2")] and out["pruned"] == {"p0": {"class": "catastrophic"}}
    with pytest.raises(Exception, match="needs the learner's agent"):
        LearnerService(replace(cfg, agent=None)).check_setup()
    svc.store.close()


def svr_learner(
    server, tiny_model_path: Path, name: str, family: str, *, max_turns: int, overlap_sampling: bool = False, **cfg: Any
) -> LearnerService:
    """An SVR agent ``name`` registered on the server and a learner of ``family`` making its fixed-horizon runs (2 problems x
    2 runs of 2 turns per update, scored with the SVR turn reward); ``cfg`` goes to its ServiceConfig."""
    agent = {**AGENT, "name": name, "stop_policy": "svr", "stop_params": {"tau": 0.7}, "max_turns": max_turns, "adapter_family": family}
    assert admin(server, "POST", "/admin/agents", json=agent).status_code in (200, 201)
    s = settings().model_dump()
    s.update(
        family=family,
        samples={"settle_s": 0},
        trainer={**s["trainer"], "estimator": "turn_grpo", "estimator_params": {"source": "reward"}},
        svr={"enabled": True, "problems_per_update": 2, "group": 2, "horizon": 2, "format_penalty": 0.5},
        overlap_sampling=overlap_sampling,
    )
    settings_ = LearnerSettings.model_validate(s)
    base = {"data_dir": server.data_dir, "admin_url": server.base_url, "admin_key": ADMIN, "base_model": tiny_model_path}
    return LearnerService(ServiceConfig(**base, settings=settings_, agent=name, **cfg))


def test_svr_learner_makes_fixed_horizon_runs_scores_their_turns_and_gates_the_adaptive_agent(server, tiny_model_path):
    # [svr]: before the update the learner runs problems x group fixed-horizon runs of its SVR agent (their turns stored with
    # their self-checks) and scores every turn with the SVR turn reward; the gate measures the adaptive agent (ordinary runs)
    # with its turns, wrong-stop rate and ECE. The tiny model is random: its 8-token turns never close the format, so every
    # turn is an unparsable wrong answer, r = w_c*0 - format_penalty = -0.5, and the groups have no variance (no step)
    svc = svr_learner(server, tiny_model_path, "svr-learn", "svrfam", max_turns=3, gate_n=2, gate_tolerance=1.0)
    record = svc.update(force=True)
    assert record["svr_runs"]["runs"] == 4 and record["svr_runs"]["failed"] == 0 and record["svr_runs"]["problems"] == [0, 2]
    assert record["self_check_rewards"]["scored"] == 8 and record["metrics"]["samples"] == 8  # 4 runs x 2 turns, none stopped early
    assert record["self_check_rewards"]["reward_mean"] == pytest.approx(-0.5) and record["metrics"]["optimizer_step"] is False
    trajs = [svc.store.get_trajectory(r["trajectory_id"]) for r in svc.store.list_trajectories(limit=50) if r["meta"].get("agent") == "svr-learn"]
    fixed = [t for t in trajs if t.meta.get("horizon") == 2]
    assert len(fixed) == 4 and all(
        len(t.turns) == 2 and all(u.self_check is not None and u.self_check.correct is False for u in t.turns) for t in fixed
    )
    assert svc.state.get_trainer().cursor["svr_next_problem"] == 2  # the next update runs problems 2 and 3
    base = svc.state.base_model_name()
    gate = svc.release.gate(base, None)  # the adaptive agent's held-out runs (no early stop is forced here: ordinary runs)
    assert gate["new_report"]["n"] == 2 and 1 <= gate["new_report"]["mean_turns"] <= 3 and gate["new_report"]["accuracy"] == 0.0
    assert set(gate["new_report"]) >= {"accuracy", "mean_turns", "wrong_stop_rate", "ece", "brier"}
    svc.store.close()


def svr_runs_of(svc: LearnerService, agent: str) -> dict[int, list[Any]]:
    """The agent's fixed-horizon (SVR training) runs in the store, by problem index."""
    out: dict[int, list[Any]] = {}
    for row in svc.store.list_trajectories(limit=500):
        if row["meta"].get("agent") == agent and row["meta"].get("horizon") is not None:
            out.setdefault(int(row["meta"]["problem_index"]), []).append(row)
    return out


def test_overlap_sampling_samples_the_next_updates_runs_during_the_step_once_each(server, tiny_model_path, monkeypatch):
    # overlap_sampling: while update k trains, its next problems' SVR runs are sampled from the policy before the step;
    # update k+1 takes them instead of sampling again. Runs sampled for a start that did not come (the cursor moved
    # elsewhere) are left in the store and the update samples its own problems.
    svc = svr_learner(server, tiny_model_path, "svr-ahead", "ahead", max_turns=2, overlap_sampling=True)
    threads: list[str] = []
    real_runs = svc.steps.svr_runs

    def svr_runs(trainer, **kw):
        threads.append(__import__("threading").current_thread().name)
        return real_runs(trainer, **kw)

    monkeypatch.setattr(svc.steps, "svr_runs", svr_runs)
    first = svc.update(force=True)
    assert first["svr_runs"]["problems"] == [0, 2] and threads == ["MainThread", "ahead-sampling-ahead"]
    second = svc.update(force=True)  # takes problems 2 and 3, sampled during the first update's step
    assert second["svr_runs"]["problems"] == [2, 4] and second["svr_runs"]["runs"] == 4
    assert threads == ["MainThread", "ahead-sampling-ahead", "ahead-sampling-ahead"]  # the main thread sampled once in all
    assert svc.state.get_trainer().cursor["svr_next_problem"] == 4
    runs = svr_runs_of(svc, "svr-ahead")
    assert {p: len(v) for p, v in runs.items()} == {0: 2, 1: 2, 2: 2, 3: 2}  # every problem's group sampled once
    # the tiny model's groups have no variance: no optimizer step, so every run sampled the base model
    assert second["metrics"]["optimizer_step"] is False and second["metrics"]["samples"] == 8
    # a start the runs sampled ahead (problems 4 and 5) were not for: the update samples its own problems
    trainer = svc.state.get_trainer()
    trainer.cursor = {**trainer.cursor, "svr_next_problem": 10}
    third = svc.update(force=True)
    assert third["svr_runs"]["problems"] == [10, 12]
    runs = svr_runs_of(svc, "svr-ahead")
    assert sorted(runs) == [0, 1, 2, 3, 4, 5, 10, 11] and all(len(v) == 2 for v in runs.values())  # the unused runs kept
    ahead = svc._ahead
    assert ahead is not None and ahead.at.positions["svr_next_problem"] == 12
    svc.wait_for_ahead(120)
    assert ahead.done.result()[0].svr_runs["problems"] == [12, 14]
    svc.store.close()


def test_overlap_sampling_needs_room_for_one_stale_version():
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        LearnerSettings.model_validate({"family": "f", "overlap_sampling": True, "samples": {"max_staleness": 0}})


def test_reves_round_runs_its_repair_and_verification_prompts_through_the_runtime(server, tiny_model_path):
    # the tiny model is random: it never solves basic_arithmetic, so each item gets its first attempt and max_retries repair
    # runs (REVES prompts through the runs endpoint), is never recovered and contributes no record; the round's training
    # prompts are then the original problems only
    from learner.config import RevesConfig
    from learner.reves import reves_round

    cfg = RevesConfig(enabled=True, items_per_round=2, max_retries=2, prompts_per_round=2, augmented_share=0.5, group=2, seed=0)
    out = reves_round(server.base_url, ADMIN, "learn-agent", cfg, first_item=0, sample_seed=0, model=None)
    assert (out["items"], out["unrecovered"], out["recovered"], out["failed"]) == ([0, 2], 2, 0, 0)
    assert out["records"] == {"repair": 0, "verify": 0} and out["original_prompts"] == 2 and out["training_runs"] == 4
    runs = admin(server, "GET", "/admin/trajectories?limit=200").json()["data"]
    augmentation = [r for r in runs if r["meta"].get("group") == "reves-augment"]
    assert len(augmentation) == 2 * 3 and all(r["meta"]["eval"] for r in augmentation)  # 1 + 2 attempts per item, never trained on
    repairs = [r for r in augmentation if r["meta"]["task"] == "reves-repair:basic_arithmetic"]
    assert len(repairs) == 4

    # a verification prompt: its reward is whether the boxed verdict matches the verifier on the candidate
    body = {"problem_index": 0, "seed": 0, "max_turns": 1, "reves": {"kind": "verify", "previous": "<answer>-99999</answer>"}}
    r = admin(server, "POST", "/admin/agents/learn-agent/runs", json=body)
    assert r.status_code == 200, r.text
    run = r.json()
    assert run["task"] == "reves-verify:basic_arithmetic" and run["problem_index"] == 0
    traj = admin(server, "GET", f"/admin/trajectories/{run['trajectory_id']}").json()
    [reward] = [w for w in traj["rewards"] if w["target"] == "trajectory"]
    assert reward["source"] == "verifier:reves-verify:basic_arithmetic" and "the candidate is wrong" in reward["comment"]
    assert "Candidate Answer:\n<answer>-99999</answer>" in traj["turns"][0]["messages"][-1]["content"]
    # only the learner and admins build REVES prompts: a client's verifier-scored prompt would be a trusted reward it wrote
    denied = httpx.post(server.url + "/agents/learn-agent/runs", json=body, timeout=60)
    assert denied.status_code == 403 and "reves" in denied.json()["error"]["message"]


def test_reves_runs_each_update_from_the_next_items_with_the_current_policy(tmp_path, tiny_model_path, monkeypatch):
    from types import SimpleNamespace

    import learner.reves as reves_mod

    calls = []

    def fake_round(url, key, agent, cfg, *, first_item, sample_seed, model, concurrency):
        calls.append((agent, first_item, sample_seed, model, cfg.items_per_round))
        return {"items": [first_item, first_item + cfg.items_per_round], "recovered": 1}

    monkeypatch.setattr(reves_mod, "reves_round", fake_round)
    s = settings().model_dump()
    s["reves"] = {"enabled": True, "items_per_round": 3}
    cfg = ServiceConfig(
        data_dir=tmp_path,
        admin_url="http://127.0.0.1:9",
        admin_key="k",
        base_model=tiny_model_path,
        settings=LearnerSettings.model_validate(s),
        agent="a",
    )
    svc = LearnerService(cfg)
    monkeypatch.setattr(svc.steps, "rollout_model", lambda trainer: "fam@4")
    out = svc._data_engines(SimpleNamespace(version=4, cursor={"reves_next_item": 6})).reves
    assert out is not None and calls == [("a", 6, 4000, "fam@4", 3)] and out["items"] == [6, 9]
    with pytest.raises(Exception, match=r"\[reves\] enabled needs the learner's agent"):
        LearnerService(replace(cfg, agent=None)).check_setup()
    svc.store.close()


def completed_update(server: Any, tiny_model_path: Path, family: str, traffic: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """One learner update of ``family`` with group completion by the ``rank_by_position`` hook (G = 3): its record, and
    what each optimizer step got (metrics, report, advantages, samples)."""
    s = settings().model_dump()
    s.update(family=family, traffic=traffic)
    s["samples"]["reward_sources"] = ["hook:*", "feedback"]
    s["singletons"] = {"mode": "complete", "scorer": "hook", "hook": "tests.learner.test_group_completion:rank_by_position", "group_size": 3}
    cfg = ServiceConfig(
        data_dir=server.data_dir,
        admin_url=server.base_url,
        admin_key=ADMIN,
        base_model=tiny_model_path,
        settings=LearnerSettings.model_validate(s),
        gate_n=0,
    )
    svc = LearnerService(cfg)
    steps: list[Any] = []
    train = svc.steps.train

    def spy(*a: Any, **kw: Any) -> Any:
        steps.append(train(*a, **kw))
        return steps[-1]

    svc.steps.train = spy  # type: ignore[method-assign]
    return svc.update(), steps


def test_a_thumbs_up_answer_is_never_trained_down_by_group_completion(server, tiny_model_path):
    """Two one-off chat prompts, a thumbs-down (0) and a thumbs-up (1), and a hook that scores each original lowest of
    its group (0, its 2 siblings 1 and 2). The thumbs-down group agrees with its label and trains: GRPO on [0, 1, 2]
    (mean 1, std 1) gives -1, 0, +1, the original down. The thumbs-up group contradicts its label, so it is skipped and
    counted; that answer keeps the user's own reward under the running baseline (the first reward of its key only seeds
    the baseline: advantage 0), and is never trained down."""
    ids: dict[float, str] = {}
    for p, reward in (("first one-off", 0.0), ("second one-off", 1.0)):
        r = httpx.post(
            server.url + "/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 4}, timeout=60
        )
        ids[reward] = r.json()["loopwise"]["trajectory_id"]
        fb = httpx.post(server.url + "/feedback", json={"turn_id": r.json()["loopwise"]["turn_id"], "reward": reward}, timeout=60)
        assert fb.status_code == 200, fb.text
    record, steps = completed_update(server, tiny_model_path, "gc", {"chat": True, "agents": []})
    gc = record["group_completion"]
    assert (gc["completed_groups"], gc["siblings"], gc["contradicted"], gc["failed"]) == (1, 2, 1, 0)
    assert gc["version_mix"] == {"original base, siblings base": 1}  # no version published yet: the base model made all of them
    [(_, _, advantages, samples)] = steps
    adv: dict[str, list[float]] = {}
    for sample, a in zip(samples, advantages, strict=True):
        adv.setdefault(sample.trajectory_id, []).append(a)
    [up] = [x for x in samples if x.trajectory_id == ids[1.0]]
    assert adv[ids[1.0]] == [0.0] and (up.reward, up.reward_source) == (1.0, "feedback")  # its own label, not the hook's 0
    assert adv[ids[0.0]] == [pytest.approx(-1.0, abs=1e-5)]  # the thumbs-down answer scored lowest: trained down
    siblings = sorted(a for tid, a_s in adv.items() if tid not in ids.values() for a in a_s)
    assert siblings == [pytest.approx(0.0, abs=1e-9), pytest.approx(1.0, abs=1e-5)]
    assert record["metrics"]["optimizer_step"] is True and record["metrics"]["trained_samples"] == 2
    assert record["unused"]["counts"]["at_group_mean"] == 1 and record["unused"]["counts"]["baseline_warmup"] == 1
    assert admin(server, "GET", "/admin/adapters").json()["aliases"]["gc"] == "gc@1"


def chat_service(server, tiny_model_path, family: str, **more) -> LearnerService:
    s = settings().model_dump()
    s.update({"family": family, "traffic": {"chat": True, "agents": []}, **more})
    s["trainer"]["lr"] = 1e-2  # a visible change in one step, so a wrong scale shows
    cfg = ServiceConfig(
        data_dir=server.data_dir,
        admin_url=server.base_url,
        admin_key=ADMIN,
        base_model=tiny_model_path,
        settings=LearnerSettings.model_validate(s),
        gate_n=0,
    )
    return LearnerService(cfg)


def chat_traffic(server, tag: str, n: int = 4) -> None:
    """One prompt answered n times (one group), rewarded 1, 0, 1, 0 by turn_id, tagged for one learner's filter."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"tell me about {tag}"}], "max_tokens": 6, "n": n, "metadata": {"tag": tag}}
    r = httpx.post(server.url + "/chat/completions", json=body, timeout=60)
    for i, c in enumerate(r.json()["loopwise"]["choices"]):
        httpx.post(server.url + "/feedback", json={"turn_id": c["turn_id"], "reward": float(i % 2 == 0)}, timeout=60).raise_for_status()


def test_parity_probe_passes_an_honest_load_and_refuses_a_wrong_lora_scale(server, tiny_model_path, monkeypatch):
    import learner.update as update_mod  # where every trainer publishes

    chat_traffic(server, "parity")
    svc = chat_service(server, tiny_model_path, "par", traffic={"chat": True, "agents": [], "tags": ["parity"]}, parity={"threshold": 0.05})
    record = svc.update()
    parity = record["gate"]["parity"]
    assert record["gate"]["decision"] == "passed" and parity["tokens"] > 0 and parity["mean_abs_logp_diff"] < 0.05
    assert svc.status.last_parity["model"] == "par@1"
    prom = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert f'loopwise_learner_parity_logp_diff{{family="par"}} {parity["mean_abs_logp_diff"]}' in prom

    from tests.learner.test_parity import wrong_scale  # the adapter's config says alpha x 8: the runtime applies 8x the update

    monkeypatch.setattr(update_mod, "publish_adapter", wrong_scale(update_mod.publish_adapter))
    chat_traffic(server, "parity")
    record = svc.update()
    assert record["gate"]["decision"] == "refused" and record["gate"]["reason"].startswith("parity:")
    assert record["gate"]["parity"]["mean_abs_logp_diff"] > 0.05
    assert "par@2" not in {a["name"] for a in admin(server, "GET", "/admin/adapters").json()["data"]}
    assert svc.state.restart is True  # the next update starts from the champion, par@1
    assert LearnerService(svc.cfg).state.restart is True  # also after a learner restart
    assert svc.steps.rollout_model(svc.state.get_trainer()) == "par@1"  # re-rollouts are never sampled from the refused version

    # the next update starts from the champion's (par@1's) weights with a fresh optimizer, not from the refused par@2's
    from safetensors.torch import load_file

    champion = load_file(str(server.data_dir / "adapters" / "par" / "v1" / "adapter_model.safetensors"))
    trainer = svc.state.get_trainer()
    assert any(not torch.equal(trainer.lora_state()[k], champion[k]) for k in champion)  # it had moved on to par@2
    record = svc.update()  # no new traffic: no step, so the weights are exactly where the update started
    assert record["metrics"]["optimizer_step"] is False and svc.status.restarts == 1 and not trainer.optimizer.state
    assert not (svc.dir / "restart.request").exists()
    assert all(torch.equal(trainer.lora_state()[k], champion[k]) for k in champion)

    # an experiment that rolls its challenger back does the same, and drops the version trained on meanwhile
    svc.status.experiment, svc.status.challenger, svc.state.held = "par-v3", "par@3", True
    monkeypatch.setattr(svc.admin, "experiment_status", lambda name: {"status": "rolled_back", "champion": "par@1"})
    assert svc.release.experiment_running("par-v3") is False
    assert svc.state.restart is True and svc.state.held is False and svc.status.champion == "par@1" and "rolled back" in svc.status.detail


def test_two_learners_with_disjoint_filters_each_train_only_their_own_traffic(server, tiny_model_path):
    chat_traffic(server, "support")
    chat_traffic(server, "sales")
    records = {}
    for tag in ("support", "sales"):
        svc = chat_service(server, tiny_model_path, f"{tag}-lora", traffic={"chat": True, "agents": [], "tags": [tag]}, parity={"enabled": False})
        records[tag] = svc.update()
    for tag, record in records.items():  # each: its own group of 4 (rewards 1, 0, 1, 0: all advantages non-zero), the other's counted out
        assert record["metrics"]["trained_samples"] == 4, (tag, record["unused"])
        assert record["unused"]["counts"]["other_traffic"] >= 4
    statuses = {s["family"]: s for s in admin(server, "GET", "/admin/learner").json()["data"]}
    assert statuses["support-lora"]["traffic"]["tags"] == ["support"] and statuses["sales-lora"]["traffic"]["tags"] == ["sales"]


def test_an_update_waits_for_enough_trainable_trajectories_and_keeps_its_cursor(server, tiny_model_path, tmp_path):
    # Adam's step does not shrink with the batch: a scheduled update on a handful of fresh runs (the rest stale while an
    # experiment holds serving) moved the weights as far as a full one. Too few trainable: nothing trained, cursor kept.
    cfg = ServiceConfig(
        data_dir=server.data_dir,
        admin_url=server.base_url,
        admin_key=ADMIN,
        base_model=tiny_model_path,
        # the agent is served fam's champion once an earlier test made one: those runs count here too
        settings=LearnerSettings.model_validate(
            {**settings().model_dump(), "family": "few", "samples": {**settings().samples.model_dump(), "include_other_families": True}}
        ),
        agent="learn-agent",
        min_new_trajectories=8,
        gate_n=0,
    )
    svc = LearnerService(cfg)
    svc.state.get_trainer().cursor = {"since": time.time()}  # only the runs below
    traffic(server, range(100, 101), 4)  # one group of 4
    record = svc.update(force=False, publish=False)
    assert record["metrics"] == {} and record["version"] == 0 and "4 trainable trajectories, fewer than 8" in record["gate"]["reason"]
    assert svc.status.state == "waiting" and svc.status.detail.startswith("4 of 8 trainable trajectories")
    assert svc.scheduler.short is not None and svc.scheduler.short[1] == 4  # four short
    # until four new settled trajectories come, a scheduling round does not re-read the window
    calls: list[dict[str, object]] = []
    real_update = svc.update
    svc.update = lambda **kw: calls.append(kw) or {"metrics": {}}  # type: ignore[method-assign]
    svc.scheduler.short = (svc.scheduler.count_new(), 4)
    assert svc.tick() is False and calls == []
    traffic(server, range(101, 102), 4)
    assert svc.tick() is False and calls == [{"force": False, "publish": True}]  # four new: the round updates
    svc.update = real_update  # type: ignore[method-assign]
    record = svc.update(force=False, publish=False)  # the first four were kept: now eight (held: the module's server holds 8 adapters)
    assert record["metrics"]["optimizer_step"] is True and record["metrics"]["samples"] == 8 and record["version"] == 1
    assert svc.scheduler.short is None


def test_group_completion_completes_a_two_turn_chat_at_its_rated_reply(server, tiny_model_path):
    """The usual chat: a question, the reply, "final answer only", the reply, a thumbs-down (0) on the last reply. Group
    completion samples 2 siblings of that reply from its exact context; the hook scores the original lowest (0, the
    siblings 1 and 2): GRPO on [0, 1, 2] (mean 1, std 1) gives the rated reply -1 and the siblings 0 and +1. The first
    reply is shared by every member, so it is no part of the group: it keeps the user's 0 under the running baseline,
    whose first reward for its key only seeds it (advantage 0)."""
    messages = [{"role": "user", "content": "what is 2+3?"}]
    ids = []
    for follow_up in (None, "the final answer only"):
        if follow_up:
            messages = [*messages, {"role": "user", "content": follow_up}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 4, "metadata": {"tag": "two-turn"}}
        r = httpx.post(server.url + "/chat/completions", json=body, timeout=60).json()
        messages = [*messages, {"role": "assistant", "content": r["choices"][0]["message"]["content"]}]
        ids.append(r["loopwise"])
    assert ids[0]["trajectory_id"] == ids[1]["trajectory_id"]
    fb = httpx.post(server.url + "/feedback", json={"turn_id": ids[1]["turn_id"], "reward": 0.0}, timeout=60)
    assert fb.status_code == 200, fb.text
    traffic = {"chat": True, "agents": [], "tags": ["two-turn"]}  # this test's chat only (the server is the module's)
    record, steps = completed_update(server, tiny_model_path, "gc2", traffic)
    gc = record["group_completion"]
    assert (gc["completed_groups"], gc["siblings"], gc["contradicted"], gc["failed"]) == (1, 2, 0, 0)
    [(_, _, advantages, samples)] = steps
    adv = {x.turn_id: a for x, a in zip(samples, advantages, strict=True)}
    first, rated = ids[0]["turn_id"], ids[1]["turn_id"]
    assert adv[rated] == pytest.approx(-1.0, abs=1e-5) and adv[first] == 0.0
    [prefix] = [x for x in samples if x.turn_id == first]
    assert prefix.group_id.endswith("#before") and (prefix.trajectory_reward, prefix.trajectory_reward_source) == (0.0, "feedback")
    assert sorted(a for t, a in adv.items() if t not in (first, rated)) == [pytest.approx(0.0, abs=1e-9), pytest.approx(1.0, abs=1e-5)]
    assert record["metrics"]["optimizer_step"] is True and record["unused"]["counts"]["baseline_warmup"] == 1
    assert admin(server, "GET", "/admin/adapters").json()["aliases"]["gc2"] == "gc2@1"
