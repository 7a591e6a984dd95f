"""JSON sent as text is parsed under the request body's limits: nested 100,000 levels deep inside a string (tool-call
``arguments`` of a chat request, a Responses ``function_call`` item) or in an adapter's ``adapter_config.json``, it is
a 400 in the API's envelope naming the limit (it was a 500: ``json.loads`` raises ``RecursionError``, which the
parsers did not catch), and the server goes on serving."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest

from runtime.adapters.names import AdapterInvalid, AdapterRef
from runtime.adapters.validation import adapter_validator
from runtime.json_text import MAX_DEPTH, JSONLimitExceeded, loads_json_text, read_json_file
from tests.runtime._client import assert_error

ADMIN = "nested-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
LEVELS = 100_000
DEEP = "[" * LEVELS + "]" * LEVELS
DEPTHS = {"100k": DEEP, "65": "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)}  # 65: json.loads copes, the limit does not


def nested_object(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


# ---- the helper -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [DEEP, nested_object(LEVELS), "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), DEEP[:LEVELS]])
def test_too_deep_text_is_refused_naming_the_limit(text):
    with pytest.raises(JSONLimitExceeded, match=f"nested more than {MAX_DEPTH} levels deep") as info:
        loads_json_text(text)
    assert isinstance(info.value, json.JSONDecodeError)  # callers that turn invalid JSON into a 400 need no new except


def test_text_within_the_limits_parses_and_invalid_json_is_a_plain_decode_error():
    assert loads_json_text("[" * MAX_DEPTH + "]" * MAX_DEPTH) == json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH)
    assert loads_json_text(b'{"city": "Paris"}') == {"city": "Paris"}
    with pytest.raises(json.JSONDecodeError) as info:
        loads_json_text("{bad")
    assert not isinstance(info.value, JSONLimitExceeded)
    with pytest.raises(JSONLimitExceeded, match="longer than 10 characters"):
        loads_json_text('"' + "x" * 20 + '"', max_chars=10)


def test_files_are_refused_before_they_are_read_whole(tmp_path):
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"x": "y" * 2000}))
    with pytest.raises(JSONLimitExceeded, match="larger than 1000 bytes"):
        read_json_file(big, max_bytes=1000)
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    with pytest.raises(JSONLimitExceeded, match="levels deep"):
        read_json_file(deep)


# ---- adapter_config.json ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("lora") / "good"
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(out)
    return out


def deep_config(good: Path, out: Path, text: str = DEEP) -> Path:
    folder = Path(shutil.copytree(good, out))
    (folder / "adapter_config.json").write_text(text)
    return folder


@pytest.mark.parametrize("text", [DEEP, nested_object(LEVELS)], ids=["array", "object"])
def test_a_deep_adapter_config_is_invalid_on_every_load_path(good, tmp_path, tiny_model_path, text):
    """The shared validator (admin API and ``runtime/adapters/sync.py``), and the embedded engine's own reader."""
    from transformers import AutoModelForCausalLM

    from runtime.adapters.validation import base_shapes_of
    from runtime.engine import AdapterError
    from runtime.engines.lora_weights import read_lora

    bad = deep_config(good, tmp_path / "root" / "deep", text)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    validated = adapter_validator(lambda: base_shapes_of(model), tmp_path / "root", 16)
    with pytest.raises(AdapterInvalid, match=f"adapter_config.json .* nested more than {MAX_DEPTH} levels deep"):
        asyncio.run(validated(AdapterRef(family="f", version=1, path=str(bad))))
    targets = {n: m for n, m in model.named_modules() if type(m).__name__ == "Linear"}
    with pytest.raises(AdapterError, match=f"nested more than {MAX_DEPTH} levels deep"):
        read_lora(bad, targets)


# ---- against a server -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nested-adapters")


@pytest.fixture(scope="module")
def server(start_server, root):
    return start_server("--admin-key", ADMIN, "--adapter-root", str(root))


def still_serving(server) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    r = httpx.post(server.url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def _call(arguments: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}


@pytest.mark.parametrize("text", DEPTHS.values(), ids=DEPTHS.keys())
def test_chat_tool_call_arguments(server, text):
    messages = [
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "content": None, "tool_calls": [_call(text)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    r = httpx.post(server.url + "/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2}, timeout=60)
    err = assert_error(r, 400, param="messages[1].tool_calls[0].function.arguments")
    assert f"nested more than {MAX_DEPTH} levels deep" in err["message"], err
    still_serving(server)


@pytest.mark.parametrize("text", DEPTHS.values(), ids=DEPTHS.keys())
def test_responses_function_call_arguments(server, text):
    items = [
        {"type": "message", "role": "user", "content": "look it up"},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": text},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
    ]
    r = httpx.post(server.url + "/responses", json={"model": "tiny", "input": items, "max_output_tokens": 2}, timeout=60)
    err = assert_error(r, 400, param="input[1].arguments")
    assert f"nested more than {MAX_DEPTH} levels deep" in err["message"], err
    still_serving(server)


def test_anthropic_tool_use_input_is_an_object_under_the_body_limit(server):
    """``tool_use.input`` is JSON in the body itself (not a string): the body's depth limit answers, in Anthropic's envelope."""
    deep_input = '{"q": ' + DEEP + "}"
    raw = (
        '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "look it up"}, {"role": "assistant", '
        '"content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": ' + deep_input + "}]}, "
        '{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}]}]}'
    )
    r = httpx.post(server.url + "/messages", content=raw.encode(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert f"nested more than {MAX_DEPTH} levels deep" in body["error"]["message"], body
    still_serving(server)


def test_admin_adapter_with_a_deep_config(server, root, good):
    bad = deep_config(good, root / "deep")
    r = httpx.post(server.base_url + "/admin/adapters", json={"path": str(bad), "family": "deep"}, headers=AUTH, timeout=60)
    err = assert_error(r, 400, code="invalid_adapter", param="path")
    assert f"nested more than {MAX_DEPTH} levels deep" in err["message"], err
    fine = Path(shutil.copytree(good, root / "fine"))
    r = httpx.post(server.base_url + "/admin/adapters", json={"path": str(fine), "family": "fine"}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    still_serving(server)


# ---- an agent's tool call (the model's text; tools/ imports nothing from the runtime) -----------------------------------


def test_deep_tool_arguments_come_back_as_a_result():
    """``ToolRegistry.call`` never raises: arguments too deep for ``json.loads`` are an ``invalid_json`` result."""
    from tools.registry import ToolRegistry

    registry = ToolRegistry()

    @registry.tool
    def lookup(q: str) -> str:
        """Look something up."""
        return q

    result = asyncio.run(registry.call("lookup", DEEP))
    assert result.ok is False and result.error_kind == "invalid_json" and "nested too deeply" in result.content
