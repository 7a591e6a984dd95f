"""Live traffic of every shape against ``python serve.py`` with its chat learner: what a user of the server would check.

Simulated users (``bench/live_traffic.py``: their own API keys, the real ``openai`` and ``openai-agents`` clients on
a real port) hold conversations about reasoning-gym problems through chat completions (stitched by resent messages,
with regenerations, edits, ``n`` > 1 and streams), the Responses API (``previous_response_id``) and an openai-agents
agent with a function tool, and rate replies by ``turn_id``, ``trajectory_id`` and ``completion_id`` under several
sources; one key rates at random. Then an update is requested. Checked: every request was answered without a 5xx,
the chat learner stayed alive and trained on the traffic (no crash, no restart), and each key's trajectories are its
own (owned by that key, unreachable to the others' feedback).

The tiny random model answers, so no answer is right; the learner still trains (the garbage key's random rewards and
thumbs-down give advantages). Not checked here: whether anything is learned (``bench/live_traffic.py`` measures that).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from agents.tasks import get_task
from bench.live_traffic import LearnerWatch, make_users, run_users
from runtime.identity import owner_of_token

ADMIN = "live-traffic-admin"
FAMILY = "chat-lora"
# the chat learner as serve.py starts it by default (learner_jobs), with a 1 s settle window so a short burst can train
JOB = {"family": FAMILY, "min_new_trajectories": 16, "gate_n": 0, "settings": {"traffic": {"chat": True, "agents": []}, "samples": {"settle_s": 1}}}


def admin(server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, server.base_url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60, **kw)


@pytest.mark.timeout(240)
def test_live_traffic_of_every_shape_keeps_the_chat_learner_learning(start_server, tmp_path_factory, tiny_model_path):
    users = make_users(5, garbage=1, seed=0)
    keys = [a for u in users for a in ("--api-key", u.key)]
    data_dir = tmp_path_factory.mktemp("live")
    server = start_server("--learner", "--learner-job", json.dumps(JOB), "--admin-key", ADMIN, *keys, data_dir=data_dir)
    task = get_task("basic_arithmetic", max_terms=2, max_digits=1)
    watch = LearnerWatch(server.base_url, ADMIN)
    watch.poll()

    report = asyncio.run(
        run_users(
            server.base_url,
            users,
            task=task,
            problems=task.problems(64, seed=0),
            conversations=24,
            mix="focus=1,chat=1,responses=1,agents=1",
            seed=0,
            max_tokens=8,
        )
    )
    # every request answered, none with a server error; every shape and feedback form went through
    assert report.server_errors() == 0 and report.transport_errors == 0, report.summary()
    assert not report.errors, report.errors
    assert set(report.conversations) == {"focus", "chat", "responses", "agents"} and not report.aborted, report.summary()
    assert {"turn_id", "trajectory_id", "completion_id"} <= set(report.feedback), report.feedback
    assert {"source:none", "source:user", "source:thumbs"} <= set(report.feedback), report.feedback
    assert {"regenerate", "edit", "n>1", "stream"} <= set(report.events) and report.events["tool_calls"] > 0, report.events
    assert any(r.garbage for r in report.ratings) and any(not r.garbage for r in report.ratings)

    # the chat learner takes the burst: an update that trains, no crash, no restart
    watch.poll()  # under load the learner process may have listed itself only during the burst
    before = watch.last.get(FAMILY, {}).get("updates", 0)
    time.sleep(1.5)  # JOB's settle window: the burst's last trajectories become trainable
    assert admin(server, "POST", "/admin/learner/update", json={"family": FAMILY}).status_code == 202
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        watch.poll()
        s = watch.last.get(FAMILY, {})
        if s.get("updates", 0) > before and s.get("state") not in ("training", "publishing", "probing", "gating"):
            break
        assert s.get("state") != "error", s.get("detail")
        time.sleep(1)
    summary = watch.report(FAMILY, report.ratings)
    assert summary["updates"] > before, summary
    assert summary["updates_trained"] >= 1 and summary["samples_trained"] > 0, summary
    assert summary["process_restarts"] == 0 and summary["crashes"] == 0 and summary["quarantined"] == 0, summary
    assert summary["error_polls"] == 0 and summary["down_polls"] == 0 and watch.last[FAMILY].get("running", True), watch.last[FAMILY]
    assert not watch.poll_errors, watch.poll_errors

    # each key's trajectories are its own: owned by that key, and another key's feedback on them is refused as unknown
    owners = {}
    for u in users:
        for tid in report.trajectories[u.name]:
            r = admin(server, "GET", f"/admin/trajectories/{tid}")
            assert r.status_code == 200, r.text
            assert r.json()["owner"] == owner_of_token(u.key), (u.name, tid)
            owners[tid] = u.name
    assert len(owners) == sum(len(v) for v in report.trajectories.values())  # no trajectory was given to two keys
    a, b = users[0], users[1]
    theirs = next(iter(report.trajectories[b.name]))
    r = httpx.post(server.url + "/feedback", json={"trajectory_id": theirs, "reward": 1}, headers={"Authorization": f"Bearer {a.key}"}, timeout=30)
    assert r.status_code == 404

    assert server.alive() and "Traceback" not in server.log(), server.log()[-4000:]

    # the offline replay (bench/replay_learning.py) trains on the same recorded traffic, read from the live store (WAL
    # included) while the server still runs: one window, one optimizer step, the adapter moved
    from safetensors.torch import load_file

    from bench.replay_learning import replay

    settings = {"trainer": {"progress": False, "threads": 1}, "singletons": {"baseline_owner_min": 1}}
    out = replay(data_dir, tiny_model_path, FAMILY, settings, minutes=60, window_s=3600, work=tmp_path_factory.mktemp("replay"))
    assert len(out["updates"]) == 1 and out["updates"][0]["trained_samples"] > 0, out["updates"]
    weights = load_file(str(Path(out["adapter"]) / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and t.abs().sum() > 0 for k, t in weights.items())  # B starts at zero: a step moved it
