"""Served agents end to end: the app ``serve.py`` builds (tiny model) on a real port, the real ``openai`` client, curl-style httpx calls.

The tiny model's text is random, so these tests check the surfaces and the records (ids, turns, rewards,
errors), not answer quality; the loop's logic is covered with scripted outputs in ``test_loop.py``.
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from tests.runtime._client import assert_error

ADMIN = "agent-admin"
# short turns: the tiny model's random text runs to the limit, and these tests check surfaces and records, not lengths
CUSTOM = {
    "name": "echo-agent",
    "system_prompt": "Answer briefly.",
    "stop_policy": "svr",
    "stop_params": {"tau": 0.8},
    "max_turns": 2,
    "max_tokens_per_turn": 24,
}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--admin-key", ADMIN, "--agent", json.dumps(CUSTOM))


def admin(server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, server.base_url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60, **kw)


def client(server) -> OpenAI:
    return OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_agents_are_listed_as_models(server):
    ids = {m.id: m.owned_by for m in client(server).models.list()}
    assert ids["calc-agent"] == ids["svr-agent"] == ids["echo-agent"] == "loopwise-agent"
    assert ids["tiny"] == "loopwise"


def test_chat_with_an_agent_runs_the_loop_and_records_its_turns(server):
    r = client(server).chat.completions.create(model="echo-agent", messages=[{"role": "user", "content": "say hi"}], seed=1)
    ids = r.model_extra["loopwise"]
    assert r.choices[0].finish_reason in ("stop", "length") and isinstance(r.choices[0].message.content, str)
    assert ids["agent"] == "echo-agent" and 1 <= ids["turns"] <= 2 and ids["trainable"] is True
    traj = admin(server, "GET", f"/admin/trajectories/{ids['trajectory_id']}").json()
    assert len(traj["turns"]) == ids["turns"] and traj["turns"][-1]["turn_id"] == ids["turn_id"]
    assert traj["meta"]["agent"] == "echo-agent" and traj["meta"]["stop_reason"] == ids["stop_reason"]
    assert r.usage.completion_tokens == sum(len(t["output_ids"]) for t in traj["turns"])
    first = traj["turns"][0]
    assert "<verdict>" in first["messages"][0]["content"]  # the SVR format is taught in the system prompt
    # feedback on the agent's trajectory works like on any other
    fb = httpx.post(server.url + "/feedback", json={"trajectory_id": ids["trajectory_id"], "reward": 1.0}, timeout=30)
    assert fb.status_code == 200, fb.text


def test_streamed_agent_answer(server):
    stream = client(server).chat.completions.create(
        model="echo-agent", messages=[{"role": "user", "content": "hello"}], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["loopwise"]["agent"] == "echo-agent"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    traj = admin(server, "GET", f"/admin/trajectories/{finals[0].model_extra['loopwise']['trajectory_id']}").json()
    assert traj["meta"]["agent"] == "echo-agent" and isinstance(text, str)


def test_a_run_on_a_task_problem_gets_its_verifier_reward(server):
    # echo-agent: 24-token turns (calc-agent's are 384: minutes of the tiny model on a loaded machine)
    r = httpx.post(server.url + "/agents/echo-agent/runs", json={"task": "calc_arith", "problem_index": 3, "seed": 0}, timeout=120)
    assert r.status_code == 200, r.text
    run = r.json()
    assert run["object"] == "agent.run" and run["task"] == "calc_arith" and run["problem"]["id"] == run["problem_id"]
    assert run["reward"] in (0.0, 1.0) and run["task_key"].startswith("calc_arith:")
    assert len(run["steps"]) == run["turns"] >= 1 and all("tool_calls" in s for s in run["steps"])
    traj = admin(server, "GET", f"/admin/trajectories/{run['trajectory_id']}").json()
    [reward] = [x for x in traj["rewards"] if x["target"] == "trajectory"]
    assert reward["source"] == "verifier:calc_arith" and reward["value"] == run["reward"]
    assert traj["meta"]["task_key"] == run["task_key"]


def test_a_run_reports_the_environments_outcome_and_takes_a_problem_by_its_id(server):
    from agents.tasks import get_task

    pid = get_task("frozenlake").problems(3)[2].id
    r = httpx.post(server.url + "/agents/echo-agent/runs", json={"task": "frozenlake", "problem_id": pid, "max_turns": 2}, timeout=120)
    assert r.status_code == 200, r.text
    run = r.json()
    assert run["problem_id"] == pid and run["problem_index"] == 2  # resolved to the index the run is recorded under
    envs = [s["info"] for s in run["steps"] if s["info"] is not None]
    assert envs and run["info"] == envs[-1]  # the run's outcome is the last step's, structured: nobody parses the observation
    assert {"moves", "position", "distance_to_goal", "format_error"} <= set(envs[0]) and isinstance(envs[0]["position"], list)
    again = httpx.post(server.url + "/agents/echo-agent/runs", json={"task": "frozenlake", "problem_index": 2, "max_turns": 1}, timeout=120)
    assert again.json()["problem_id"] == pid
    unknown = httpx.post(server.url + "/agents/echo-agent/runs", json={"task": "frozenlake", "problem_id": "frozenlake/nope"}, timeout=30)
    assert "frozenlake/nope" in assert_error(unknown, 400)["message"]
    both = httpx.post(server.url + "/agents/echo-agent/runs", json={"task": "frozenlake", "problem_id": pid, "problem_index": 2}, timeout=30)
    assert_error(both, 400)


def test_admin_creates_and_deletes_agents(server):
    cfg = {"name": "py-agent", "tools": ["python", "calculator"], "max_turns": 1, "max_tokens_per_turn": 16}
    r = admin(server, "POST", "/admin/agents", json=cfg)
    assert r.status_code == 201, r.text
    assert r.json()["tools"] == ["python", "calculator"]
    assert "py-agent" in [a["name"] for a in admin(server, "GET", "/admin/agents").json()["data"]]
    out = client(server).chat.completions.create(model="py-agent", messages=[{"role": "user", "content": "x"}])
    assert out.model_extra["loopwise"]["turns"] == 1
    assert admin(server, "DELETE", "/admin/agents/py-agent").status_code == 200
    with pytest.raises(NotFoundError):
        client(server).chat.completions.create(model="py-agent", messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("cfg", "status", "needle"),
    [
        ({"name": "bad-tools", "tools": ["nope"]}, 400, "unknown tools nope"),
        ({"name": "tiny"}, 409, "already a model"),
        ({"name": "echo-agent"}, 409, "exists"),
        ({"name": "bad policy", "stop_policy": "svr"}, 400, "name"),
        ({"name": "p", "stop_policy": "svr", "stop_params": {"bogus": 1}}, 400, "bogus"),
        ({"name": "t", "task": "no_such_task"}, 400, "unknown task"),
    ],
)
def test_bad_agent_configs_are_refused(server, cfg, status, needle):
    r = admin(server, "POST", "/admin/agents", json=cfg)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_agent_requests_that_cannot_apply_are_400s(server):
    c = client(server)
    # client tools, n and response_format are served (tests/agents/test_agent_as_model.py); a client tool
    # named like one of the agent's own tools cannot be
    tool = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(BadRequestError) as e:
        c.chat.completions.create(model="calc-agent", messages=[{"role": "user", "content": "x"}], tools=[tool])
    assert e.value.body["param"] == "tools" and "calculator" in e.value.body["message"]
    with pytest.raises(BadRequestError):
        c.completions.create(model="calc-agent", prompt="x", max_tokens=2)
    r = httpx.post(server.url + "/agents/calc-agent/runs", json={"input": "x", "messages": []}, timeout=30)
    assert_error(r, 400)
    r = httpx.post(server.url + "/agents/nobody/runs", json={"input": "x"}, timeout=30)
    assert_error(r, 404)
    r = httpx.post(server.url + "/agents/calc-agent/runs", json={"input": "x", "model": "ghost@3"}, timeout=30)
    assert_error(r, 404)
    assert admin(server, "GET", "/admin/agents").status_code == 200
    assert httpx.get(server.base_url + "/admin/agents", timeout=30).status_code == 401


def test_eval_cli_reports_its_numbers(server):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent.parent
    cmd = [
        sys.executable,
        "-m",
        "experiments.agent_eval",
        "--agent",
        "echo-agent",
        "--task",
        "basic_arithmetic",
        "--n",
        "3",
        "--url",
        server.base_url,
    ]
    proc = subprocess.run([*cmd, "--json"], cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["n"] == 3 and 0.0 <= summary["success_rate"] <= 1.0 and summary["ci_low"] <= summary["ci_high"]
    assert summary["mean_turns"] >= 1 and summary["mean_tokens"] > 0 and sum(summary["stop_reasons"].values()) == 3
    assert "brier" in summary and "ece" in summary and "wrong_stop_rate" in summary
    # eval runs are recorded with their verifier reward and marked as evaluations
    trajs = admin(server, "GET", "/admin/trajectories?limit=3").json()["data"]
    assert all(t["meta"].get("eval") is True and t["meta"].get("task") == "basic_arithmetic" for t in trajs)
    text = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert text.returncode == 0 and "success rate" in text.stdout and "Wilson" in text.stdout
    bad = subprocess.run([*cmd[:-2], "--url", "http://127.0.0.1:9"], cwd=root, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "no loopwise server" in bad.stderr


def test_a_run_on_another_task_or_beyond_its_problems_is_a_400(server):
    """A run may name a task other than the agent's: the agent's options were passed to it (HumanEval took
    ``n_ops`` and raised TypeError: a 500), and an index past a fixed problem set raised IndexError (a 500)."""
    cfg = {"name": "opt-agent", "task": "calc_arith", "task_options": {"n_ops": 1}, "max_turns": 1, "max_tokens_per_turn": 8}
    assert admin(server, "POST", "/admin/agents", json=cfg).status_code == 201
    try:
        r = httpx.post(server.url + "/agents/opt-agent/runs", json={"task": "humaneval", "problem_index": 5000}, timeout=60)
        err = assert_error(r, 400)
        assert "5000" in err["message"] and "humaneval" in err["message"], err
        ok = httpx.post(server.url + "/agents/opt-agent/runs", json={"task": "calc_arith", "problem_index": 1, "seed": 0}, timeout=120)
        assert ok.status_code == 200, ok.text  # the agent's own task keeps its options
    finally:
        admin(server, "DELETE", "/admin/agents/opt-agent")


def test_any_int64_seed_runs_a_sampling_agent(server):
    """A turn's seed is the run's seed · 1000 + turn: a chat seed of 2**63 - 1 (valid for chat) overflowed torch's
    generator (a 500); a runs-API seed past the runs' range is a 400 naming it."""
    cfg = {"name": "warm-agent", "temperature": 0.7, "max_turns": 1, "max_tokens_per_turn": 4}
    assert admin(server, "POST", "/admin/agents", json=cfg).status_code == 201
    try:
        for seed in (2**63 - 1, -(2**63)):
            out = client(server).chat.completions.create(model="warm-agent", messages=[{"role": "user", "content": "x"}], seed=seed, n=2)
            assert len(out.choices) == 2
        r = httpx.post(server.url + "/agents/warm-agent/runs", json={"input": "x", "sample_seed": 2**62}, timeout=60)
        err = assert_error(r, 400)
        assert "sample_seed" in err["message"], err
    finally:
        admin(server, "DELETE", "/admin/agents/warm-agent")


def test_a_run_whose_input_could_never_fit_is_refused_before_templating(server):
    """The runs API templated and tokenized its input on the event loop with no size check (4 MB: seconds for everyone),
    to end in context_full with a 200."""
    r = httpx.post(server.url + "/agents/echo-agent/runs", json={"input": "word " * 40_000}, timeout=60)
    err = assert_error(r, 400, code="context_length_exceeded")
    assert "characters" in err["message"], err
    r = httpx.post(server.url + "/agents/echo-agent/runs", json={"messages": [{"role": "user", "content": "word " * 40_000}]}, timeout=60)
    assert_error(r, 400, code="context_length_exceeded")


def test_a_tenants_run_takes_at_most_the_agents_turns(server):
    """A run's turns are its cost: a key could ask echo-agent (max_turns 2) for 64 turns (or a 64-turn horizon), 32x
    what its admin configured. Fewer are fine; more are a 400 naming the field; the admin's runs may raise the cap."""
    for field in ("max_turns", "horizon"):
        r = httpx.post(server.url + "/agents/echo-agent/runs", json={"input": "hi", field: 3}, timeout=60)
        err = assert_error(r, 400, code="invalid_value")
        assert err["message"].startswith(f"{field}: 3") and "max_turns (2)" in err["message"], err
    ok = httpx.post(server.url + "/agents/echo-agent/runs", json={"input": "hi", "max_turns": 1, "seed": 1}, timeout=120)
    assert ok.status_code == 200 and ok.json()["turns"] == 1, ok.text
    raised = admin(server, "POST", "/admin/agents/echo-agent/runs", json={"input": "hi", "horizon": 3, "seed": 1})
    assert raised.status_code == 200 and raised.json()["turns"] == 3, raised.text
