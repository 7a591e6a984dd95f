"""The vLLM backend's wire format, without a server: error bodies, answer decoding, request bodies, the launch command.

The bodies below are what vLLM 0.32.0 (CPU build) sent for SmolLM2 and the tiny model; the real-server
tests are ``test_vllm_real.py`` (``make test-engines``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from runtime.engine import EngineError, EngineOverloaded, GenerateRequest, Grammar, InvalidRequest, SamplingParams
from runtime.engines.http_engine import AdapterGone, LocalModel
from runtime.engines.vllm import VLLMEngine, _Decoder, translate_error
from runtime.engines.vllm_launcher import VLLMLauncher, cpu_share, lora_rank
from runtime.settings import VLLMSettings


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.mark.parametrize(
    ("status", "body", "kind", "param", "code"),
    [
        (
            404,
            {"error": {"message": "The model `x@1-ab` does not exist. Valid aliases: tiny.", "type": "NotFoundError", "param": "model", "code": 404}},
            AdapterGone,
            None,
            None,
        ),
        (
            400,
            {
                "error": {
                    "message": "This model's maximum context length is 8192 tokens. However, your prompt contains 9000 input tokens",
                    "type": "BadRequestError",
                    "param": "input_tokens",
                    "code": 400,
                }
            },
            InvalidRequest,
            "messages",
            "context_length_exceeded",
        ),
        (
            400,
            {"error": {"message": "Requested sample logprobs of 30, which is greater than max allowed: 20", "param": "logprobs", "code": 400}},
            InvalidRequest,
            "top_logprobs",
            None,
        ),
        (400, {"error": {"message": "Token id 99999999 is out of vocabulary", "param": None, "code": 400}}, InvalidRequest, None, None),
        (429, {"error": {"message": "Too Many Requests"}}, EngineOverloaded, None, None),
        (500, {"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "code": 500}}, EngineError, None, None),
    ],
)
def test_vllm_error_bodies_become_engine_errors(status, body, kind, param, code):
    err = translate_error(status, body)
    assert type(err) is kind, (type(err), err)
    if kind is InvalidRequest:
        assert (err.param, err.code) == (param, code)  # type: ignore[attr-defined]


def _stream_chunk(ids, lps, tops, finish=None, stop=None, first=False):
    choice = {
        "index": 0,
        "text": "ignored",
        "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": lps, "top_logprobs": tops, "text_offset": [0] * len(ids)},
        "finish_reason": finish,
        "stop_reason": stop,
        "prompt_token_ids": [5, 6] if first else None,
        "token_ids": ids,
    }
    return {"id": "cmpl-x", "object": "text_completion", "choices": [choice]}


def test_stream_chunks_decode_to_the_non_streamed_answer(tok):
    ids = [*tok.encode("hello there general kenobi", add_special_tokens=False), 2]  # ... then eos
    lps = [-0.5 - k for k in range(len(ids))]
    tops = [{f"token_id:{t}": lps[k], "token_id:7": -0.1, "token_id:9": -9999.0} for k, t in enumerate(ids)]
    sp = SamplingParams(max_new_tokens=32, logprobs=True, top_logprobs=2)
    req = GenerateRequest("r", (5, 6), sp)

    whole = _Decoder(req, tok, frozenset({2})).feed(_stream_chunk(ids, lps, tops, finish="stop"))
    dec = _Decoder(req, tok, frozenset({2}))
    parts = [dec.feed(_stream_chunk(ids[:2], lps[:2], tops[:2], first=True))]
    parts += [dec.feed(_stream_chunk([t], [lps[k]], [tops[k]], finish="stop" if k == len(ids) - 1 else None)) for k, t in enumerate(ids) if k >= 2]
    assert dec.feed({"id": "cmpl-x", "choices": [], "usage": {"prompt_tokens": 2}}) is None  # the usage-only chunk
    assert whole is not None and all(p is not None for p in parts)
    assert [t for p in parts for t in p.token_ids] == list(whole.token_ids) == ids  # the eos is an output token
    assert "".join(p.text for p in parts) == whole.text == tok.decode(ids[:-1])  # and has no text
    assert parts[-1].finish_reason == whole.finish_reason == "stop"
    assert parts[-1].matched_stop == whole.matched_stop == 2  # vLLM's stop_reason is null for eos
    first = whole.logprobs[0]
    assert (first.token_id, first.logprob) == (ids[0], -0.5)
    assert first.top == ((7, -0.1), (ids[0], -0.5))  # best first, k of them; vLLM's -9999.0 stand-in is dropped below k
    masked = _Decoder(GenerateRequest("r", (5,), SamplingParams(top_logprobs=3)), tok, frozenset()).feed(_stream_chunk(ids[:1], lps[:1], tops[:1]))
    assert masked is not None and masked.logprobs[0].top[-1] == (9, -math.inf)  # -9999.0 is vLLM's JSON for -inf


def test_stop_reasons(tok):
    ids = tok.encode("a.b", add_special_tokens=False)
    req = GenerateRequest("r", (5,), SamplingParams(stop_token_ids=(ids[-1],)))
    by_id = _Decoder(req, tok, frozenset({2, ids[-1]})).feed(_stream_chunk(ids, [0.0] * len(ids), [], finish="stop", stop=ids[-1]))
    assert by_id is not None and (by_id.finish_reason, by_id.matched_stop) == ("stop", ids[-1])
    req = GenerateRequest("r", (5,), SamplingParams(stop=(".",)))
    by_text = _Decoder(req, tok, frozenset({2})).feed(_stream_chunk(ids, [0.0] * len(ids), [], finish="stop", stop="."))
    assert by_text is not None and by_text.matched_stop == "." and "." not in by_text.text
    length = _Decoder(req, tok, frozenset({2})).feed(_stream_chunk(ids[:1], [0.0], [], finish="length"))
    assert length is not None and (length.finish_reason, length.matched_stop) == ("length", None)
    with pytest.raises(EngineError, match="abort"):
        _Decoder(req, tok, frozenset({2})).feed(_stream_chunk(ids[:1], [0.0], [], finish="abort"))
    with pytest.raises(EngineError, match="token_ids"):  # a vLLM without return_token_ids
        _Decoder(req, tok, frozenset({2})).feed({"choices": [{"index": 0, "text": "hi", "finish_reason": None}]})
    with pytest.raises(EngineError, match="1 new tokens but 0 logprobs"):
        _Decoder(GenerateRequest("r", (5,), SamplingParams(logprobs=True)), tok, frozenset()).feed(_stream_chunk(ids[:1], [], []))


def test_request_body_is_token_ids_with_every_sampling_knob_explicit(tiny_model_path, tok):
    engine = VLLMEngine(
        "http://x", tiny_model_path, model_id="tiny", settings=VLLMSettings(), local=LocalModel(tiny_model_path, tok, None, 2048, 2000, (2,))
    )
    engine.served = "served-base"
    engine._names["fam@3"] = "fam@3-0123456789ab"
    sp = SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, seed=11, stop=("\n\n",), stop_token_ids=(9,), logprobs=True, top_logprobs=3)
    body = engine._body(GenerateRequest("client-chosen-id", (5, 6, 7), sp, adapter="fam@3"), "engine-id", stream=True)
    assert body["model"] == "fam@3-0123456789ab" and body["prompt"] == [5, 6, 7]
    assert body["request_id"] == "engine-id"  # never the client's X-Request-Id
    assert {k: body[k] for k in ("max_tokens", "temperature", "top_p", "seed", "stop", "stop_token_ids", "logprobs")} == {
        "max_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 11,
        "stop": ["\n\n"],
        "stop_token_ids": [9],
        "logprobs": 3,
    }
    assert (body["top_k"], body["min_p"], body["repetition_penalty"]) == (0, 0.0, 1.0)  # no server-side sampling defaults
    assert body["return_token_ids"] is True and body["return_tokens_as_token_ids"] is True and body["stream"] is True
    base = engine._body(GenerateRequest("r", (5,), SamplingParams(grammar=Grammar("json_object"))), "e", stream=False)
    assert base["model"] == "served-base" and "logprobs" not in base and "seed" not in base
    assert base["structured_outputs"] == {"json_object": True, "disable_any_whitespace": True}
    schema = engine._body(GenerateRequest("r", (5,), SamplingParams(grammar=Grammar("json_schema", '{"type": "object"}'))), "e", stream=False)
    assert schema["structured_outputs"]["json"] == '{"type": "object"}'
    ebnf = engine._body(GenerateRequest("r", (5,), SamplingParams(grammar=Grammar("ebnf", 'root ::= "a"'))), "e", stream=False)
    assert ebnf["structured_outputs"]["grammar"] == 'root ::= "a"'
    with pytest.raises(Exception, match="not loaded"):
        engine._body(GenerateRequest("r", (5,), SamplingParams(), adapter="other@1"), "e", stream=False)


def test_the_engine_request_id_is_generated_per_request(tiny_model_path):
    engine = VLLMEngine("http://x", tiny_model_path, model_id="tiny", settings=VLLMSettings())
    req = GenerateRequest("same-client-id", (5,), SamplingParams())
    ids = {engine._start_request(req) for _ in range(3)}
    assert len(ids) == 3 and "same-client-id" not in ids


def test_launch_command_has_what_loopwise_needs(tmp_path, monkeypatch):
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text("")
    settings = VLLMSettings(python=python, kv_cache="128M", launch_args=("--max-num-seqs=16",))
    launcher = VLLMLauncher(settings, Path("/m"), served_name="smol", max_lora_rank=20, max_loaded_adapters=4, dtype="bfloat16", index=1, of=2)
    cmd = " ".join(launcher.command("127.0.0.1", 9))
    for part in (
        f"{python} -m vllm.entrypoints.cli.main serve /m --host 127.0.0.1 --port 9 --served-model-name smol",
        "--enable-lora --max-lora-rank 32 --max-loras 4 --max-cpu-loras 5",
        "--logprobs-mode processed_logprobs",
        "--generation-config vllm",
        '"disable_any_whitespace": true',
        "--kv-cache-memory-bytes 128M --dtype bfloat16 --max-num-seqs=16",
    ):
        assert part in cmd, (part, cmd)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = launcher.child_env()
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert [lora_rank(r) for r in (1, 4, 8, 9, 64, 65)] == [1, 8, 8, 16, 64, 128]  # vLLM accepts only these ranks
    assert [cpu_share(i, 2, [0, 1]) for i in (0, 1)] == ["0", "1"]  # two replicas on two cores: one each
    assert [cpu_share(i, 2, [0, 1, 2, 3, 4, 5]) for i in (0, 1)] == ["0,1,2", "3,4,5"]
    assert cpu_share(0, 1, [0, 1]) == ""  # one server: vLLM's own binding
    missing = VLLMLauncher(VLLMSettings(python=tmp_path / "nope"), Path("/m"), served_name="s", max_lora_rank=8, max_loaded_adapters=1)
    with pytest.raises(Exception, match="make vllm"):
        missing.command("127.0.0.1", 9)
