"""The fake SGLang and a real one answer SGLang's native API alike: the same requests, the same checks, against both.

``sglang`` is parametrized: ``fake`` (``tests/fakes/sglang_server.py``, in the default suite) and ``real`` (SGLang
0.5.21's CPU path from ``make sglang``, marked ``engines("sglang")``: ``make test-engines`` runs it, elsewhere it
is skipped with the reason). Both run on the tiny model with the flags ``--sglang-launch`` gives a server for
``--max-loaded-adapters 2``: LoRA rank up to 8, 3 slots per batch, 3 adapters loaded at most.

What loopwise relies on, each checked on both:

- ``/get_server_info`` and ``/get_model_info`` carry the fields loopwise reads; ``/health_generate`` answers 200;
- ``/generate`` with ``input_ids`` and logprobs: ``output_ids``, ``finish_reason`` objects, ``[logprob, id, text]``
  triples and their top-k, prompt logprobs from ``logprob_start_len`` 0 (the first null); a stream of cumulative
  events ending in ``[DONE]`` whose last event is the non-streamed answer (greedy);
- ``sampling_seed`` is ignored without ``--enable-deterministic-inference`` (found against the real server: two
  requests with one seed sample differently; the flag needs a GPU attention backend, so the CPU path never has it);
- LoRA: load, list (``/v1/models``), a second load of the name refused ("already loaded"), a rank above
  ``--max-lora-rank`` refused, generate with the name, unload; a request naming an *unloaded* adapter is served
  (SGLang loads it again from its path, found by the CPU trial); a name never loaded is refused with HTTP 400 (and
  in a stream, an error event) that loopwise reads as :class:`AdapterGone`; an unload of an unknown name is refused
  ("does not exist"); a load past ``--max-loaded-loras`` evicts the least recently used adapter, which the next
  request naming it brings back.

Not here: numbers (the fake computes with loopwise's embedded engine, not SGLang's kernels) and error texts beyond
the phrases loopwise matches on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.engine import AdapterError
from runtime.engines.http_engine import AdapterGone
from runtime.engines.sglang import translate_error
from tests.fakes.sglang_process import FakeSGLang
from tests.runtime import _sglang
from tests.runtime._sglang import SGLangServer
from tests.runtime.test_adapter_serving import make_adapter

IDS = [1, 5, 17, 42, 99, 7, 3]
FLAGS = ("--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "--max-loras-per-batch", "3", "--max-loaded-loras", "3")


@pytest.fixture(scope="module", params=["fake", pytest.param("real", marks=pytest.mark.engines("sglang"))])
def sglang(request: pytest.FixtureRequest, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An SGLang server of each kind on the tiny model: ``.url``; stopped after the module."""
    if request.param == "fake":
        server: Any = FakeSGLang(tiny_model_path, tmp_path_factory.mktemp("contract-fake"), *FLAGS)
    else:
        reason = _sglang.skip_reason()
        if reason:
            pytest.skip(reason)
        server = SGLangServer(tiny_model_path, max_loaded_adapters=2)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("contract-adapters")
    for k in range(4):
        make_adapter(tiny_model_path, root / f"a{k}", seed=90 + k, r=4)
    make_adapter(tiny_model_path, root / "rank16", seed=99, r=16)
    return root


def post(sglang: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(sglang.url + path, json=body, timeout=300)


def generate(sglang: Any, **kw: Any) -> httpx.Response:
    body = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}, **kw}
    return post(sglang, "/generate", body)


def stream(sglang: Any, **kw: Any) -> tuple[int, list[dict[str, Any]], bool]:
    """(status, the JSON events, whether ``[DONE]`` ended it) of a streamed ``/generate``."""
    body = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}, "stream": True, **kw}
    events, done = [], False
    with httpx.stream("POST", sglang.url + "/generate", json=body, timeout=300) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            events.append(json.loads(data))
        return resp.status_code, events, done


def listed(sglang: Any) -> set[str]:
    data = httpx.get(sglang.url + "/v1/models", timeout=30).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


def lora(sglang: Any, op: str, name: str, path: Path | None = None) -> httpx.Response:
    body: dict[str, Any] = {"lora_name": name}
    if path is not None:
        body |= {"lora_path": str(path), "pinned": False}
    return post(sglang, f"/{op}_lora_adapter", body)


def test_info_and_health(sglang):
    info = httpx.get(sglang.url + "/get_server_info", timeout=30).json()
    assert info["enable_lora"] is True and info["max_loras_per_batch"] == 3 and info["max_loaded_loras"] == 3
    assert info["incremental_streaming_output"] is False and "context_length" in info and info["version"].startswith("0.5.21")
    assert info["enable_deterministic_inference"] is False
    assert httpx.get(sglang.url + "/get_model_info", timeout=30).json()["model_path"]
    assert httpx.get(sglang.url + "/health_generate", timeout=60).status_code == 200


def test_generate_with_token_ids_and_logprobs_streamed_and_not(sglang):
    r = generate(sglang, return_logprob=True, top_logprobs_num=2)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 4 and all(isinstance(t, int) for t in out["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == len(IDS) and meta["completion_tokens"] == 4
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(isinstance(t[0], float) and t[0] <= 0 for t in meta["output_token_logprobs"])
    assert [len(top) for top in meta["output_top_logprobs"]] == [2] * 4
    assert all(top[0][1] == t for top, t in zip(meta["output_top_logprobs"], out["output_ids"], strict=True))  # greedy: the best

    status, events, done = stream(sglang, return_logprob=True, top_logprobs_num=2)
    assert status == 200 and done and events
    assert [len(e["output_ids"]) for e in events] == sorted(len(e["output_ids"]) for e in events)  # cumulative
    assert events[-1]["output_ids"] == out["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert [t[1] for t in events[-1]["meta_info"]["output_token_logprobs"]] == out["output_ids"]

    scored = generate(sglang, return_logprob=True, logprob_start_len=0, top_logprobs_num=1).json()["meta_info"]
    inputs = scored["input_token_logprobs"]
    assert len(inputs) == len(IDS) and inputs[0][0] is None and [t[1] for t in inputs] == IDS
    assert all(isinstance(t[0], float) for t in inputs[1:])


def test_a_seed_is_ignored_without_deterministic_inference(sglang):
    sampled = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1234}
    a, b = (post(sglang, "/generate", {"input_ids": IDS, "sampling_params": sampled}) for _ in range(2))
    assert a.status_code == b.status_code == 200
    assert a.json()["output_ids"] != b.json()["output_ids"]  # 16 tokens at T = 1 from the tiny model: equal by chance ~never


def test_lora_load_use_unload_and_an_unloaded_name_is_loaded_again_on_request(sglang, adapters):
    r = lora(sglang, "load", "c0", adapters / "a0")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert "c0" in r.json()["loaded_adapters"] and "c0" in listed(sglang)
    again = lora(sglang, "load", "c0", adapters / "a0")
    assert again.status_code == 400 and again.json()["success"] is False and "already loaded" in again.json()["error_message"]
    big = lora(sglang, "load", "big", adapters / "rank16")
    assert big.status_code == 400 and "rank" in big.json()["error_message"] and "big" not in listed(sglang)

    used = generate(sglang, lora_path="c0")
    assert used.status_code == 200, used.text
    assert lora(sglang, "unload", "c0").status_code == 200
    assert "c0" not in listed(sglang)
    # SGLang remembers every name it loaded: a request naming an unloaded one loads it again from its path
    back = generate(sglang, lora_path="c0")
    assert back.status_code == 200, back.text
    assert back.json()["output_ids"] == used.json()["output_ids"]
    assert "c0" in listed(sglang)
    assert lora(sglang, "unload", "c0").status_code == 200
    gone = lora(sglang, "unload", "c0")
    assert gone.status_code == 400 and "does not exist" in gone.json()["error_message"]
    assert isinstance(translate_error(400, {"error": {"message": gone.json()["error_message"]}}), AdapterError)


def test_a_name_never_loaded_is_refused_as_gone(sglang):
    r = generate(sglang, lora_path="never-loaded")
    assert r.status_code == 400
    err = translate_error(r.status_code, r.json())
    assert type(err) is AdapterGone and "never-loaded" in str(err)  # what a restarted SGLang answers for our adapters
    status, events, done = stream(sglang, lora_path="never-loaded")
    assert status == 200 and done and len(events) == 1
    assert events[0]["error"]["code"] == 400
    assert type(translate_error(400, events[0])) is AdapterGone


def test_a_load_past_max_loaded_loras_evicts_the_least_recently_used(sglang, adapters):
    for k in range(3):
        assert lora(sglang, "load", f"e{k}", adapters / f"a{k}").status_code == 200
    assert generate(sglang, lora_path="e0").status_code == 200  # e0 used: e1 is now the least recently used
    r = lora(sglang, "load", "e3", adapters / "a3")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert listed(sglang) == {"e0", "e2", "e3"}
    assert generate(sglang, lora_path="e1").status_code == 200  # evicted, so loaded again (evicting e2)
    assert listed(sglang) == {"e0", "e1", "e3"}
    for name in sorted(listed(sglang)):
        assert lora(sglang, "unload", name).status_code == 200
    assert listed(sglang) == set()
