"""Real engine servers in the tests: which ones a run starts, the servers themselves, and the checks both engines share.

**Which engines** (``LOOPWISE_TEST_ENGINES``): ``make test-engines`` sets it to its ``ENGINES`` (default ``vllm sglang``;
``.ci/run`` names the ones installed on the machine); ``1`` means every engine. Unset or empty: the default suite, which
starts no real engine server. ``asked(name)`` says whether that engine's real servers run in this session.

**The servers**: :class:`EngineServer` is one real server on this machine, run through loopwise's own launcher (so the
flags ``serve.py --<engine>-launch`` uses are the ones tested) on a fixed free port: ``kill()`` SIGKILLs its process
group (a crash), ``start()`` brings it back on the same port with no adapters, ``adapters()`` lists the engine's own
adapter names. ``_sglang.py`` and ``_vllm.py`` say how each engine is launched and installed (their ``SGLangServer``,
``VLLMServer`` and ``skip_reason()``), and name their :class:`Engine`.

**The checks** (``test_sglang_real.py``, ``test_vllm_real.py``): an :class:`Engine` holds what the two files check
alike, with the engine's name (``--backend``, the launch events ``<name>_launch``/``<name>_started``, the child's
logger) and how long its admin calls may take: the admin API helpers (``admin``, ``load``, ``turns_of``), the
trainer's re-scoring of recorded tokens, ``--<engine>-launch``, and two replicas behind one loopwise (``start_pair``:
an adapter on both, an alias flip, a replica killed under load and restarted). What differs between the engines
(how a lost adapter comes back, how a restarted replica's requests are counted, the launch flags) stays in each file.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx
import pytest

from runtime.engines.launcher import free_port, live_group_members
from runtime.engines.sglang_launcher import SGLangLauncher
from runtime.engines.vllm_launcher import VLLMLauncher
from tests.runtime._client import chat_body, post_chat, stream_chat

_ASKED = os.environ.get("LOOPWISE_TEST_ENGINES", "").replace(",", " ").split()
ENGINES = bool(_ASKED) and _ASKED != ["0"]
ASKED_TEXT = " ".join(_ASKED)
ADMIN = "adm"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


def asked(engine: str) -> bool:
    return ENGINES and ("1" in _ASKED or engine in _ASKED)


L = TypeVar("L", SGLangLauncher, VLLMLauncher)


class EngineServer(Generic[L]):
    """One real engine server on a fixed free port, started here; ``launcher(url)`` makes its launcher."""

    def __init__(self, launcher: Callable[[str], L]) -> None:
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.launcher: L = launcher(self.url)
        self.start()

    @property
    def model_path(self) -> Path:
        return self.launcher.model_path

    def start(self) -> None:
        self.launcher.start()

    def alive(self) -> bool:
        return self.launcher.proc is not None and self.launcher.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server's whole process group (the server and its workers: a crash, not a shutdown)."""
        proc = self.launcher.proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        self.launcher.stop()

    def adapters(self) -> set[str]:
        """The adapter names the server itself lists (``/v1/models`` entries with a parent)."""
        data = httpx.get(self.url + "/v1/models", timeout=30).json()["data"]
        return {m["id"] for m in data if m.get("parent")}


def replica_metric(srv: Any, name: str) -> dict[str, float]:
    """A loopwise metric labelled by replica, per replica (``"0"``: A, ``"1"``: B)."""
    out = {}
    for line in httpx.get(srv.base_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('replica="')[1].split('"')[0]] = float(value)
    return out


@dataclass(frozen=True)
class Engine:
    """One real engine's tests: its name (``sglang``, ``vllm``), how it is written (``SGLang``, ``vLLM``) and how long
    an admin call to the loopwise in front of it may take (``admin_timeout``, seconds)."""

    name: str
    label: str
    admin_timeout: float

    def skip_reason(self, not_installed: str | None) -> str | None:
        """Why this engine's real servers do not run here: ``not_installed`` (its virtualenv is missing), this is the
        default suite (``make test-engines`` runs them), or the engines asked for leave it out; None when they run."""
        if not_installed:
            return not_installed
        real = f"real {self.label} servers"
        if not ENGINES:
            return f"{real}: `make test-engines` runs this (the default suite leaves real engines out to stay within its time budget)"
        if not asked(self.name):
            return f"{real}: not among the engines asked for (LOOPWISE_TEST_ENGINES={ASKED_TEXT!r}; `make test-engines ENGINES={self.name}`)"
        return None

    # -- the admin API -------------------------------------------------------------------------------

    def admin(self, srv: Any, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, srv.base_url + path, headers=AUTH, timeout=self.admin_timeout, **kw)

    def load(self, srv: Any, root: Path, name: str, family: str, **kw: Any) -> httpx.Response:
        return self.admin(srv, "POST", "/admin/adapters", json={"path": str(root / name), "family": family, **kw})

    def turns_of(self, srv: Any, trajectory_id: str, timeout: float = 20) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.admin(srv, "GET", f"/admin/trajectories/{trajectory_id}")
            if r.status_code == 200:
                turns: list[dict[str, Any]] = r.json()["turns"]
                return turns
            time.sleep(0.1)
        raise AssertionError(f"trajectory {trajectory_id} was not recorded")

    # -- one server ----------------------------------------------------------------------------------

    def make_adapters(self, model: Path, tmp_path_factory: pytest.TempPathFactory, seed: int) -> Path:
        """Three rank-4 adapters of ``model`` (``a0``..``a2``, seeds ``seed``..``seed + 2``) in a fresh adapter root."""
        from tests.runtime.test_adapter_serving import make_adapter

        root: Path = tmp_path_factory.mktemp(f"{self.name}-adapters") / "adapters"
        for k in range(3):
            make_adapter(model, root / f"a{k}", seed=seed + k, r=4)
        return root

    def check_rescored_logprobs(self, srv: Any, model: Path, *, tolerance: float, timeout: float = 60, **trainer: Any) -> None:
        """The recorded output ids, re-scored by the trainer (``LoRATrainer.token_logprobs``, ``TrainerConfig(**trainer)``),
        give the engine's recorded logprobs, which are of ``logits / T``: checked at T = 1 and T = 0.7, where raw logits
        would be far off."""
        from learner.config import LoRAConfig, TrainerConfig
        from learner.samples import Sample
        from learner.trainer import LoRATrainer

        cfg = TrainerConfig(threads=1, progress=False, **trainer)
        rescorer = LoRATrainer(model, cfg, LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj"]))
        for temperature in (1.0, 0.7):
            r = post_chat(srv, chat_body(max_tokens=24, temperature=temperature, seed=5, ignore_eos=True), timeout=timeout)
            assert r.status_code == 200, r.text
            [turn] = self.turns_of(srv, r.json()["loopwise"]["trajectory_id"])
            assert len(turn["output_ids"]) == 24 and len(turn["logprobs"]) == 24

            def sample(t: float, turn: dict[str, Any] = turn) -> Sample:
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

            [rescored] = rescorer.token_logprobs([sample(temperature)], adapter=False)
            diff = max(abs(a - b) for a, b in zip(rescored, turn["logprobs"], strict=True))
            print(f"T={temperature}: largest |trainer - {self.label}| logprob difference {diff:.2e} over 24 tokens")
            assert diff < tolerance, (temperature, diff)
            if temperature != 1.0:  # the logprobs are of logits / T: the raw distribution is measurably different
                [raw] = rescorer.token_logprobs([sample(1.0)], adapter=False)
                assert max(abs(a - b) for a, b in zip(raw, turn["logprobs"], strict=True)) > 0.05

    def check_launch(self, srv: Any, flags: Sequence[str]) -> str:
        """``srv`` (a loopwise that launched its engine) answers; the launch command has ``flags``; the child's output is
        in loopwise's JSON log; stopping loopwise leaves nothing of the engine's process group. The launch command."""
        assert post_chat(srv, chat_body(max_tokens=3), timeout=120).status_code == 200
        events = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
        [launch] = [e["command"] for e in events if e["event"] == f"{self.name}_launch"]
        for flag in flags:
            assert flag in launch, (flag, launch)
        assert any(e.get("logger") == self.name for e in events)  # the child's output, in our JSON log
        [pid] = [e["pid"] for e in events if e["event"] == f"{self.name}_started"]
        srv.stop()
        assert live_group_members(pid) == []  # the whole process group (the server and its workers) is gone
        return str(launch)

    # -- two replicas ----------------------------------------------------------------------------------

    def start_pair(self, start_server: Callable[..., Any], a: EngineServer[Any], b: EngineServer[Any], adapter_root: Path, model: Path) -> Any:
        """A loopwise in front of replicas ``a`` and ``b`` (``srv.a``, ``srv.b``), sync durability, in its own process."""
        srv = start_server(
            *("--backend", self.name, "--engine-url", a.url, "--engine-url", b.url, "--engine-health-interval", "0.5"),
            *("--admin-key", ADMIN, "--adapter-root", str(adapter_root), "--max-lora-rank", "8", "--durability", "sync"),
            model=model,
            process=True,  # its log is read for the replica events
        )
        srv.a, srv.b = a, b
        return srv

    def load_on_both(self, pair: Any, adapter_root: Path) -> tuple[str, str]:
        """Loads ``a0`` as ``fam@1``: each replica has it, under its own fresh name. B's name, and ``fam@1``'s greedy answer."""
        assert self.load(pair, adapter_root, "a0", "fam").status_code == 200
        on_a = {n for n in pair.a.adapters() if n.startswith("fam@1-")}
        on_b = {n for n in pair.b.adapters() if n.startswith("fam@1-")}
        assert len(on_a) == len(on_b) == 1 and on_a != on_b  # each server has it, under its own fresh name
        want = post_chat(pair, {**chat_body(max_tokens=8, temperature=0), "model": "fam@1"}).json()["choices"][0]["message"]["content"]
        return on_b.pop(), want

    @staticmethod
    def answers_as_before(pair: Any, want: str) -> None:
        """Six new sessions (both replicas) asking ``fam@1`` all get ``want``."""
        for k in range(6):
            r = post_chat(pair, {**chat_body(max_tokens=8, temperature=0), "model": "fam@1"}, headers={"X-Session-Id": f"lost-{k}"})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == want

    def unload_from_both(self, pair: Any) -> None:
        """Unloading ``fam@1`` removes it from both replicas."""
        assert self.admin(pair, "DELETE", "/admin/adapters/fam@1").status_code == 200
        assert not any(n.startswith("fam@") for n in pair.a.adapters() | pair.b.adapters())

    def check_alias_flip(self, pair: Any, adapter_root: Path) -> None:
        """An alias flipped to ``flip@2`` is what both replicas serve under the alias."""
        assert self.load(pair, adapter_root, "a1", "flip", alias=True).status_code == 200
        assert self.load(pair, adapter_root, "a2", "flip").status_code == 200
        want = post_chat(pair, {**chat_body(max_tokens=8, temperature=0), "model": "flip@2"}).json()["choices"][0]["message"]["content"]
        assert self.admin(pair, "PUT", "/admin/aliases/flip", json={"target": "flip@2"}).status_code == 200
        before = replica_metric(pair, "loopwise_engine_replica_requests_total")
        for k in range(8):  # new sessions: least loaded, so both replicas serve
            r = post_chat(pair, {**chat_body(max_tokens=8, temperature=0), "model": "flip"}, headers={"X-Session-Id": f"flip-{k}"})
            assert r.status_code == 200 and r.json()["loopwise"]["adapter"] == "flip@2"
            assert r.json()["choices"][0]["message"]["content"] == want
        after = replica_metric(pair, "loopwise_engine_replica_requests_total")
        assert after["0"] > before["0"] and after["1"] > before["1"], (before, after)

    def check_kill_under_load_and_restart(self, pair: Any, served_by_b: Callable[[], float]) -> None:
        """Killing B under load (six clients, streamed and not) loses no answered turn (cut streams are recorded as
        aborted) and the survivor serves on; B restarted gets ``flip@1`` and ``flip@2`` back and is routed to again
        (``served_by_b()``, a count of the requests B served, grows)."""
        results: list[dict[str, Any]] = []
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
            [turn] = self.turns_of(pair, r["trajectory"])
            assert turn["finish_reason"] == "length" and len(turn["output_ids"]) == 64
        for r in cut:  # streams cut when B died: the client got an error event, the store an aborted turn
            [turn] = self.turns_of(pair, r["trajectory"])
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
        before = served_by_b()
        for k in range(8):
            back = post_chat(pair, {**chat_body(max_tokens=4), "model": "flip"}, headers={"X-Session-Id": f"back-{k}"})
            assert back.status_code == 200 and back.json()["loopwise"]["adapter"] == "flip@2"
        assert served_by_b() > before  # routed to again
