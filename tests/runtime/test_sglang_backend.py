"""The SGLang backend's own behaviour and failure paths, against the fake SGLang server and real processes.

Covered here (the shared chat/streaming/tools/recording/adapter tests run on both backends elsewhere):
error-body translation; cumulative vs incremental stream decoding; the settings rule that keeps one
LoRA slot free for base requests; SGLang down at startup (exit code and message); an SGLang load failure
leaving the registry unchanged; fresh SGLang names per load; ``n > 1`` as separate ``/generate`` calls;
SGLang dying mid-stream (error event, aborted turn, /health unhealthy, then recovering); the launcher (its
command on CPU and GPU, ``--sglang-python``, and a launch of the fake). What the fake answers is checked against
a real SGLang by ``test_sglang_contract.py``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

import serve
from loopwise_settings import Settings
from runtime.engine import AdapterError, EngineClosed, EngineError, EngineOverloaded, GenerateRequest, InvalidRequest, SamplingParams
from runtime.engines.http_engine import AdapterGone
from runtime.engines.launcher import LaunchError
from runtime.engines.sglang import _Decoder, translate_error
from runtime.engines.sglang_launcher import SGLangLauncher
from runtime.settings import SGLangSettings
from tests.fakes.sglang_process import FakeSGLang
from tests.runtime._client import assert_error, chat_body, post_chat, stream_chat
from tests.runtime.test_adapter_serving import make_adapter

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "adm"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


# ---- pure parts -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "kind", "code"),
    [
        (400, {"error": {"message": "The following requested LoRA adapters are not loaded: x@1-ab\nLoaded adapters: []."}}, AdapterGone, None),
        (400, {"error": {"message": "Got LoRA adapter that has never been loaded: x@1-ab\nAll loaded adapters: dict_keys([])."}}, AdapterGone, None),
        (400, {"error": {"message": "Failed to implicitly load LoRA adapter x@1-ab: no such file"}}, AdapterError, None),
        (400, {"success": False, "error_message": "LoRA with name x@1-ab does not exist. Loaded LoRAs: odict_keys([])"}, AdapterError, None),
        (
            400,
            {"error": {"message": "The input (3000 tokens) is longer than the model's context length (2048 tokens)."}},
            InvalidRequest,
            "context_length_exceeded",
        ),
        (400, {"object": "error", "message": "Invalid stop string", "type": "BadRequestError", "param": None, "code": 400}, InvalidRequest, None),
        (400, {"error": {"message": "bad grammar", "type": "invalid_request_error", "code": 400}}, InvalidRequest, None),
        (
            400,
            {"success": False, "error_message": "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", "loaded_adapters": {}},
            AdapterError,
            None,
        ),
        (503, {"error": {"message": "The request queue is full."}}, EngineOverloaded, None),
        (429, "Too Many Requests", EngineOverloaded, None),
        (503, "", EngineClosed, None),
        (500, {"error": {"message": "CUDA error: an illegal memory access"}}, EngineError, None),
    ],
)
def test_sglang_error_bodies_become_engine_errors(status, body, kind, code):
    err = translate_error(status, body)
    assert type(err) is kind, (type(err), err)
    assert str(err)
    if code is not None:
        assert err.code == code  # type: ignore[attr-defined]


def test_cumulative_and_incremental_streams_decode_to_the_same_chunks(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = tok.encode("hello there general kenobi", add_special_tokens=False)
    lps = [[-0.5 - k, t, None] for k, t in enumerate(ids)]
    tops = [[[-0.1, t, None], [-2.0, 7, None]] for t in ids]
    req = GenerateRequest("r", (1, 2), SamplingParams(max_new_tokens=len(ids), logprobs=True, top_logprobs=2))

    def meta(upto: int, lo: int, final: bool) -> dict:
        return {
            "finish_reason": {"type": "length", "length": upto} if final else None,
            "output_token_logprobs": lps[lo:upto],
            "output_top_logprobs": tops[lo:upto],
        }

    def run(incremental: bool) -> list:
        dec = _Decoder(req, tok, incremental)
        out = []
        for k in range(1, len(ids) + 1):
            lo = k - 1 if incremental else 0
            chunk = dec.feed({"output_ids": ids[lo:k], "meta_info": meta(k, lo, k == len(ids))})
            out.append((chunk.token_ids, chunk.text, [(lp.token_id, lp.logprob, lp.top) for lp in chunk.logprobs], chunk.finish_reason))
        return out

    cumulative, incremental = run(False), run(True)
    assert cumulative == incremental
    assert [c[0] for c in cumulative] == [(t,) for t in ids]  # new tokens only, one per event
    assert "".join(c[1] for c in cumulative) == tok.decode(ids, skip_special_tokens=True)
    assert cumulative[0][2] == [(ids[0], -0.5, ((ids[0], -0.1), (7, -2.0)))]
    assert cumulative[-1][3] == "length"


def test_one_lora_slot_stays_free_for_base_requests():
    with pytest.raises(ValidationError, match="23141"):
        Settings.model_validate(
            {"server": {"backend": "sglang"}, "sglang": {"url": "http://x:1", "max_loras_per_batch": 8}, "adapters": {"max_loaded_adapters": 8}}
        )
    ok = Settings.model_validate({"server": {"backend": "sglang"}, "sglang": {"url": "http://x:1"}, "adapters": {"max_loaded_adapters": 8}})
    assert ok.sglang.slots(ok.adapters.max_loaded_adapters) == 9  # default: one more than the adapters


def test_sglang_down_at_startup_fails_clearly(tiny_model_path, tmp_path):
    cmd = [sys.executable, str(ROOT / "serve.py"), "--model", str(tiny_model_path), "--data-dir", str(tmp_path), "--port", "0"]
    r = subprocess.run([*cmd, "--backend", "sglang", "--sglang-url", "http://127.0.0.1:1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "error: cannot reach SGLang at http://127.0.0.1:1" in r.stderr, r.stderr[-2000:]
    assert "--sglang-launch" in r.stderr  # it says what to do
    assert "Traceback" not in r.stderr
    # no URL and nothing to launch: refused by the flags alone, before any engine (in process: a second start adds nothing)
    settings = serve.settings_from_args(["--model", str(tiny_model_path), "--data-dir", str(tmp_path), "--backend", "sglang"])
    with pytest.raises(SystemExit, match="error: --backend sglang needs --sglang-url URL"):
        serve.build_external_engine(settings, tiny_model_path, "tiny")


# ---- against a fake SGLang with a small rank limit and 4 LoRA slots -------------------------------


@pytest.fixture(scope="module")
def fake(tiny_model_path, tmp_path_factory):
    f = FakeSGLang(
        tiny_model_path,
        tmp_path_factory.mktemp("fake-small"),
        *("--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "all", "--max-loras-per-batch", "4", "--max-loaded-loras", "8"),
    )
    yield f
    f.stop()


@pytest.fixture(scope="module")
def adapters(tiny_model_path, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sglang-adapters") / "adapters"
    for k in range(4):
        make_adapter(tiny_model_path, root / f"a{k}", seed=50 + k, r=4)
    make_adapter(tiny_model_path, root / "rank8", seed=60, r=8)
    return root


class _Warnings(logging.Handler):
    """The messages of the warnings a logger logs while attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def started(start_server, fake, adapters) -> tuple[Any, list[str]]:
    """``serve.py``'s app against the small fake (in process), and the warnings ``serve`` logged while it was built."""
    flags = ["--backend", "sglang", "--sglang-url", fake.url, "--admin-key", ADMIN, "--adapter-root", str(adapters), "--max-lora-rank", "8"]
    warnings, log = _Warnings(), logging.getLogger("serve")
    level = log.level
    log.addHandler(warnings)
    log.setLevel(logging.WARNING)  # whatever another test left the root logger at
    try:
        server = start_server(*flags)
    finally:
        log.removeHandler(warnings)
        log.setLevel(level)
    return server, warnings.messages


@pytest.fixture(scope="module")
def srv(started):
    return started[0]


def _load(srv, path: Path, family: str, **kw) -> httpx.Response:
    return httpx.post(srv.base_url + "/admin/adapters", json={"path": str(path), "family": family, **kw}, headers=AUTH, timeout=60)


def _listed(srv) -> list[dict]:
    return httpx.get(srv.base_url + "/admin/adapters", headers=AUTH, timeout=10).json()["data"]


def _fake_loaded(fake) -> dict[str, str]:
    return httpx.get(fake.url + "/fake/stats", timeout=10).json()["loaded"]


def test_registry_is_capped_below_sglangs_lora_slots(started, fake, adapters):
    # SGLang runs with --max-loras-per-batch 4; base requests take one slot, so loopwise serves 3 adapters at most
    srv, warnings = started
    assert any("serving at most 3 adapters" in m for m in warnings), warnings
    for k in range(4):
        r = _load(srv, adapters / f"a{k}", f"cap{k}")
        assert r.status_code == 200, r.text
    assert sum(a["state"] == "ready" for a in _listed(srv)) == 3  # the least recently used one left routing at once
    deadline = time.monotonic() + 30  # and is unloaded from SGLang behind the swap
    while (len(_listed(srv)), len(_fake_loaded(fake))) != (3, 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_listed(srv)) == 3 and len(_fake_loaded(fake)) == 3
    for a in _listed(srv):
        httpx.delete(srv.base_url + f"/admin/adapters/{a['name']}", headers=AUTH, timeout=60).raise_for_status()
    assert _fake_loaded(fake) == {}


def test_sglang_load_failure_leaves_the_registry_unchanged(srv, fake, adapters):
    assert _load(srv, adapters / "a0", "keep").status_code == 200
    before_list, before_models, before_fake = _listed(srv), httpx.get(srv.url + "/models", timeout=10).json(), _fake_loaded(fake)
    # rank 8 passes loopwise's own check (--max-lora-rank 8) but this SGLang was launched with --max-lora-rank 4
    err = assert_error(_load(srv, adapters / "rank8", "big"), 400, code="adapter_load_failed", param="path")
    assert "rank" in err["message"]
    assert _listed(srv) == before_list
    assert httpx.get(srv.url + "/models", timeout=10).json() == before_models
    assert _fake_loaded(fake) == before_fake
    assert_error(post_chat(srv, {**chat_body(max_tokens=2), "model": "big@1"}), 404, code="model_not_found")
    r = post_chat(srv, {**chat_body(max_tokens=2), "model": "keep@1"})
    assert r.status_code == 200 and r.json()["loopwise"]["adapter"] == "keep@1"
    assert _load(srv, adapters / "a1", "big").json()["name"] == "big@1"  # the failed load used up no version
    for name in ("keep@1", "big@1"):
        httpx.delete(srv.base_url + f"/admin/adapters/{name}", headers=AUTH, timeout=60).raise_for_status()


def test_a_reloaded_version_gets_a_fresh_sglang_name(srv, fake, adapters):
    assert _load(srv, adapters / "a2", "fresh").status_code == 200
    [first] = _fake_loaded(fake)
    assert first.startswith("fresh@1-")
    out1 = post_chat(srv, {**chat_body(max_tokens=6, temperature=0), "model": "fresh@1"}).json()["choices"][0]["message"]["content"]
    httpx.delete(srv.base_url + "/admin/adapters/fresh@1", headers=AUTH, timeout=60).raise_for_status()
    assert _fake_loaded(fake) == {}
    assert _load(srv, adapters / "a2", "fresh", version=1).status_code == 200  # same family@N, same files
    [second] = _fake_loaded(fake)
    assert second.startswith("fresh@1-") and second != first  # never the same SGLang name twice
    out2 = post_chat(srv, {**chat_body(max_tokens=6, temperature=0), "model": "fresh@1"}).json()["choices"][0]["message"]["content"]
    assert out1 == out2
    httpx.delete(srv.base_url + "/admin/adapters/fresh@1", headers=AUTH, timeout=60).raise_for_status()


def test_n_choices_are_separate_generate_calls(srv, fake):
    calls = httpx.get(fake.url + "/fake/stats", timeout=10).json()["generate_calls"]
    r = post_chat(srv, chat_body(max_tokens=4, n=3, temperature=1.0, seed=1))
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert httpx.get(fake.url + "/fake/stats", timeout=10).json()["generate_calls"] == calls + 3


def test_sglang_dies_mid_stream_then_comes_back(srv, fake):
    """Last in this module: it kills the fake (and with it every adapter loaded there)."""
    assert httpx.get(srv.base_url + "/health", timeout=30).status_code == 200
    httpx.post(fake.url + "/fake/die_after", json={"tokens": 3}, timeout=10).raise_for_status()
    sse = stream_chat(srv, chat_body(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True), timeout=60)
    assert sse.status == 200 and sse.done
    errors = [e for e in sse.events if "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["type"] == "server_error"
    assert not any(c.get("finish_reason") for e in sse.choice_events() for c in e["choices"])
    fake.proc.wait(timeout=10)  # the kill switch ended the process

    # the turn is recorded as aborted, with the tokens that were streamed before the failure
    traj_id = sse.headers["x-loopwise-trajectory-id"]
    deadline, traj = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        r = httpx.get(srv.base_url + f"/admin/trajectories/{traj_id}", headers=AUTH, timeout=10)
        if r.status_code == 200:
            traj = r.json()
            break
        time.sleep(0.1)
    assert traj is not None, "the aborted turn was not recorded"
    [turn] = traj["turns"]
    assert turn["finish_reason"] == "abort"
    assert 1 <= len(turn["output_ids"]) <= 3 and len(turn["logprobs"]) == len(turn["output_ids"])

    h = httpx.get(srv.base_url + "/health", timeout=30)
    assert h.status_code == 503 and h.json()["error"]["code"] == "unhealthy"
    assert_error(post_chat(srv, chat_body(max_tokens=2)), 503, type="server_error", code="engine_unavailable")
    fake.start()  # SGLang is back, on the same port
    deadline = time.monotonic() + 30
    while httpx.get(srv.base_url + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "/health did not recover"
        time.sleep(0.2)
    assert post_chat(srv, chat_body(max_tokens=2)).status_code == 200


# ---- the launcher ---------------------------------------------------------------------------------


def test_launcher_command_on_cpu_and_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPWISE_SGLANG_VENV", str(tmp_path / "no-venv"))
    own = SGLangSettings()
    assert own.python_path() == Path(sys.executable)  # no `make sglang` virtualenv: this process's Python (`.[sglang]`)
    (tmp_path / "no-venv" / "bin").mkdir(parents=True)
    (tmp_path / "no-venv" / "bin" / "python").symlink_to(sys.executable)
    assert own.python_path() == tmp_path / "no-venv" / "bin" / "python"  # installed: the virtualenv's
    assert SGLangSettings(python=Path("/x/python")).python_path() == Path("/x/python")  # --sglang-python wins

    def command(**settings: Any) -> list[str]:
        launcher = SGLangLauncher(
            SGLangSettings(python=Path(sys.executable), **settings), Path("/m"), max_lora_rank=8, max_loaded_adapters=3, dtype="float32"
        )
        return launcher.command("127.0.0.1", 30000)

    cpu = " ".join(command(device="cpu"))
    assert cpu.startswith(f"{sys.executable} -m sglang.launch_server --model-path /m")
    for flag in ("--device cpu", "--attention-backend torch_native", "--lora-backend torch_native", "--disable-overlap-schedule"):
        assert flag in cpu
    assert "--max-total-tokens 16384" in cpu and "--dtype float32" in cpu and "--max-loras-per-batch 4" in cpu
    assert "--constrained-json-disable-any-whitespace" in cpu  # compact JSON, as the learner's grammar mask reads it
    cpu_env = SGLangLauncher(SGLangSettings(device="cpu"), Path("/m"), max_lora_rank=8, max_loaded_adapters=3).child_env()
    assert cpu_env["SGLANG_USE_CPU_ENGINE"] == "1" and cpu_env["HF_HUB_OFFLINE"] == "1"
    # a flag --sglang-arg gives is not given twice; the GPU command has none of the CPU ones
    mine = command(device="cpu", max_total_tokens=2048, launch_args=("--attention-backend=intel_amx",))
    assert "--max-total-tokens" in mine and mine[mine.index("--max-total-tokens") + 1] == "2048"
    assert mine.count("--attention-backend") == 0 and mine[-1] == "--attention-backend=intel_amx"
    gpu = command(device="cuda")
    assert "--device" not in gpu and "--max-total-tokens" not in gpu and "--constrained-json-disable-any-whitespace" in gpu
    gpu_env = SGLangLauncher(SGLangSettings(device="cuda"), Path("/m"), max_lora_rank=8, max_loaded_adapters=3).child_env()
    assert "SGLANG_USE_CPU_ENGINE" not in gpu_env
    missing = SGLangLauncher(SGLangSettings(python=tmp_path / "nope"), Path("/m"), max_lora_rank=8, max_loaded_adapters=3)
    with pytest.raises(LaunchError, match="make sglang"):
        missing.command("127.0.0.1", 30000)


def test_launcher_starts_sglang_streams_its_log_and_stops_it(start_server):
    srv = start_server(
        *("--backend", "sglang", "--sglang-launch", "--sglang-launch-module", "tests.fakes.sglang_server"),
        *("--sglang-python", sys.executable, "--max-loaded-adapters", "3"),  # the fake runs on loopwise's own Python
    )
    assert post_chat(srv, chat_body(max_tokens=3)).status_code == 200
    assert httpx.get(srv.base_url + "/health", timeout=30).status_code == 200
    events = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
    [launch] = [e["command"] for e in events if e["event"] == "sglang_launch"]
    for flag in (
        "--enable-lora",
        "--max-lora-rank 64",
        "--lora-target-modules all",
        "--max-loras-per-batch 4",
        "--max-loaded-loras 4",
        "--tokenizer-worker-num 1",
    ):
        assert flag in launch, (flag, launch)
    child = [e["event"] for e in events if e.get("logger") == "sglang"]  # the child's output, in our JSON log
    assert any("fired up and ready to roll" in line for line in child), child[-5:]
    [pid] = [e["pid"] for e in events if e["event"] == "sglang_started"]
    os.kill(pid, 0)  # alive while we serve
    srv.stop()
    assert srv.proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM after a clean shutdown
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
