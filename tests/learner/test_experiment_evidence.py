"""A learner's A/B experiment decides on its users' evidence, through the real server (tiny model, in process).

Two API keys chat with the family alias (an experiment splits their sessions over the arms) and rate replies under a
source they name themselves (``"user"``); the experiment is created exactly as the learner creates it
(``Release._experiment_config``: the learner's ``[samples]`` source rule, owner share and time bound). Then the
learner's kinds of work run against the same arms through the admin API, as they do during an experiment: siblings of
a user's turn (group completion, RTPO/TCPO re-rollouts), agent runs on the challenger (PATR, RODS, REVES, the gate),
and the learner's scores posted on them. The arms' observations must not move.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from learner.config import LearnerSettings
from learner.release import Release
from tests.runtime.test_adapter_serving import make_adapter

ADMIN = "evidence-admin"
KEYS = ("key-one", "key-two")
AGENT = {"name": "ev-agent", "temperature": 1.0, "max_turns": 1, "max_tokens_per_turn": 4, "task": "basic_arithmetic", "adapter_family": "fam"}


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory, tiny_model_path):
    import json

    data = tmp_path_factory.mktemp("evidence")
    for k in range(2):
        make_adapter(tiny_model_path, data / "adapters" / f"a{k}", seed=70 + k)
    srv = start_server(
        "--admin-key", ADMIN, *[a for k in KEYS for a in ("--api-key", k)], "--agent", json.dumps(AGENT), "--adapter-root", str(data / "adapters"),
        data_dir=data,
    )  # fmt: skip
    for k, alias in ((0, True), (1, False)):
        r = httpx.post(
            srv.base_url + "/admin/adapters",
            json={"path": str(data / "adapters" / f"a{k}"), "family": "fam", "alias": alias},
            headers=auth(ADMIN),
            timeout=60,
        )
        assert r.status_code == 200, r.text
    return srv


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def fake_release(sources: list[str] | None = None) -> Release:
    """A ``Release`` over just what ``Release._experiment_config`` and the chain read of a learner's state (a chat
    learner: no agent task)."""
    samples: dict[str, Any] = {"settle_s": 0} | ({"reward_sources": sources} if sources else {})
    settings = LearnerSettings.model_validate({"family": "fam", "samples": samples})
    state = SimpleNamespace(
        cfg=SimpleNamespace(settings=settings, ab_min_samples=200, ab_max_samples=None),
        family="fam",
        task=lambda: None,
        dir=Path(tempfile.mkdtemp()),
        status=SimpleNamespace(chain={}),
    )
    return Release(state)  # type: ignore[arg-type]


def learner_experiment(sources: list[str] | None = None) -> dict[str, Any]:
    """The experiment body the chat learner creates (no agent task), through the learner's own code."""
    return fake_release(sources)._experiment_config("fam-v2", "fam@1", "fam@2")


def test_the_learner_carries_its_promotions_into_the_next_experiments_test():
    """Each promotion's effect (the runtime's state) is added to the chain the next experiment is judged with; a decision
    that promotes nothing adds nothing, and one experiment is counted once."""
    fake = fake_release()
    first = fake._experiment_config("fam-v2", "fam@1", "fam@2")
    assert first["non_inferiority_margin"] == 0.2
    assert first["non_inferiority_chain"] == {"anchor": "fam@1", "steps": 0, "diff_sd": 0.0, "var_sd": 0.0}
    promoted = {
        "name": "fam-v2",
        "status": "promoted",
        "champion": "fam@1",
        "winner": "fam@2",
        "effect": {"arm": "fam@2", "diff_sd": -0.05, "var_sd": 0.01},
    }
    fake._extend_chain(promoted)
    fake._extend_chain(promoted)  # read again (a restarted learner): counted once
    fake._extend_chain({"name": "fam-v3", "status": "inconclusive", "champion": "fam@2", "effect": None})
    nxt = fake._experiment_config("fam-v4", "fam@2", "fam@4")
    assert nxt["non_inferiority_chain"] == {"anchor": "fam@1", "steps": 1, "diff_sd": -0.05, "var_sd": 0.01}
    fake._extend_chain(
        {**promoted, "name": "fam-v4", "champion": "fam@2", "winner": "fam@4", "effect": {"arm": "fam@4", "diff_sd": 0.08, "var_sd": 0.02}}
    )
    chain = fake._experiment_config("fam-v5", "fam@4", "fam@5")["non_inferiority_chain"]
    assert chain["steps"] == 2 and chain["diff_sd"] == pytest.approx(0.03) and chain["var_sd"] == pytest.approx(0.03)
    # the runtime accepts it and judges the next step against the whole chain
    from runtime.adapters.experiments import ExperimentConfig

    assert ExperimentConfig.model_validate(fake._experiment_config("fam-v5", "fam@4", "fam@5")).non_inferiority_chain is not None


def arms(server: Any) -> dict[str, int]:
    exp = httpx.get(server.base_url + "/admin/experiments/fam-v2", headers=auth(ADMIN), timeout=30).json()
    return {a["adapter"]: a["n"] for a in exp["arms"]}


def arm_means(server: Any) -> dict[str, float | None]:
    exp = httpx.get(server.base_url + "/admin/experiments/fam-v2", headers=auth(ADMIN), timeout=30).json()
    return {a["adapter"]: a["mean_reward"] for a in exp["arms"]}


def test_users_named_feedback_decides_and_the_learners_runs_never_count(server):
    body = learner_experiment()
    assert body["reward_sources"] == ["verifier:*", "judge:*", "hook:*", "*"] and body["max_owner_share"] == 0.5
    assert body["max_duration_s"] == 900.0
    r = httpx.post(server.base_url + "/admin/experiments", json=body, headers=auth(ADMIN), timeout=30)
    assert r.status_code == 200, r.text

    turns: dict[str, list[str]] = {"fam@1": [], "fam@2": []}
    for i in range(16):
        key = KEYS[i % 2]
        chat = {"model": "fam", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4}
        resp = httpx.post(server.base_url + "/v1/chat/completions", json=chat, headers={**auth(key), "X-Session-Id": f"s{i}"}, timeout=60)
        assert resp.status_code == 200, resp.text
        lw = resp.json()["loopwise"]
        turns[lw["adapter"]].append(lw["turn_id"])
        fb = {"turn_id": lw["turn_id"], "reward": float(i % 3 == 0), "source": "user"}
        assert httpx.post(server.base_url + "/v1/feedback", json=fb, headers=auth(key), timeout=30).status_code == 200
    assert turns["fam@1"] and turns["fam@2"]  # the sessions were split over both arms
    before, means = arms(server), arm_means(server)
    assert before == {a: len(t) for a, t in turns.items()}  # the users' "user" feedback is the evidence

    # the learner's work during the experiment, on both arms: siblings of users' turns, agent runs, its scores on them
    for arm, ids in turns.items():
        r = httpx.post(server.base_url + f"/admin/turns/{ids[0]}/siblings", json={"n": 3, "model": arm}, headers=auth(ADMIN), timeout=60)
        assert r.status_code == 200, r.text
        for sib in r.json()["data"]:
            fb = {"trajectory_id": sib["trajectory_id"], "reward": 1.0, "source": "learner:judge:fam"}
            assert httpx.post(server.base_url + "/admin/feedback", json=fb, headers=auth(ADMIN), timeout=30).status_code == 200
        # and its score of the user's own turn (group completion scores the original too): the user's, yet no evidence
        fb = {"turn_id": ids[0], "reward": 1.0, "source": "learner:judge:fam"}
        assert httpx.post(server.base_url + "/admin/feedback", json=fb, headers=auth(ADMIN), timeout=30).status_code == 200
        run = {"problem_index": 3, "seed": 0, "model": arm}
        r = httpx.post(server.base_url + "/admin/agents/ev-agent/runs", json=run, headers=auth(ADMIN), timeout=120)
        assert r.status_code == 200, r.text  # its verifier's outcome is recorded on the run
    assert arms(server) == before and arm_means(server) == means


def test_a_learner_that_trains_on_feedback_only_is_judged_on_it(server):
    """The same source rule as training: with ``reward_sources = ["feedback"]`` the users' "user" rewards count for
    neither (the learner would not train on them either), and the status says there is no evidence."""
    body = learner_experiment(["feedback"]) | {"name": "fam-fb"}
    httpx.post(server.base_url + "/admin/experiments/fam-v2/stop", json={}, headers=auth(ADMIN), timeout=30)
    r = httpx.post(server.base_url + "/admin/experiments", json=body, headers=auth(ADMIN), timeout=30)
    assert r.status_code == 200, r.text
    exp = r.json()
    assert [a["n"] for a in exp["arms"]] == [0, 0] and exp["evidence"].startswith("no evidence yet")
    httpx.post(server.base_url + "/admin/experiments/fam-fb/stop", json={}, headers=auth(ADMIN), timeout=30)


def test_experiment_bodies_are_validated(server):
    bad = learner_experiment() | {"name": "bad", "metric": "feedback"}
    r = httpx.post(server.base_url + "/admin/experiments", json=bad, headers=auth(ADMIN), timeout=30)
    assert r.status_code == 400 and "not both" in r.json()["error"]["message"]
    bad = learner_experiment() | {"name": "bad2", "max_owner_share": 0}
    assert httpx.post(server.base_url + "/admin/experiments", json=bad, headers=auth(ADMIN), timeout=30).status_code == 400


def test_the_chat_learners_experiment_config_is_what_the_runtime_accepts(tmp_path: Path):
    from runtime.adapters.experiments import ExperimentConfig

    cfg = ExperimentConfig.model_validate(learner_experiment())
    assert cfg.metric is None and cfg.reward_sources is not None and cfg.max_owner_share == 0.5
