"""MemoPilot learning from use: a run that read the copilot's memory is tagged with the rewrite that wrote it, its
rewards credit that rewrite (``runtime/memory_credit.py``), and a learner job on the copilot's family trains it.

- In process over a scripted engine (real host, copilot, recorder, SQLite, HTTP routes): the tag on the run, a user's
  ``POST /v1/feedback`` and an agent task's verifier (rated during the run, before the tag lands) both reach the
  rewrite as ``memory:<source>``; clients cannot send ``memory:*`` themselves.
- End to end on ``serve.py --model tiny`` with the documented ``--learner-job`` settings: two users' runs read their
  memory, get feedback 1 and 0, and one learner update on the ``memopilot`` family trains the rewrites those runs
  rated, publishes ``memopilot@1``, and the copilot's next rewrite is sampled from it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from agents.host import Host
from learner.config import LearnerSettings, TrafficFilter
from learner.samples import Cursor, collect_samples
from loopwise_settings import LearnerJob
from memory.store import MemoryStore
from runtime.memory_credit import MEMORY_REWRITE, MEMORY_SCOPE, MEMORY_VERSION
from tests.runtime._inproc import InProc, scripted_app
from tools.builtins import default_registry

ROOT = Path(__file__).resolve().parent.parent.parent


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := fn():  # truthy: a condition chained with `and` gives False while it does not hold
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def documented_job() -> dict[str, Any]:
    """The ``--learner-job`` JSON of docs/agents.md ("Learning from use")."""
    text = (ROOT / "docs" / "agents.md").read_text()
    start = text.index("--learner-job '") + len("--learner-job '")
    return json.loads(text[start : text.index("'", start)])


# ---- in process: the tags and both reward paths ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path):
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def serve(tok, tmp_path: Path, memory: dict[str, Any], **agent: Any) -> tuple[InProc, MemoryStore]:
    mem = MemoryStore(tmp_path / "memory.db")
    cfg = {"name": "mem-agent", "stop_policy": "answer", "constrain_format": False, "max_turns": 1, "memory": memory, **agent}
    host = Host([cfg], default_registry(), memory=mem)
    lessons = iter(f"<memory>lesson {k}</memory>" for k in range(1, 100))
    app, _, store = scripted_app(tok, lambda req, *_: next(lessons) if req.request_id.startswith("memopilot-") else "5", tmp_path, agents=host)
    srv = InProc(app)
    srv.store = store  # type: ignore[attr-defined]
    return srv, mem


def derived(store: Any, rewrite_id: str) -> list[tuple[str, float]]:
    traj = store.get_trajectory(rewrite_id)
    return [(r.source, r.value) for r in traj.rewards if r.target == "trajectory"] if traj is not None else []


def test_feedback_on_a_run_that_read_the_memory_rewards_the_rewrite_that_wrote_it(tok, tmp_path):
    srv, mem = serve(tok, tmp_path, {"method": "memopilot", "scope": "user"})
    try:

        def chat(text: str) -> dict[str, Any]:
            r = srv.client.post("/v1/chat/completions", json={"model": "mem-agent", "user": "alice", "messages": [{"role": "user", "content": text}]})
            assert r.status_code == 200, r.text
            return r.json()["loopwise"]

        chat("2+3?")
        v1 = wait_for("memory version 1", lambda: mem.current("public", "user:alice"))
        r1 = v1.provenance.copilot_trajectory_id
        assert v1.version == 1 and v1.text == "lesson 1" and r1
        second = chat("4+1?")  # its prompt held version 1
        run = wait_for("the run's memory tag", lambda: (t := srv.store.get_trajectory(second["trajectory_id"])) and t.meta.get(MEMORY_REWRITE) and t)
        tag = {k: run.meta[k] for k in (MEMORY_SCOPE, MEMORY_VERSION, MEMORY_REWRITE)}
        assert tag == {MEMORY_SCOPE: "user:alice", MEMORY_VERSION: 1, MEMORY_REWRITE: r1}
        assert derived(srv.store, r1) == []  # not rated yet

        fb = srv.client.post("/v1/feedback", json={"turn_id": second["turn_id"], "reward": 0.75})
        assert fb.status_code == 200, fb.text
        assert derived(srv.store, r1) == [("memory:feedback", 0.75)]  # the one run that read version 1: its outcome
        # the rewrite made after the second run wrote version 2, which no run has read: no reward on it
        v2 = wait_for("memory version 2", lambda: (c := mem.current("public", "user:alice")) and c.version == 2 and c)
        assert derived(srv.store, v2.provenance.copilot_trajectory_id) == []
        # a client cannot pose as memory credit
        bad = srv.client.post("/v1/feedback", json={"trajectory_id": r1, "reward": 1.0, "source": "memory:verifier:calc"})
        assert bad.status_code == 403 and bad.json()["error"]["param"] == "source"
        assert derived(srv.store, r1) == [("memory:feedback", 0.75)]
    finally:
        srv.close()


def test_an_agent_tasks_verifier_rates_during_the_run_and_the_tag_credits_it(tok, tmp_path):
    srv, mem = serve(tok, tmp_path, {"method": "memopilot", "scope": "agent"}, task="calc_arith")
    try:

        def task_run(k: int) -> dict[str, Any]:
            r = srv.client.post("/v1/agents/mem-agent/runs", json={"task": "calc_arith", "problem_index": k})
            assert r.status_code == 200, r.text
            return r.json()

        task_run(0)
        r1 = wait_for("memory version 1", lambda: mem.current("public", "agent:mem-agent")).provenance.copilot_trajectory_id
        second = task_run(1)
        assert second["reward"] is not None  # the verifier's outcome, stored before the run was tagged
        source = "memory:verifier:calc_arith"
        got = wait_for("the derived reward", lambda: derived(srv.store, r1) or None)
        assert got == [(source, second["reward"])]
        # the copilot job's sample path takes it (filter and sources of docs/agents.md's job)
        spec = documented_job()
        job = LearnerSettings.model_validate({"family": spec["family"], **spec["settings"]})
        cfg = job.samples.model_copy(update={"settle_s": 0})
        batch = collect_samples(srv.store, family="memopilot", cursor=Cursor(), cfg=cfg, current_version=0, traffic=job.traffic)
        assert [(s.trajectory_id, s.trajectory_reward, s.trajectory_reward_source) for s in batch.samples] == [(r1, second["reward"], source)]
    finally:
        srv.close()


# ---- end to end: serve.py --model tiny, feedback, one learner update on the copilot's family ---------------------

ADMIN = "memory-learner-admin"
PILOT = {"name": "mem-pilot", "stop_policy": "answer", "constrain_format": False, "max_tokens_per_turn": 8, "max_turns": 1,
         "memory": {"method": "memopilot", "scope": "user", "max_tokens": 16, "temperature": 1.0}}  # fmt: skip


def test_a_learner_job_on_the_copilots_family_trains_its_rated_rewrites(start_server, tmp_path_factory, tiny_model_path):
    from learner.service import LearnerService, ServiceConfig

    data = tmp_path_factory.mktemp("memopilot-learning")
    server = start_server("--admin-key", ADMIN, "--max-model-len", "512", "--no-builtin-agents", "--agent", json.dumps(PILOT), data_dir=data)
    admin = {"Authorization": f"Bearer {ADMIN}"}

    def chat(user: str, text: str) -> dict[str, Any]:
        body = {"model": "mem-pilot", "user": user, "messages": [{"role": "user", "content": text}]}
        r = httpx.post(server.url + "/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["loopwise"]

    def trajectory(tid: str) -> dict[str, Any] | None:
        r = httpx.get(f"{server.base_url}/admin/trajectories/{tid}", headers=admin, timeout=60)
        return r.json() if r.status_code == 200 else None

    def memory(user: str) -> dict[str, Any] | None:
        r = httpx.get(f"{server.base_url}/admin/memory/public/user:{user}", headers=admin, timeout=60)
        return r.json() if r.status_code == 200 else None

    def rewrite_after(run: dict[str, Any]) -> dict[str, Any]:
        """The copilot's recorded rewrite after ``run`` (its model call; a version follows when the text parsed)."""

        def find() -> dict[str, Any] | None:
            listed = httpx.get(f"{server.base_url}/admin/trajectories?limit=50", headers=admin, timeout=60).json()["data"]
            rows = [t for t in listed if t["meta"].get("player_trajectory_id") == run["trajectory_id"]]
            return trajectory(rows[0]["trajectory_id"]) if rows else None

        return wait_for("the copilot's rewrite", find, timeout=120)

    rewrites = {}
    for user, reward in (("u1", 1.0), ("u2", 0.0)):
        doc = None
        for attempt in range(6):  # the tiny copilot samples random text: an empty one keeps the (empty) memory
            rewrite_after(chat(user, f"hi {attempt}"))
            deadline = time.monotonic() + 5  # the version is written right after the rewrite is recorded
            while (doc := memory(user)) is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if doc is not None:
                break
        assert doc is not None, f"the tiny copilot wrote no memory for {user} in 6 rewrites"
        rewrites[user] = doc["versions"][0]["copilot_trajectory_id"]
        run = chat(user, "hi again")
        wait_for("the run's memory tag", lambda r=run: (t := trajectory(r["trajectory_id"])) and t["meta"].get(MEMORY_REWRITE) and t)
        fb = httpx.post(server.url + "/feedback", json={"trajectory_id": run["trajectory_id"], "reward": reward}, timeout=60)
        assert fb.status_code == 200, fb.text
        got = [(r["source"], r["value"]) for r in trajectory(rewrites[user])["rewards"]]
        assert got == [("memory:feedback", reward)]

    # the documented job, as serve.py would run it; test-sized trainer, and no settling wait
    job = LearnerJob.model_validate(documented_job())
    tables = {**job.settings, "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}, "trainer": {"lr": 1e-3, "progress": False}}
    tables["samples"] = {**tables["samples"], "settle_s": 0}
    settings = LearnerSettings.model_validate({"family": job.family, **tables})
    assert job.family == "memopilot" and settings.traffic == TrafficFilter(chat=False, agents=["memopilot"])
    svc = LearnerService(
        ServiceConfig(
            data_dir=data, admin_url=server.base_url, admin_key=ADMIN, base_model=tiny_model_path, settings=settings, min_new_trajectories=1, gate_n=0
        )
    )
    record = svc.update(force=True)
    # the samples: the two rewrites the rated runs read, with their derived rewards (the rewrites after those runs were
    # read by no run: no reward, skipped); one-off prompts or one group, at least one has a non-zero advantage
    samples = {s.trajectory_id: (s.trajectory_reward, s.trajectory_reward_source) for s in svc.state.trained}
    assert samples == {rewrites["u1"]: (1.0, "memory:feedback"), rewrites["u2"]: (0.0, "memory:feedback")}
    assert record["metrics"]["optimizer_step"] is True and record["metrics"]["trained_samples"] >= 1
    assert record["gate"]["decision"] == "passed" and svc.status.champion == "memopilot@1"
    # the copilot's next rewrite is sampled from the trained version
    assert rewrite_after(chat("u1", "and again"))["turns"][0]["adapter"] == "memopilot@1"
