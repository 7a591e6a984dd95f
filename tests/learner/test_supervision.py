"""Supervised learners: a learner killed by a poisoned batch is restarted and the batch quarantined.

End to end: a real ``serve.py --model tiny`` with its learner, a recorded turn whose token ids are outside the tiny
model's vocabulary written straight into the store (as a store shared across a model switch holds), then ``POST
/admin/learner/update``: the learner crashes, serve.py restarts it, it fails the same batch again and quarantines the
poisoned trajectory, and trains on the rest; ``GET /admin/learner``, ``/metrics`` and the log say so.

Pieces: the ledger's bookkeeping (``learner/quarantine.py``: attempts counted per batch, a marker left by a SIGKILLed
process counts, a SIGTERM does not), the supervisor's restarts and backoff (``learner/supervisor.py``, with short
scripted processes), and the trainer's refusal of out-of-vocabulary ids (``learner/trainer.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from learner.quarantine import DIED, INFLIGHT_FILE, QUARANTINE_FILE, BatchLedger
from learner.supervisor import STATE_FILE, Backoff, Supervisor

ROOT = Path(__file__).resolve().parent.parent.parent
ADMIN = "supervision-admin"


# ---- the ledger ----------------------------------------------------------------------------------


def test_a_batch_that_fails_twice_is_quarantined_and_skipped(tmp_path):
    ledger = BatchLedger(tmp_path)
    ledger.begin(["a", "b", "c"])
    assert ledger.marker()["active"] and ledger.marker()["failures"] == 0
    first = ledger.failed(RuntimeError("boom"))
    assert first is not None and first.counted and first.failures == 1 and not first.quarantined
    assert ledger.pending() == {"trajectories": 3, "suspects": 3, "failures": 1, "since": first.error["at"]}
    # the restarted process: a failed batch is pending (not counted again), and its retry reads the same window plus a newer one
    again = BatchLedger(tmp_path)
    pending = again.recover()
    assert pending is not None and pending.failures == 1 and not pending.counted and pending.error["type"] == "RuntimeError"
    again.begin(["a", "b", "c", "d"])
    assert again.marker()["suspects"] == ["a", "b", "c"] and again.marker()["failures"] == 1  # "d" was in one failure only
    second = again.failed(RuntimeError("boom again"))
    assert second is not None and second.failures == 2 and second.quarantined == ["a", "b", "c"]
    assert BatchLedger(tmp_path).quarantined() == {"a", "b", "c"}
    batch = json.loads((tmp_path / QUARANTINE_FILE).read_text())["batches"][0]
    assert batch["failures"] == 2 and "RuntimeError: boom again" in batch["reason"]
    assert [e["message"] for e in batch["errors"]] == ["boom", "boom again"]
    summary = again.summary()
    assert summary["trajectories"] == 3 and summary["batches"] == 1 and summary["recent"][0]["trajectory_ids"] == ["a", "b", "c"]
    # what is left of the batch is retried at once, and nothing is counted against it
    rest = BatchLedger(tmp_path)
    left = rest.recover()
    assert left is not None and left.failures == 0 and not left.counted and rest.marker() is None
    assert rest.quarantined() == {"a", "b", "c"}  # what collect_samples(exclude=...) leaves out
    rest.begin(["d"])
    rest.done()
    assert rest.marker() is None and rest.recover() is None


def test_a_named_culprit_narrows_the_quarantine_and_another_batch_starts_over(tmp_path):
    class Refused(ValueError):
        def __init__(self, ids: list[str]) -> None:
            super().__init__("bad ids")
            self.trajectory_ids = ids

    ledger = BatchLedger(tmp_path)
    ledger.begin(["a", "b", "c"])
    ledger.failed(Refused(["b"]))
    assert ledger.marker()["suspects"] == ["b"]
    ledger.begin(["x", "y"])  # a batch without the suspects (the window moved): its count starts at 0
    assert ledger.marker()["failures"] == 0 and ledger.marker()["suspects"] == ["x", "y"]
    ledger.failed(Refused(["b"]))  # names no suspect of this batch: the whole batch stays suspect
    ledger.begin(["x", "y", "z"])
    out = ledger.failed(Refused(["y"]))
    assert out is not None and out.quarantined == ["y"]
    # a stop or the runtime away is not a failure
    ledger.begin(["p"])
    ledger.interrupted()
    assert ledger.marker() is None and ledger.quarantined() == {"y"}


def test_an_estimators_refusal_names_its_trajectory_and_only_that_is_quarantined(tmp_path):
    """A trajectory holding one turn index twice (a regenerate stitched onto a turn already continued) made every
    estimator raise; the error named no trajectory, so the whole batch, every tenant's, went to quarantine."""
    from learner.advantages import TurnSample, compute_advantages

    def sample(traj: str, index: int) -> TurnSample:
        return TurnSample(trajectory_id=traj, group_id="g", turn_index=index, reward=None, trajectory_reward=1.0)

    dup = [sample("a", 0), sample("b#before", 0), sample("b#before", 0), sample("c", 0)]
    with pytest.raises(ValueError, match="turn 0 twice") as refused:
        compute_advantages("grpo", dup)
    ledger = BatchLedger(tmp_path)
    for _ in range(2):
        ledger.begin(["a", "b", "c"])
        out = ledger.failed(refused.value)
    assert out is not None and out.quarantined == ["b"]  # the stored trajectory of the part the estimator named


def _child(tmp_path: Path, body: str) -> subprocess.Popen[str]:
    """A process that begins an attempt at batch [t1, t2] in ``tmp_path`` and then runs ``body`` (prints "ready" first)."""
    script = f"import os, signal, sys, time\nfrom learner.quarantine import BatchLedger\nledger = BatchLedger({str(tmp_path)!r})\n{body}"
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_marker_left_by_a_sigkilled_learner_counts_as_a_failure(tmp_path):
    body = "ledger.begin(['t1', 't2'])\nprint('ready', flush=True)\ntime.sleep(60)\n"
    for expected in (1, 2):
        proc = _child(tmp_path, body)
        proc.kill()  # SIGKILL: no cleanup, the marker stays active
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert json.loads((tmp_path / INFLIGHT_FILE).read_text())["active"] is True
        out = BatchLedger(tmp_path).recover()
        assert out is not None and out.counted and out.failures == expected and out.error["type"] == DIED
        assert str(proc.pid) in out.error["message"]
    assert out.quarantined == ["t1", "t2"] and BatchLedger(tmp_path).quarantined() == {"t1", "t2"}


def test_a_sigterm_is_a_stop_not_a_failure(tmp_path, tiny_model_path):
    # the learner's own handler (LearnerService._on_sigterm): orphaned, it abandons the round with SystemExit (the update
    # ends the attempt as interrupted); with its server alive it finishes the round, and a SIGKILL after the server's
    # 20 s wait is not taken for a crash either
    common = (
        "from learner.config import LearnerSettings\nfrom learner.service import LearnerService, ServiceConfig\n"
        f"svc = LearnerService(ServiceConfig(data_dir={str(tmp_path)!r}, admin_url='http://127.0.0.1:9', admin_key='k', "
        f"base_model={str(tiny_model_path)!r}, settings=LearnerSettings(family='f')))\n"
        "def slow(force, publish):\n    svc.ledger.begin(['t1', 't2'])\n    print('ready', flush=True)\n    time.sleep(60)\n"
        "svc._update = slow\nsignal.signal(signal.SIGTERM, svc._on_sigterm)\nsvc._busy = True\n"
    )
    folder = tmp_path / "learner" / "f"
    orphaned = _child(folder, common + "svc._parent = -1\nsvc.update()\n")
    orphaned.terminate()
    assert orphaned.wait(timeout=30) == 143
    assert not (folder / INFLIGHT_FILE).exists() and BatchLedger(folder).recover() is None
    for _ in range(2):
        graceful = _child(folder, common + "svc._parent = None\nsvc.update()\n")
        graceful.terminate()
        time.sleep(0.5)
        assert graceful.poll() is None  # it goes on with its round
        assert json.loads((folder / INFLIGHT_FILE).read_text())["terminating"] is True
        graceful.kill()
        graceful.wait(timeout=30)
        out = BatchLedger(folder).recover()
        assert out is not None and not out.counted and out.failures == 0  # retried, nothing counted
    assert not (folder / QUARANTINE_FILE).exists()


# ---- the supervisor ------------------------------------------------------------------------------


def test_backoff_doubles_to_its_cap_and_resets_after_a_stable_run():
    b = Backoff(initial_s=1, cap_s=60, stable_s=120)
    delays, d = [], None
    for _ in range(8):
        d = b.next(d, ran_s=5)
        delays.append(d)
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60]
    assert b.next(60, ran_s=121) == 1


def _scripted(tmp_path: Path, codes: list[int]):
    """A start function whose k-th process exits with ``codes[k]`` (negative: killed by that signal), then sleeps forever."""
    starts: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        k = len(starts)
        if k < len(codes):
            code = codes[k]
            body = f"import os, signal; os.kill(os.getpid(), {-code})" if code < 0 else f"import sys; sys.exit({code})"
        else:
            body = "import time; time.sleep(120)"
        starts.append(subprocess.Popen([sys.executable, "-c", body]))
        return starts[-1]

    return start, starts


def _wait(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_supervisor_restarts_a_learner_that_exits_with_backoff_and_stops_with_the_server(tmp_path):
    (tmp_path / "status.json").write_text(
        json.dumps({"family": "f", "last_error": {"type": "SampleError", "message": "bad ids", "traceback": ["x"], "at": time.time() + 5}})
    )
    start, starts = _scripted(tmp_path, [1, -signal.SIGKILL])
    sup = Supervisor("f", start, tmp_path, backoff=Backoff(initial_s=0.2, cap_s=0.3, stable_s=100))
    t0 = time.monotonic()
    sup.start()
    _wait(lambda: len(starts) == 3 and sup.state["state"] == "running")
    assert time.monotonic() - t0 >= 0.2 + 0.3  # backed off 0.2 s, then 0.4 capped at 0.3
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert state["restarts"] == 2 and state["pid"] == starts[2].pid and state["state"] == "running"
    assert state["last_exit_code"] == -signal.SIGKILL and state["last_exit_signal"] == "SIGKILL" and state["backoff_s"] == 0.3
    assert state["last_error"]["type"] == "SampleError"  # the learner's own record, written after that process started
    sup.request_stop()
    sup.join(timeout=10)
    assert starts[2].returncode == -signal.SIGTERM and len(starts) == 3  # stopped, not restarted
    assert json.loads((tmp_path / STATE_FILE).read_text())["state"] == "stopped"


def test_a_learner_that_refuses_its_configuration_is_not_restarted(tmp_path):
    start, starts = _scripted(tmp_path, [2])
    sup = Supervisor("f", start, tmp_path, backoff=Backoff(initial_s=0.05))
    sup.start()
    _wait(lambda: sup.state["state"] == "failed")
    time.sleep(0.3)
    assert len(starts) == 1 and json.loads((tmp_path / STATE_FILE).read_text())["last_exit_code"] == 2


def test_the_admin_api_merges_the_supervisor_into_the_learners_status(tmp_path):
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from runtime.admin.learner import LearnerCollector, _statuses

    now = time.time()
    a, b, c = (tmp_path / f for f in ("a", "b", "c"))
    for folder in (a, b, c):
        folder.mkdir()
    # a: crashed, in backoff (its last status is older than the supervisor's word); b: never reported; c: a learner wrote
    # its status after an old supervisor said "stopped" (it runs elsewhere now)
    crashed = {"family": "a", "state": "error", "updated_at": now - 2, "crashes": 3, "quarantine": {"trajectories": 4}}
    (a / "status.json").write_text(json.dumps(crashed))
    (a / STATE_FILE).write_text(json.dumps({"family": "a", "state": "backoff", "restarts": 2, "updated_at": now - 1}))
    (b / STATE_FILE).write_text(json.dumps({"family": "b", "state": "backoff", "restarts": 1, "updated_at": now}))
    (c / "status.json").write_text(json.dumps({"family": "c", "state": "waiting", "updated_at": now}))
    (c / STATE_FILE).write_text(json.dumps({"family": "c", "state": "stopped", "restarts": 0, "updated_at": now - 60}))
    st = {s["family"]: s for s in _statuses(tmp_path, history=0)}
    assert st["a"]["running"] is False and st["a"]["supervisor"]["restarts"] == 2
    assert st["b"]["state"] == "error" and st["b"]["running"] is False and st["b"]["supervisor"]["restarts"] == 1
    assert st["c"]["running"] is True
    registry = CollectorRegistry()
    registry.register(LearnerCollector(tmp_path))
    prom = generate_latest(registry).decode()
    assert 'loopwise_learner_restarts_total{family="a"} 2.0' in prom and 'loopwise_learner_restarts_total{family="b"} 1.0' in prom
    assert 'loopwise_learner_crashes_total{family="a"} 3.0' in prom and 'loopwise_learner_quarantined_trajectories{family="a"} 4.0' in prom


# ---- the trainer's refusal -----------------------------------------------------------------------


def test_the_trainer_refuses_token_ids_outside_its_vocabulary_before_any_step(tiny_model_path):
    from learner.config import LoRAConfig, TrainerConfig
    from learner.samples import Sample
    from learner.trainer import LoRATrainer, SampleError

    trainer = LoRATrainer(tiny_model_path, TrainerConfig(progress=False), LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    v = trainer.vocab_size

    def sample(tid: str, output: list[int]) -> Sample:
        return Sample(
            turn_id=f"{tid}-t0", trajectory_id=tid, group_id="g", turn_index=0, context_ids=[1, 2, 3], output_ids=output,
            logprobs=[-1.0] * len(output), loss_mask=[1] * len(output), adapter=None, adapter_version=0, reward=None,
            trajectory_reward=1.0, temperature=1.0, created_at=0.0,
        )  # fmt: skip

    before = {k: p.detach().clone() for k, p in trainer.model.named_parameters() if p.requires_grad}
    with pytest.raises(SampleError, match=rf"outside this model's vocabulary \(size {v}; e\.g\. id {v + 7}\).*bad-traj") as info:
        trainer.step([sample("ok-traj", [5, 6]), sample("bad-traj", [5, v + 7])], [1.0, -1.0])
    assert info.value.trajectory_ids == ["bad-traj"] and trainer.version == 0
    assert all(p.equal(before[k]) for k, p in trainer.model.named_parameters() if p.requires_grad)
    with pytest.raises(SampleError):
        trainer.token_logprobs([sample("neg-traj", [-1])])


# ---- end to end ----------------------------------------------------------------------------------

JOB = {
    "family": "sup",
    "min_new_trajectories": 1000,  # updates only when asked (or to retry a failed one)
    "gate_n": 0,
    "settings": {
        "traffic": {"chat": True, "agents": []},
        "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "trainer": {"lr": 1e-3},
        "samples": {"settle_s": 0, "reward_sources": ["feedback"]},
    },
}


def admin(server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, server.base_url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60, **kw)


def good_traffic(server, prompt: str, n: int = 4) -> list[str]:
    """``n`` answers to one prompt (one group), rewarded 1, 0, 1, 0 by feedback."""
    ids = []
    for k in range(n):
        body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 1.0, "seed": k}
        r = httpx.post(server.url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        ids.append(r.json()["loopwise"]["trajectory_id"])
        fb = {"trajectory_id": ids[-1], "reward": float(k % 2 == 0)}
        assert httpx.post(server.url + "/feedback", json=fb, timeout=30).status_code == 200
    return ids


def poison(data: Path, vocab: int, group_of: str) -> str:
    """A rewarded one-turn trajectory whose output ids are outside the tiny model's vocabulary, written straight into the store,
    in the group of the trajectory ``group_of`` (same prompt), so that its advantage is not 0 (without the trainer's check,
    the forward pass would raise a bare IndexError)."""
    from learner.records import Reward, Turn
    from learner.records.store import SqliteStore

    store = SqliteStore(data / "interactions.db")
    try:
        peer = store.get_trajectory(group_of)
        assert peer is not None and peer.turns[0].prefix_key
        turn = Turn(
            turn_id="poison-t0", trajectory_id="poison", session_id="poison-s", index=0, completion_id="poison-c", model="tiny",
            context_ids=[1, 2, 3], output_ids=[vocab + 3, vocab + 4], logprobs=[-1.0, -1.0], loss_mask=[1, 1],
            finish_reason="stop", created_at=time.time() - 1, prefix_key=peer.turns[0].prefix_key,
        )  # fmt: skip
        store.append_turns([turn])
        store.add_reward(Reward(target="trajectory", target_id="poison", value=1.0, source="feedback"))
    finally:
        store.close()
    return "poison"


def learner_status(server) -> dict:
    return next((s for s in admin(server, "GET", "/admin/learner?history=50").json()["data"] if s["family"] == "sup"), {})


def wait_for(server, pred, what: str, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = learner_status(server)
        if pred(st):
            return st
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {json.dumps(st)[:3000]}\n{server.log()[-6000:]}"
        time.sleep(0.5)


def trained(st: dict) -> list[dict]:
    return [h for h in st.get("history") or [] if (h.get("metrics") or {}).get("optimizer_step")]


def test_a_learner_killed_by_a_poisoned_batch_is_restarted_and_the_batch_quarantined(start_server, tmp_path_factory, tiny_model_path):
    data = tmp_path_factory.mktemp("supervision")
    server = start_server("--admin-key", ADMIN, "--learner", "--learner-job", json.dumps(JOB), data_dir=data)
    wait_for(server, lambda st: st.get("state") == "waiting", "the learner's first status", timeout=180)
    good = good_traffic(server, "what is 2+2?")
    vocab = json.loads((tiny_model_path / "config.json").read_text())["vocab_size"]
    bad = poison(data, vocab, group_of=good[0])
    assert admin(server, "POST", "/admin/learner/update", json={"family": "sup"}).status_code == 202

    # crash, restart, the same batch fails again and its poisoned trajectory (named by the trainer) is quarantined
    st = wait_for(server, lambda st: (st.get("quarantine") or {}).get("trajectories"), "a quarantine")
    assert st["quarantine"]["recent"][0]["trajectory_ids"] == [bad], st["quarantine"]
    # the retry trains the rest of the batch
    st = wait_for(server, lambda st: trained(st), "a trained update", timeout=120)
    sup = st["supervisor"]
    assert sup["restarts"] >= 2 and sup["state"] == "running" and sup["last_exit_code"] == 1  # two crashes, two restarts
    assert sup["last_error"]["type"] == "SampleError" and sup["last_error"]["quarantined"] == [bad]
    assert st["crashes"] == 2 and st["running"] is True and st["failing_batch"] is None
    err = st["last_error"]
    assert err["type"] == "SampleError" and "outside this model's vocabulary" in err["message"] and "poison-t0" in err["message"]
    assert err["failures"] == 2 and any("SampleError" in line for line in err["traceback"])
    q = st["quarantine"]
    assert q["batches"] == 1 and q["recent"][0]["trajectory_ids"] == [bad] and "SampleError" in q["recent"][0]["reason"]
    first = trained(st)[-1]
    assert first["metrics"]["skipped"]["quarantined"] == 1 and first["metrics"]["trained_samples"] > 0  # the good ones trained
    assert not set(good) & set(json.loads((data / "learner" / "sup" / QUARANTINE_FILE).read_text())["batches"][0]["trajectory_ids"])

    # a later update on new traffic trains too; the cursor moved past the quarantined batch (nothing left to skip)
    more = good_traffic(server, "what is 3+3?")
    assert admin(server, "POST", "/admin/learner/update", json={"family": "sup"}).status_code == 202
    st = wait_for(server, lambda s: len(trained(s)) >= 2, "a second trained update", timeout=120)
    assert trained(st)[-1]["metrics"]["skipped"]["quarantined"] == 0 and more
    assert st["supervisor"]["restarts"] == sup["restarts"]  # no crash since

    prom = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert f'loopwise_learner_restarts_total{{family="sup"}} {float(sup["restarts"])}' in prom
    assert 'loopwise_learner_crashes_total{family="sup"} 2.0' in prom
    assert 'loopwise_learner_quarantined_trajectories{family="sup"} 1.0' in prom
    log = server.log()
    assert "the learner process exited" in log and "restarting the learner" in log and "batch quarantined" in log
    assert "learner update failed" in log and "SampleError" in log
    assert os.path.exists(data / "learner" / "sup" / "supervisor.json")
