"""loopwise in front of real vLLM servers (vLLM's CPU build): exact tokens, ``--vllm-launch``, two replicas.

Marked ``engines``: ``make test-engines`` runs them (with the shared backend suite on vllm); the default
suite skips them with the reason. Servers: ``vllm_server`` (A, shared with the backend suite) and a
second one started here (B), both on the tiny model with head_dim 32, float32.

- the recorded output ids, re-scored by the trainer (``LoRATrainer.token_logprobs``), give vLLM's
  recorded logprobs (``logits / T``: checked at T = 1 and T = 0.7, where raw logits would be far off);
- ``--vllm-launch`` starts vLLM with the flags loopwise needs, forwards its log, stops it on shutdown;
- two replicas: an adapter reaches both under fresh names; a replica that lost an adapter behind our back
  is routed around and gets it back; an alias flip reaches both; killing one replica under load loses no
  answered turn (cut streams are recorded as aborted) and the survivor serves on; the restarted replica
  gets its adapters back and is routed to again.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from runtime.launcher import live_group_members
from tests.runtime._client import chat_body, post_chat, stream_chat
from tests.runtime._vllm import VLLMServer
from tests.runtime.test_adapter_serving import make_adapter

pytestmark = pytest.mark.engines
ADMIN = "adm"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def adapter_root(tiny_h32_path, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vllm-adapters") / "adapters"
    for k in range(3):
        make_adapter(tiny_h32_path, root / f"a{k}", seed=70 + k, r=4)
    return root


def admin(srv, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, srv.base_url + path, headers=AUTH, timeout=120, **kw)


def load(srv, root: Path, name: str, family: str, **kw) -> httpx.Response:
    return admin(srv, "POST", "/admin/adapters", json={"path": str(root / name), "family": family, **kw})


def turns_of(srv, trajectory_id: str, timeout: float = 20) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = admin(srv, "GET", f"/admin/trajectories/{trajectory_id}")
        if r.status_code == 200:
            return r.json()["turns"]
        time.sleep(0.1)
    raise AssertionError(f"trajectory {trajectory_id} was not recorded")


def replica_metric(srv, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(srv.base_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('replica="')[1].split('"')[0]] = float(value)
    return out


def test_recorded_tokens_rescored_by_the_trainer_match_vllms_logprobs(start_server, vllm_server, tiny_h32_path):
    from learner.config import LoRAConfig, TrainerConfig
    from learner.samples import Sample
    from learner.trainer import LoRATrainer

    srv = start_server("--backend", "vllm", "--engine-url", vllm_server.url, "--admin-key", ADMIN, model=tiny_h32_path)
    trainer = LoRATrainer(tiny_h32_path, TrainerConfig(threads=1, progress=False), LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj"]))
    for temperature in (1.0, 0.7):
        r = post_chat(srv, chat_body(max_tokens=24, temperature=temperature, seed=5, ignore_eos=True))
        assert r.status_code == 200, r.text
        [turn] = turns_of(srv, r.json()["loopwise"]["trajectory_id"])
        assert len(turn["output_ids"]) == 24 and len(turn["logprobs"]) == 24

        def sample(t: float, turn: dict = turn) -> Sample:
            return Sample("t", "tr", "g", 0, turn["context_ids"], turn["output_ids"], [], [1] * 24, None, 0, 1.0, None, t, 0.0)

        [rescored] = trainer.token_logprobs([sample(temperature)], adapter=False)
        diff = max(abs(a - b) for a, b in zip(rescored, turn["logprobs"], strict=True))
        assert diff < 2e-3, (temperature, diff)
        if temperature != 1.0:  # the logprobs are of logits / T: the raw distribution is measurably different
            [raw] = trainer.token_logprobs([sample(1.0)], adapter=False)
            assert max(abs(a - b) for a, b in zip(raw, turn["logprobs"], strict=True)) > 0.05


def test_vllm_launch_starts_vllm_and_stops_it(start_server, tiny_h32_path):
    srv = start_server(
        *("--backend", "vllm", "--vllm-launch", "--vllm-kv-cache", "64M", "--dtype", "float32", "--max-loaded-adapters", "3", "--max-lora-rank", "4"),
        model=tiny_h32_path,
    )
    assert post_chat(srv, chat_body(max_tokens=3), timeout=120).status_code == 200
    events = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
    [launch] = [e["command"] for e in events if e["event"] == "vllm_launch"]
    for flag in ("serve", "--enable-lora", "--max-lora-rank 8", "--max-loras 3", "--max-cpu-loras 3", "--logprobs-mode processed_logprobs"):
        assert flag in launch, (flag, launch)
    assert any(e.get("logger") == "vllm" for e in events)  # the child's output, in our JSON log
    [pid] = [e["pid"] for e in events if e["event"] == "vllm_started"]
    srv.stop()
    assert live_group_members(pid) == []  # the whole process group (API server, engine core, worker) is gone


# ---- two replicas ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replica_b(tiny_h32_path):
    server = VLLMServer(tiny_h32_path)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pair(start_server, vllm_server, replica_b, adapter_root, tiny_h32_path):
    srv = start_server(
        *("--backend", "vllm", "--engine-url", vllm_server.url, "--engine-url", replica_b.url, "--engine-health-interval", "0.5"),
        *("--admin-key", ADMIN, "--adapter-root", str(adapter_root), "--max-lora-rank", "8", "--durability", "sync"),
        model=tiny_h32_path,
        process=True,  # its log is read for the replica events
    )
    srv.a, srv.b = vllm_server, replica_b
    return srv


def test_an_adapter_reaches_both_replicas_and_a_lost_one_is_routed_around_then_reloaded(pair, adapter_root):
    assert load(pair, adapter_root, "a0", "fam").status_code == 200
    on_a = {n for n in pair.a.adapters() if n.startswith("fam@1-")}
    on_b = {n for n in pair.b.adapters() if n.startswith("fam@1-")}
    assert len(on_a) == len(on_b) == 1 and on_a != on_b  # each server has it, under its own fresh name
    want = post_chat(pair, {**chat_body(max_tokens=8, temperature=0), "model": "fam@1"}).json()["choices"][0]["message"]["content"]
    # B loses it behind our back (as a restart between two probes would)
    httpx.post(pair.b.url + "/v1/unload_lora_adapter", json={"lora_name": on_b.pop()}, timeout=30).raise_for_status()
    for k in range(6):
        r = post_chat(pair, {**chat_body(max_tokens=8, temperature=0), "model": "fam@1"}, headers={"X-Session-Id": f"lost-{k}"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
    deadline = time.monotonic() + 30
    while not any(n.startswith("fam@1-") for n in pair.b.adapters()):
        assert time.monotonic() < deadline, "B did not get the adapter back"
        time.sleep(0.2)
    assert admin(pair, "DELETE", "/admin/adapters/fam@1").status_code == 200
    assert not any(n.startswith("fam@") for n in pair.a.adapters() | pair.b.adapters())


def test_an_alias_flip_reaches_both_replicas(pair, adapter_root):
    assert load(pair, adapter_root, "a1", "flip", alias=True).status_code == 200
    assert load(pair, adapter_root, "a2", "flip").status_code == 200
    want = post_chat(pair, {**chat_body(max_tokens=8, temperature=0), "model": "flip@2"}).json()["choices"][0]["message"]["content"]
    assert admin(pair, "PUT", "/admin/aliases/flip", json={"target": "flip@2"}).status_code == 200
    before = replica_metric(pair, "loopwise_engine_replica_requests_total")
    for k in range(8):  # new sessions: least loaded, so both replicas serve
        r = post_chat(pair, {**chat_body(max_tokens=8, temperature=0), "model": "flip"}, headers={"X-Session-Id": f"flip-{k}"})
        assert r.status_code == 200 and r.json()["loopwise"]["adapter"] == "flip@2"
        assert r.json()["choices"][0]["message"]["content"] == want
    after = replica_metric(pair, "loopwise_engine_replica_requests_total")
    assert after["0"] > before["0"] and after["1"] > before["1"], (before, after)


def test_killing_a_replica_under_load_loses_no_answered_turn_and_a_restart_gets_its_adapters_back(pair, adapter_root):
    results: list[dict] = []
    lock = threading.Lock()
    killed = threading.Event()

    def client(k: int) -> None:
        for j in range(6):
            body = {**chat_body(max_tokens=64, temperature=1.0, seed=k * 10 + j, ignore_eos=True), "model": "flip", "user": f"load-{k}"}
            if j % 2:
                sse = stream_chat(pair, body, timeout=300)
                row = {"kind": "stream", "status": sse.status, "error": any("error" in e for e in sse.events), "done": sse.done}
                row["trajectory"] = sse.headers.get("x-loopwise-trajectory-id")
            else:
                r = post_chat(pair, body, timeout=300)
                row = {"kind": "full", "status": r.status_code, "error": r.status_code != 200, "done": True}
                row["trajectory"] = r.json().get("loopwise", {}).get("trajectory_id") if r.status_code == 200 else None
            row["after_kill"] = killed.is_set()
            with lock:
                results.append(row)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while replica_metric(pair, "loopwise_engine_replica_in_flight").get("1", 0) < 1:
        assert time.monotonic() < deadline, "no request reached replica B"
        time.sleep(0.05)
    pair.b.kill()
    killed.set()
    for t in threads:
        t.join(timeout=600)
    assert len(results) == 36
    failures = [r for r in results if r["kind"] == "full" and r["status"] != 200]
    assert not failures, failures  # a non-streamed request on B was retried on A: nothing was handed out yet
    answered = [r for r in results if not r["error"]]
    cut = [r for r in results if r["kind"] == "stream" and r["error"]]
    assert all(r["status"] == 200 for r in results)
    for r in answered:  # sync durability: an answered turn is committed before the answer is sent
        [turn] = turns_of(pair, r["trajectory"])
        assert turn["finish_reason"] == "length" and len(turn["output_ids"]) == 64
    for r in cut:  # streams cut when B died: the client got an error event, the store an aborted turn
        [turn] = turns_of(pair, r["trajectory"])
        assert turn["finish_reason"] == "abort" and 0 < len(turn["output_ids"]) < 64
    assert cut or "replica_request_failed" in pair.log() or "replica_down" in pair.log(), "B was killed with nothing in flight"
    assert all(not r["error"] for r in results if r["after_kill"] and r["kind"] == "full")
    assert replica_metric(pair, "loopwise_engine_replica_up") == {"0": 1.0, "1": 0.0}
    for k in range(3):  # the survivor serves on
        assert post_chat(pair, {**chat_body(max_tokens=4), "model": "flip"}, headers={"X-Session-Id": f"after-{k}"}).status_code == 200

    pair.b.start()  # the same port, a fresh process with no adapters
    deadline = time.monotonic() + 60
    while replica_metric(pair, "loopwise_engine_replica_up").get("1") != 1.0:
        assert time.monotonic() < deadline, "B was not taken back"
        time.sleep(0.2)
    listed = pair.b.adapters()
    assert any(n.startswith("flip@1-") for n in listed) and any(n.startswith("flip@2-") for n in listed), listed
    served_before = pair.b.finished_requests()
    for k in range(8):
        r = post_chat(pair, {**chat_body(max_tokens=4), "model": "flip"}, headers={"X-Session-Id": f"back-{k}"})
        assert r.status_code == 200 and r.json()["loopwise"]["adapter"] == "flip@2"
    assert pair.b.finished_requests() > served_before  # routed to again, with the adapter reloaded
