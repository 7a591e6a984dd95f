"""loopwise in front of a real SGLang server: this machine's CPU server (``make test-engines``), or one at a URL.

Marker ``sglang`` (deselected by the default suite). Two ways to run it:

- on CPU, ``make test-engines`` (after ``make sglang``): the session's real SGLang server (``sglang_server``,
  ``tests/runtime/_sglang.py``: the pure-PyTorch CPU path on the tiny model, float32), plus a second one started
  here for the replica tests;
- against a server you run (a GPU host), every test that does not start or kill servers itself::

    LOOPWISE_SGLANG_URL=http://127.0.0.1:30000 LOOPWISE_SGLANG_MODEL=/path/to/the/same/model \\
        .venv/bin/python -m pytest -m sglang tests/runtime/test_sglang_real.py

  ``LOOPWISE_SGLANG_MODEL`` is the local Hugging Face folder of the model SGLang serves (loopwise tokenizes
  and templates with it); it defaults to the ``model_path`` SGLang reports, when that is a local folder.
  SGLang must run with ``--enable-lora --max-lora-rank 8`` (or more) and ``--lora-target-modules all``
  (``bench/gpu_sglang.sh`` launches it so).

Checked here (the shared chat/streaming/tools/recording/adapter suite runs on the real server too, as the
``sglang`` backend under ``make test-engines``):

- chat, streaming, logprobs and ``n``; an adapter loaded, selected and unloaded;
- the recorded output ids, re-scored by the trainer (``LoRATrainer.token_logprobs``), give SGLang's recorded
  logprobs (``log_softmax(logits / T)``: checked at T = 1 and T = 0.7, where raw logits would be far off);
- ``--sglang-launch --sglang-python`` starts SGLang's CPU path with the flags loopwise needs, forwards its log,
  stops the whole process group on shutdown (CPU only);
- two replicas (CPU only): an adapter reaches both under fresh names; one SGLang unloads behind our back is
  loaded again by SGLang itself on the next request (its own behaviour, unlike vLLM's); an alias flip reaches
  both; killing one under load loses no answered turn (cut streams are recorded as aborted) and the survivor
  serves on; the restarted one gets its adapters back and is routed to again.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.launcher import live_group_members
from tests.runtime import _sglang
from tests.runtime._client import chat_body, post_chat, stream_chat
from tests.runtime._sglang import SGLangServer, sglang_python
from tests.runtime.test_adapter_serving import make_adapter

URL = os.environ.get("LOOPWISE_SGLANG_URL")
pytestmark = pytest.mark.sglang
ADMIN = "adm"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def target(request: pytest.FixtureRequest) -> tuple[str, Path]:
    """(SGLang's URL, the local folder of the model it serves)."""
    if not URL:
        server = request.getfixturevalue("sglang_server")  # skipped, with the reason, where it cannot run
        return server.url, server.model_path
    local = os.environ.get("LOOPWISE_SGLANG_MODEL") or httpx.get(f"{URL}/get_model_info", timeout=30).json()["model_path"]
    path = Path(local)
    if not path.is_dir():
        pytest.skip(f"set LOOPWISE_SGLANG_MODEL to the local folder of the model SGLang serves ({local} is not a folder here)")
    return URL, path


@pytest.fixture(scope="module")
def cpu_only() -> None:
    """Skips a test that starts and kills SGLang servers itself unless they run here (``make test-engines``)."""
    if URL:
        pytest.skip("starts and kills SGLang servers on this machine (`make test-engines`), not the one at LOOPWISE_SGLANG_URL")
    reason = _sglang.skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def adapter_root(target, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sglang-adapters") / "adapters"
    for k in range(3):
        make_adapter(target[1], root / f"a{k}", seed=80 + k, r=4)
    return root


@pytest.fixture(scope="module")
def real(start_server, target, adapter_root):
    url, model = target
    return start_server("--backend", "sglang", "--sglang-url", url, "--admin-key", ADMIN, "--adapter-root", str(adapter_root), model=model)


def admin(srv, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, srv.base_url + path, headers=AUTH, timeout=300, **kw)


def load(srv, root: Path, name: str, family: str, **kw: Any) -> httpx.Response:
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


def test_chat_stream_logprobs_and_n(real):
    body = chat_body(max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    full = post_chat(real, body, timeout=120)
    assert full.status_code == 200, full.text
    choice = full.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and choice["logprobs"]["content"]
    sse = stream_chat(real, body, timeout=120)
    assert sse.done and sse.content() == choice["message"]["content"]  # greedy: the same text either way
    n2 = post_chat(real, chat_body(max_tokens=8, n=2, temperature=1.0, seed=3), timeout=120)
    assert n2.status_code == 200 and len(n2.json()["choices"]) == 2


def test_adapter_load_select_unload(real, adapter_root):
    r = load(real, adapter_root, "a0", "g")
    assert r.status_code == 200, r.text
    out = post_chat(real, {**chat_body(max_tokens=8, temperature=0), "model": "g@1"}, timeout=120)
    assert out.status_code == 200 and out.json()["loopwise"]["adapter"] == "g@1"
    assert admin(real, "DELETE", "/admin/adapters/g@1").status_code == 200
    assert httpx.get(real.base_url + "/health", timeout=60).status_code == 200


def test_recorded_tokens_rescored_by_the_trainer_match_sglangs_logprobs(real, target):
    from learner.config import LoRAConfig, TrainerConfig
    from learner.samples import Sample
    from learner.trainer import LoRATrainer

    model = target[1]
    tolerance = 0.05 if URL else 2e-3  # a GPU server may run bf16; the CPU one runs float32, as the trainer does here (no autocast)
    trainer = LoRATrainer(model, TrainerConfig(threads=1, progress=False, autocast="off"), LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj"]))
    for temperature in (1.0, 0.7):
        r = post_chat(real, chat_body(max_tokens=24, temperature=temperature, seed=5, ignore_eos=True), timeout=120)
        assert r.status_code == 200, r.text
        [turn] = turns_of(real, r.json()["loopwise"]["trajectory_id"])
        assert len(turn["output_ids"]) == 24 and len(turn["logprobs"]) == 24

        def sample(t: float, turn: dict = turn) -> Sample:
            return Sample(
                turn_id="t",
                trajectory_id="tr",
                group_id="g",
                turn_index=0,
                context_ids=turn["context_ids"],
                output_ids=turn["output_ids"],
                logprobs=[],
                loss_mask=[1] * 24,
                adapter=None,
                adapter_version=0,
                reward=1.0,
                trajectory_reward=None,
                temperature=t,
                created_at=0.0,
            )

        [rescored] = trainer.token_logprobs([sample(temperature)], adapter=False)
        diff = max(abs(a - b) for a, b in zip(rescored, turn["logprobs"], strict=True))
        print(f"T={temperature}: largest |trainer - SGLang| logprob difference {diff:.2e} over 24 tokens")
        assert diff < tolerance, (temperature, diff)
        if temperature != 1.0:  # the logprobs are of logits / T: the raw distribution is measurably different
            [raw] = trainer.token_logprobs([sample(1.0)], adapter=False)
            assert max(abs(a - b) for a, b in zip(raw, turn["logprobs"], strict=True)) > 0.05


def test_sglang_launch_runs_the_virtualenvs_python_and_stops_it(cpu_only, start_server, tiny_model_path):
    flags = ("--backend", "sglang", "--sglang-launch", "--sglang-python", str(sglang_python()), "--dtype", "float32")
    srv = start_server(*flags, "--sglang-max-total-tokens", "4096", "--max-loaded-adapters", "3", "--max-lora-rank", "8", model=tiny_model_path)
    assert post_chat(srv, chat_body(max_tokens=3), timeout=120).status_code == 200
    events = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
    [launch] = [e["command"] for e in events if e["event"] == "sglang_launch"]
    assert launch.startswith(f"{sglang_python()} -m sglang.launch_server") and sys.executable not in launch
    for flag in (
        "--enable-lora",
        "--max-lora-rank 8",
        "--max-loras-per-batch 4",
        "--max-loaded-loras 4",
        "--device cpu",
        "--attention-backend torch_native",
        "--lora-backend torch_native",
        "--max-total-tokens 4096",
        "--dtype float32",
    ):
        assert flag in launch, (flag, launch)
    assert any(e.get("logger") == "sglang" for e in events)  # the child's output, in our JSON log
    [pid] = [e["pid"] for e in events if e["event"] == "sglang_started"]
    srv.stop()
    assert live_group_members(pid) == []  # the whole process group (server, scheduler, detokenizer) is gone


# ---- two replicas (this machine's CPU servers) ----------------------------------------------------


@pytest.fixture(scope="module")
def replica_b(cpu_only, tiny_model_path):
    server = SGLangServer(tiny_model_path)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pair(start_server, sglang_server, replica_b, adapter_root, tiny_model_path):
    srv = start_server(
        *("--backend", "sglang", "--engine-url", sglang_server.url, "--engine-url", replica_b.url, "--engine-health-interval", "0.5"),
        *("--admin-key", ADMIN, "--adapter-root", str(adapter_root), "--max-lora-rank", "8", "--durability", "sync"),
        model=tiny_model_path,
        process=True,  # its log is read for the replica events
    )
    srv.a, srv.b = sglang_server, replica_b
    return srv


def test_an_adapter_reaches_both_replicas_and_sglang_reloads_one_unloaded_behind_our_back(pair, adapter_root):
    assert load(pair, adapter_root, "a0", "fam").status_code == 200
    on_a = {n for n in pair.a.adapters() if n.startswith("fam@1-")}
    on_b = {n for n in pair.b.adapters() if n.startswith("fam@1-")}
    assert len(on_a) == len(on_b) == 1 and on_a != on_b  # each server has it, under its own fresh name
    want = post_chat(pair, {**chat_body(max_tokens=8, temperature=0), "model": "fam@1"}).json()["choices"][0]["message"]["content"]
    # B unloads it behind our back; SGLang loads a name it loaded once again on the next request that names it
    lost = on_b.pop()
    httpx.post(pair.b.url + "/unload_lora_adapter", json={"lora_name": lost}, timeout=60).raise_for_status()
    assert lost not in pair.b.adapters()
    for k in range(6):
        r = post_chat(pair, {**chat_body(max_tokens=8, temperature=0), "model": "fam@1"}, headers={"X-Session-Id": f"lost-{k}"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
    assert lost in pair.b.adapters()
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


def test_killing_a_replica_under_load_loses_no_answered_turn_and_a_restart_gets_its_adapters_back(pair):
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
    before = replica_metric(pair, "loopwise_engine_replica_requests_total").get("1", 0.0)
    for k in range(8):
        r = post_chat(pair, {**chat_body(max_tokens=4), "model": "flip"}, headers={"X-Session-Id": f"back-{k}"})
        assert r.status_code == 200 and r.json()["loopwise"]["adapter"] == "flip@2"
    assert replica_metric(pair, "loopwise_engine_replica_requests_total").get("1", 0.0) > before  # routed to again
