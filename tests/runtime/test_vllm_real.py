"""loopwise in front of real vLLM servers (vLLM's CPU build): exact tokens, ``--vllm-launch``, two replicas.

Marked ``engines``: ``make test-engines`` runs them (with the shared backend suite on vllm); the default
suite skips them with the reason. Servers: ``vllm_server`` (A, shared with the backend suite) and a
second one started here (B), both on the tiny model with head_dim 32, float32. What SGLang's tests check alike
is said once, in ``_engines.Engine`` (``VLLM``); what is vLLM's own stays here.

- the recorded output ids, re-scored by the trainer (``LoRATrainer.token_logprobs``), give vLLM's
  recorded logprobs (``logits / T``: checked at T = 1 and T = 0.7, where raw logits would be far off);
- ``--vllm-launch`` starts vLLM with the flags loopwise needs, forwards its log, stops it on shutdown;
- two replicas: an adapter reaches both under fresh names; a replica that lost an adapter behind our back
  is routed around and gets it back; an alias flip reaches both; killing one replica under load loses no
  answered turn (cut streams are recorded as aborted) and the survivor serves on; the restarted replica
  gets its adapters back and is routed to again.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.runtime._engines import ADMIN
from tests.runtime._vllm import VLLM, VLLMServer

pytestmark = pytest.mark.engines


@pytest.fixture(scope="module")
def adapter_root(tiny_h32_path, tmp_path_factory) -> Path:
    return VLLM.make_adapters(tiny_h32_path, tmp_path_factory, seed=70)


def test_recorded_tokens_rescored_by_the_trainer_match_vllms_logprobs(start_server, vllm_server, tiny_h32_path):
    srv = start_server("--backend", "vllm", "--engine-url", vllm_server.url, "--admin-key", ADMIN, model=tiny_h32_path)
    VLLM.check_rescored_logprobs(srv, tiny_h32_path, tolerance=2e-3)


def test_vllm_launch_starts_vllm_and_stops_it(start_server, tiny_h32_path):
    srv = start_server(
        *("--backend", "vllm", "--vllm-launch", "--vllm-kv-cache", "64M", "--dtype", "float32", "--max-loaded-adapters", "3", "--max-lora-rank", "4"),
        model=tiny_h32_path,
    )
    flags = ("serve", "--enable-lora", "--max-lora-rank 8", "--max-loras 3", "--max-cpu-loras 4", "--logprobs-mode processed_logprobs")
    VLLM.check_launch(srv, flags)


# ---- two replicas ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replica_b(tiny_h32_path):
    server = VLLMServer(tiny_h32_path)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pair(start_server, vllm_server, replica_b, adapter_root, tiny_h32_path):
    return VLLM.start_pair(start_server, vllm_server, replica_b, adapter_root, tiny_h32_path)


def test_an_adapter_reaches_both_replicas_and_a_lost_one_is_routed_around_then_reloaded(pair, adapter_root):
    lost, want = VLLM.load_on_both(pair, adapter_root)
    # B loses it behind our back (as a restart between two probes would)
    httpx.post(pair.b.url + "/v1/unload_lora_adapter", json={"lora_name": lost}, timeout=30).raise_for_status()
    VLLM.answers_as_before(pair, want)
    deadline = time.monotonic() + 30
    while not any(n.startswith("fam@1-") for n in pair.b.adapters()):
        assert time.monotonic() < deadline, "B did not get the adapter back"
        time.sleep(0.2)
    VLLM.unload_from_both(pair)


def test_an_alias_flip_reaches_both_replicas(pair, adapter_root):
    VLLM.check_alias_flip(pair, adapter_root)


def test_killing_a_replica_under_load_loses_no_answered_turn_and_a_restart_gets_its_adapters_back(pair, adapter_root):
    VLLM.check_kill_under_load_and_restart(pair, pair.b.finished_requests)  # routed to again, with the adapter reloaded
