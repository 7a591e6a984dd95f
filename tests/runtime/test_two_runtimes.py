"""Two real ``serve.py`` runtimes on one PostgreSQL store, with a learner in a third process.

- 16 clients alternate between the runtimes turn by turn: every turn is recorded once, with the token
  counts the client was billed, stitched into its session's one trajectory whichever runtime served it.
- An adapter loaded, an alias flipped and an experiment created on one runtime are served alike by the other.
- ``python -m learner run --once --nproc 2 --store URL`` (two gloo ranks) trains on both runtimes' traffic,
  rank 0 publishes into the shared adapter folder and loads the version on one runtime; the other loads it from the store; both serve it.
- ``kill -9`` of a runtime in ``sync`` mode loses no turn that was answered.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from learner.records.store_pg import PostgresStore

ADMIN = "two-admin"
AGENT = {"name": "learn-agent", "temperature": 1.0, "max_turns": 1, "max_tokens_per_turn": 8, "task": "basic_arithmetic", "adapter_family": "fam"}
ROOT = Path(__file__).resolve().parents[2]


def _admin(base: str, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, base + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120, **kw)


def _wait(cond, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def two(start_server, pg_cluster, tmp_path_factory):
    url = pg_cluster.create_schema(f"two_{os.getpid()}")
    shared = tmp_path_factory.mktemp("shared-adapters")
    args = ("--store", url, "--durability", "sync", "--admin-key", ADMIN, "--adapter-root", str(shared), "--store-sync-s", "0.3")
    a = start_server(*args, "--agent", json.dumps(AGENT), data_dir=tmp_path_factory.mktemp("runtime-a"))
    b = start_server(*args, "--agent", json.dumps(AGENT), data_dir=tmp_path_factory.mktemp("runtime-b"))
    return url, shared, a, b


def test_clients_alternating_between_two_runtimes_stitch_into_one_trajectory_each(two) -> None:
    url, _, a, b = two
    bases = [a.url, b.url]

    async def client(c: int, http: httpx.AsyncClient) -> list[dict]:
        messages: list[dict] = [{"role": "user", "content": f"client {c} says hi"}]
        got = []
        for k in range(3):
            base = bases[(c + k) % 2]  # every client switches runtime on every turn
            r = await http.post(
                base + "/chat/completions",
                json={"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0},
                headers={"X-Session-Id": f"client-{c}"},
            )
            assert r.status_code == 200, r.text
            body = r.json()
            reply = body["choices"][0]["message"]["content"]
            ids = {"turn": r.headers["x-loopwise-turn-id"], "traj": r.headers["x-loopwise-trajectory-id"]}
            got.append({**ids, "usage": body["usage"], "text": reply})
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"turn {k + 1}"}]
        return got

    async def main() -> list[list[dict]]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(client(c, http) for c in range(16)))

    results = asyncio.run(main())
    store = PostgresStore(url)
    try:
        for c, turns in enumerate(results):
            assert len({t["traj"] for t in turns}) == 1, f"client {c} was split across trajectories"
            traj = store.get_trajectory(turns[0]["traj"])
            assert traj is not None and traj.session_id == f"client-{c}"
            assert [t.turn_id for t in traj.turns] == [t["turn"] for t in turns]  # each turn once, in order
            assert [t.index for t in traj.turns] == [0, 1, 2]
            assert [t.parent_turn_id for t in traj.turns] == [None, turns[0]["turn"], turns[1]["turn"]]
            for stored, seen in zip(traj.turns, turns, strict=True):
                assert len(stored.context_ids) == seen["usage"]["prompt_tokens"]  # the tokens the client was billed for
                assert len(stored.output_ids) == seen["usage"]["completion_tokens"] == len(stored.logprobs)
                assert stored.output_text == seen["text"]
        ids = [t["turn"] for turns in results for t in turns]
        assert len(set(ids)) == 48
        found = {r[0] for r in _rows(store, "SELECT turn_id FROM turns WHERE session_id LIKE 'client-%%'")}
        assert found == set(ids)
    finally:
        store.close()


def _rows(store: PostgresStore, sql: str) -> list[tuple]:
    with store._tx() as conn:
        return conn.execute(sql).fetchall()


def test_a_learner_on_a_third_process_trains_on_both_runtimes_and_both_serve_its_version(two, tiny_model_path, tmp_path) -> None:
    url, shared, a, b = two
    for p in range(2):  # agent runs on both runtimes, alternating; feedback gives each group variance
        for k in range(4):
            server = (a, b)[k % 2]
            body = {"task": "basic_arithmetic", "problem_index": p, "seed": 0, "sample_seed": k}
            r = httpx.post(server.url + "/agents/learn-agent/runs", json=body, timeout=120)
            assert r.status_code == 200, r.text
            fb = httpx.post(server.url + "/feedback", json={"trajectory_id": r.json()["trajectory_id"], "reward": float(k % 2)}, timeout=60)
            assert fb.status_code == 200, fb.text
    config = tmp_path / "learner.json"
    config.write_text(
        json.dumps(
            {
                "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                "trainer": {"lr": 1e-3, "progress": False},
                "samples": {"settle_s": 0, "reward_sources": ["feedback"]},
            }
        )
    )
    cmd = [sys.executable, "-m", "learner", "run", "--once", "--data-dir", str(tmp_path / "learner"), "--admin-url", a.base_url]
    cmd += ["--base-model", str(tiny_model_path), "--family", "fam", "--agent", "learn-agent", "--gate-n", "0", "--config", str(config)]
    cmd += ["--adapter-root", str(shared), "--nproc", "2"]  # data-parallel: rank 0 publishes
    env = {**os.environ, "LOOPWISE_STORE": url, "LOOPWISE_ADMIN_KEY": ADMIN}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (shared / "fam" / "v1" / "manifest.json").is_file()  # published into the shared folder
    trained = json.loads((tmp_path / "learner" / "learner" / "fam" / "history.jsonl").read_text().splitlines()[-1])
    assert trained["metrics"]["optimizer_step"] is True
    assert trained["metrics"]["trained_samples"] == 8  # all eight runs: four served by each runtime
    for server in (a, b):  # A was told by the learner; B followed the store
        _wait(lambda s=server: _admin(s.base_url, "GET", "/admin/adapters").json()["aliases"] == {"fam": "fam@1"}, what="fam@1 on both")
        r = httpx.post(server.url + "/chat/completions", json={"model": "fam", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] in ("fam", "fam@1"), r.text
    store = PostgresStore(url)
    adapters = {r[0] for r in _rows(store, "SELECT adapter FROM turns WHERE adapter IS NOT NULL")}
    store.close()
    assert adapters == {"fam@1"}

    # an experiment created on A routes B's requests to the same arm for the same session (state in the store)
    r = _admin(a.base_url, "POST", "/admin/adapters", json={"path": str(shared / "fam" / "v1"), "family": "fam", "version": 2})
    assert r.status_code == 200, r.text
    _wait(lambda: any(x["name"] == "fam@2" for x in _admin(b.base_url, "GET", "/admin/adapters").json()["data"]), what="fam@2 on B")
    exp = {"name": "ab", "family": "fam", "arms": [{"adapter": "fam@1"}, {"adapter": "fam@2"}], "min_samples": 50}
    assert _admin(a.base_url, "POST", "/admin/experiments", json=exp).status_code == 200
    _wait(lambda: _admin(b.base_url, "GET", "/admin/experiments").json()["data"] != [], what="the experiment on B")
    served = {}
    for s in range(12):
        for server in (a, b):
            r = httpx.post(
                server.url + "/chat/completions",
                json={"model": "fam", "messages": [{"role": "user", "content": f"s{s}"}], "max_tokens": 2},
                headers={"X-Session-Id": f"ab-{s}"},
            )
            assert r.status_code == 200, r.text
            served.setdefault(s, set()).add(r.headers.get("x-loopwise-adapter") or _adapter_of(url, r.headers["x-loopwise-turn-id"]))
    assert all(len(v) == 1 for v in served.values()), served  # one arm per session, whichever runtime answered
    assert {next(iter(v)) for v in served.values()} == {"fam@1", "fam@2"}  # and both arms are used
    # a promotion on B flips the alias on A
    assert _admin(b.base_url, "POST", "/admin/experiments/ab/promote", json={"arm": "fam@2"}).status_code == 200
    _wait(lambda: _admin(a.base_url, "GET", "/admin/adapters").json()["aliases"] == {"fam": "fam@2"}, what="the promotion on A")
    # an unload on A is followed by B
    assert _admin(a.base_url, "DELETE", "/admin/adapters/fam@1").status_code == 200
    _wait(lambda: all(x["name"] != "fam@1" for x in _admin(b.base_url, "GET", "/admin/adapters").json()["data"]), what="fam@1 gone from B")


def _adapter_of(url: str, turn_id: str) -> str | None:
    store = PostgresStore(url)
    try:
        turn = store.get_turn(turn_id)
        return None if turn is None else turn.adapter
    finally:
        store.close()


def test_kill_9_of_a_runtime_in_sync_mode_loses_no_answered_turn(two, start_server, tmp_path_factory) -> None:
    url, shared, a, _ = two
    victim = start_server(
        "--store", url, "--durability", "sync", "--admin-key", ADMIN, data_dir=tmp_path_factory.mktemp("victim"), process=True
    )  # a process: it is killed with SIGKILL
    answered: list[str] = []

    async def hammer(c: int, http: httpx.AsyncClient) -> None:
        for k in range(1000):
            try:
                r = await http.post(
                    victim.url + "/chat/completions",
                    json={"model": "tiny", "messages": [{"role": "user", "content": f"{c}-{k}"}], "max_tokens": 2},
                    headers={"X-Session-Id": f"kill-{c}"},
                )
            except httpx.HTTPError:
                return  # the runtime is gone
            if r.status_code == 200:
                answered.append(r.headers["x-loopwise-turn-id"])

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            tasks = [asyncio.create_task(hammer(c, http)) for c in range(8)]
            while len(answered) < 40:
                await asyncio.sleep(0.01)
            os.kill(victim.proc.pid, signal.SIGKILL)
            await asyncio.gather(*tasks)

    asyncio.run(main())
    victim.proc.wait(timeout=30)
    assert len(answered) >= 40
    store = PostgresStore(url)
    stored = {r[0] for r in _rows(store, "SELECT turn_id FROM turns WHERE session_id LIKE 'kill-%%'")}
    store.close()
    journal = victim.log_path.parent / "interactions.journal"  # what the store refused, replayed when the runtime restarts
    journaled = {json.loads(line)["turn_id"] for line in journal.read_text().splitlines()} if journal.exists() else set()
    missing = set(answered) - stored - journaled
    assert not missing, f"{len(missing)} of {len(answered)} answered turns were lost\n{victim.log()[-5000:]}"
    assert not journaled, f"the store refused {len(journaled)} turns:\n{victim.log()[-5000:]}"  # PostgreSQL took every write
