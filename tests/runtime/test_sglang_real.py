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

What vLLM's tests check alike is said once, in ``_engines.Engine`` (``SGLANG``); what is SGLang's own stays here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from tests.runtime import _sglang
from tests.runtime._client import chat_body, post_chat, stream_chat
from tests.runtime._engines import ADMIN, replica_metric
from tests.runtime._sglang import SGLANG, SGLangServer, sglang_python

URL = os.environ.get("LOOPWISE_SGLANG_URL")
pytestmark = pytest.mark.sglang
admin, load = SGLANG.admin, SGLANG.load


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
    return SGLANG.make_adapters(target[1], tmp_path_factory, seed=80)


@pytest.fixture(scope="module")
def real(start_server, target, adapter_root):
    url, model = target
    return start_server("--backend", "sglang", "--sglang-url", url, "--admin-key", ADMIN, "--adapter-root", str(adapter_root), model=model)


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
    tolerance = 0.05 if URL else 2e-3  # a GPU server may run bf16; the CPU one runs float32, as the trainer does here (no autocast)
    SGLANG.check_rescored_logprobs(real, target[1], tolerance=tolerance, timeout=120, autocast="off")


def test_sglang_launch_runs_the_virtualenvs_python_and_stops_it(cpu_only, start_server, tiny_model_path):
    flags = ("--backend", "sglang", "--sglang-launch", "--sglang-python", str(sglang_python()), "--dtype", "float32")
    srv = start_server(*flags, "--sglang-max-total-tokens", "4096", "--max-loaded-adapters", "3", "--max-lora-rank", "8", model=tiny_model_path)
    launch = SGLANG.check_launch(
        srv,
        (
            "--enable-lora",
            "--max-lora-rank 8",
            "--max-loras-per-batch 4",
            "--max-loaded-loras 4",
            "--device cpu",
            "--attention-backend torch_native",
            "--lora-backend torch_native",
            "--max-total-tokens 4096",
            "--dtype float32",
        ),
    )
    assert launch.startswith(f"{sglang_python()} -m sglang.launch_server") and sys.executable not in launch


# ---- two replicas (this machine's CPU servers) ----------------------------------------------------


@pytest.fixture(scope="module")
def replica_b(cpu_only, tiny_model_path):
    server = SGLangServer(tiny_model_path)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pair(start_server, sglang_server, replica_b, adapter_root, tiny_model_path):
    return SGLANG.start_pair(start_server, sglang_server, replica_b, adapter_root, tiny_model_path)


def test_an_adapter_reaches_both_replicas_and_sglang_reloads_one_unloaded_behind_our_back(pair, adapter_root):
    lost, want = SGLANG.load_on_both(pair, adapter_root)
    # B unloads it behind our back; SGLang loads a name it loaded once again on the next request that names it
    httpx.post(pair.b.url + "/unload_lora_adapter", json={"lora_name": lost}, timeout=60).raise_for_status()
    assert lost not in pair.b.adapters()
    SGLANG.answers_as_before(pair, want)
    assert lost in pair.b.adapters()
    SGLANG.unload_from_both(pair)


def test_an_alias_flip_reaches_both_replicas(pair, adapter_root):
    SGLANG.check_alias_flip(pair, adapter_root)


def test_killing_a_replica_under_load_loses_no_answered_turn_and_a_restart_gets_its_adapters_back(pair):
    SGLANG.check_kill_under_load_and_restart(pair, lambda: replica_metric(pair, "loopwise_engine_replica_requests_total").get("1", 0.0))
