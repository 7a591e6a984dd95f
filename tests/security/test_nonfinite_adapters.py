"""Adapter weights must be finite: a NaN or infinite weight is refused at load, on every path, naming the tensor
(it was accepted, and every request on it answered NaN); and an adapter whose numbers blow up anyway fails only its
own requests, never base-model requests decoded in the same batch (they failed with 500: the stacked LoRA form masked
neighbours' columns by multiplying with zero, and ``inf * 0`` is NaN)."""

from __future__ import annotations

import asyncio
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.adapters.names import AdapterInvalid, AdapterRef
from runtime.adapters.validation import adapter_validator, base_shapes_of, validate_adapter
from tests.runtime._client import assert_error

ADMIN = "nonfinite-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
WEIGHTS = "adapter_model.safetensors"
LORA_A = "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"  # NaN queries can vanish in CPU attention; NaN values cannot
LORA_B = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"


@pytest.fixture(scope="module")
def good(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), config)
    out = tmp_path_factory.mktemp("lora") / "good"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def shapes(tiny_model_path: Path) -> dict[str, tuple[int, int]]:
    from transformers import AutoModelForCausalLM

    return base_shapes_of(AutoModelForCausalLM.from_pretrained(tiny_model_path))


def poisoned(
    good: Path, out: Path, key: str = LORA_A, value: float = float("nan"), dtype: torch.dtype = torch.float32, *, everywhere: bool = False
) -> Path:
    """A copy of ``good`` in ``dtype`` whose tensor ``key`` holds ``value`` (at one element, or ``everywhere``)."""
    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(good, out))
    tensors = {k: v.to(dtype) for k, v in load_file(str(folder / WEIGHTS)).items()}
    assert key in tensors, sorted(tensors)
    if everywhere:
        tensors[key].fill_(value)
    else:
        tensors[key].view(-1)[3] = value
    save_file(tensors, str(folder / WEIGHTS))
    return folder


# ---- validation (the admin API's loads and the shared store's sync) ---------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", [LORA_A, LORA_B], ids=["lora_A", "lora_B"])
def test_non_finite_weights_are_refused_naming_the_tensor(good, shapes, tmp_path, key, value, dtype):
    bad = poisoned(good, tmp_path / "bad", key, value, dtype)
    with pytest.raises(AdapterInvalid, match=rf"tensor '{key}' holds 1 non-finite value"):
        validate_adapter(bad, base_shapes=shapes, max_rank=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_finite_weights_pass_in_every_float_dtype(good, shapes, tmp_path, dtype):
    fine = poisoned(good, tmp_path / "fine", value=60000.0 if dtype == torch.float16 else 1e30, dtype=dtype)  # large, but finite
    assert validate_adapter(fine, base_shapes=shapes, max_rank=16)["peft_type"] == "LORA"


_NUMPY_OF = {"F16": "float16", "F32": "float32", "F64": "float64", "I32": "int32"}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(["F16", "BF16", "F32", "F64", "I32"]), st.integers(1, 40), st.sets(st.integers(0, 39), max_size=3)),
        min_size=1,
        max_size=8,
    ),
    chunk=st.sampled_from([8, 24, 64, 16 << 20]),
    bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
)
def test_the_finite_check_finds_any_bad_tensor_in_files_of_mixed_dtypes(tmp_path, monkeypatch, specs, chunk, bad):
    """Tensors of several dtypes back to back in any order (integers in between, never checked), bad values
    anywhere, checked in chunks of any size: the file passes exactly when no float tensor holds a bad value, and a
    refusal names a poisoned tensor with its own count."""
    import numpy as np

    import runtime.adapters.validation as validation

    monkeypatch.setattr(validation, "_FINITE_CHUNK_BYTES", chunk)
    tensors, poisoned_counts = [], {}
    for i, (dtype, n, at) in enumerate(specs):
        values = np.linspace(-3.0, 3.0, n)
        hits = sorted(j for j in at if j < n)
        if dtype == "I32":
            data = np.arange(n, dtype=np.int32).tobytes()
        else:
            values[hits] = bad
            poisoned_counts[f"t{i}"] = len(hits)
            if dtype == "BF16":  # numpy has no bfloat16: torch's bits
                data = torch.tensor(values, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
            else:
                data = values.astype(_NUMPY_OF[dtype]).tobytes()
        tensors.append((f"t{i}", dtype, n, data))
    path = tmp_path / f"w-{len(list(tmp_path.iterdir()))}.safetensors"
    write_safetensors(path, tensors)
    if not any(poisoned_counts.values()):
        validation._check_finite(path)
        return
    with pytest.raises(AdapterInvalid) as info:
        validation._check_finite(path)
    named = re.search(r"tensor '(t\d+)' holds (\d+) non-finite", str(info.value))
    assert named and int(named[2]) == poisoned_counts.get(named[1]), (str(info.value), poisoned_counts)


def write_safetensors(path: Path, tensors: list[tuple[str, str, int, bytes]]) -> None:
    """A safetensors file with the tensors' data in the order given (``safe_open`` sorts by dtype when it writes)."""
    import json
    import struct

    header, offset = {}, 0
    for key, dtype, n, data in tensors:
        header[key] = {"dtype": dtype, "shape": [n], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors))


def test_the_shared_validator_refuses_them_off_the_event_loop(good, shapes, tmp_path):
    """``adapter_validator`` is what both the admin API and ``runtime/adapters/sync.py`` (a published adapter) go through."""
    bad = poisoned(good, tmp_path / "root" / "bad")
    validated = adapter_validator(lambda: shapes, tmp_path / "root", 16)
    with pytest.raises(AdapterInvalid, match="non-finite"):
        asyncio.run(validated(AdapterRef(family="f", version=1, path=str(bad))))


def test_the_engine_refuses_them_too(good, tmp_path, tiny_model_path):
    """Loaded straight into the embedded engine (no validation in front): ``read_lora`` refuses them, and a
    ``lora_B`` that only overflows once scaled and cast to the base's float16 is refused as well."""
    from transformers import AutoModelForCausalLM

    from runtime.engine import AdapterError
    from runtime.engines.lora_weights import read_lora

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float16)
    targets = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    with pytest.raises(AdapterError, match=rf"tensor '{LORA_A}' holds 1 non-finite value"):
        read_lora(poisoned(good, tmp_path / "nan"), targets)
    big = poisoned(good, tmp_path / "big", LORA_B, 1e30)  # finite in float32; 1e30 * scale is inf in float16
    with pytest.raises(AdapterError, match="v_proj: lora_B times its scale .* holds 1 non-finite value"):
        read_lora(big, targets)
    assert read_lora(good, targets).rank == 4


# ---- over HTTP ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nonfinite-adapters")


@pytest.fixture(scope="module")
def server(start_server, root):
    return start_server("--admin-key", ADMIN, "--adapter-root", str(root), "--max-lora-rank", "8")


def load(server, path: Path, family: str) -> httpx.Response:
    return httpx.post(server.base_url + "/admin/adapters", json={"path": str(path), "family": family}, headers=AUTH, timeout=60)


def chat(server, model: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(server.url + "/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_the_admin_api_answers_400_invalid_adapter(server, root, good, value):
    bad = poisoned(good, root / f"bad-{value}", LORA_B, value)
    err = assert_error(load(server, bad, "bad"), 400, code="invalid_adapter", param="path")
    assert LORA_B in err["message"] and "non-finite" in err["message"], err
    assert "bad" not in {m["id"] for m in httpx.get(server.url + "/models", timeout=10).json()["data"]}
    assert chat(server, "tiny").status_code == 200
    assert load(server, Path(shutil.copytree(good, root / f"good-{value}")), "fine").status_code == 200


def _forced_past_every_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an adapter that slips past validation looks like: its finiteness checks switched off."""
    import runtime.adapters.validation
    import runtime.engines.lora_weights

    monkeypatch.setattr(runtime.adapters.validation, "_check_finite", lambda *a: None)
    monkeypatch.setattr(runtime.engines.lora_weights, "_check_finite", lambda *a: None)


@pytest.mark.parametrize("case", ["nan-forced-in", "finite-but-overflowing"])
def test_a_broken_adapter_fails_only_its_own_request_beside_base_requests(server, root, good, monkeypatch, case):
    """Base-model requests are decoding when the broken adapter's request joins their batch: they finish with 200,
    and it fails alone with a clear error (a 500 ``non_finite_output``). The overflowing adapter (every ``lora_A``
    weight 1e38: finite, so it passes validation) needs nothing forced."""
    if case == "nan-forced-in":
        _forced_past_every_check(monkeypatch)
        broken = poisoned(good, root / case, LORA_A, float("nan"), everywhere=True)
    else:
        broken = poisoned(good, root / case, LORA_A, 1e38, everywhere=True)
    r = load(server, broken, case)
    assert r.status_code == 200, r.text
    name = r.json()["name"]
    started, results = threading.Barrier(4), {}

    def base(i: int) -> None:
        messages = [{"role": "user", "content": f"tell me a story {i}"}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 96, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=120) as resp:
            lines = resp.iter_lines()
            results[i] = [resp.status_code, next(lines)]  # the first event: the request is decoding
            started.wait(timeout=60)
            results[i] += list(lines)

    threads = [threading.Thread(target=base, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    mine = chat(server, name)
    for t in threads:
        t.join(timeout=120)
    err = assert_error(mine, 500, type="server_error", code="non_finite_output")
    assert "non-finite" in err["message"], err
    for i in range(3):
        status, *lines = results[i]
        events = [e for e in lines if e]
        assert status == 200, events[:3]
        assert '"finish_reason":"length"' in events[-2].replace(" ", ""), events[-3:]  # all 96 tokens
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), events[-3:]
    assert chat(server, "tiny").status_code == 200  # and the server goes on serving


# ---- the engine alone: the same step, exactly -------------------------------------------------------------------


@pytest.mark.parametrize("runner", ["llama", "transformers"])
def test_nan_adapter_rows_fail_alone_in_one_engine_step(tiny_model_path, good, tmp_path, monkeypatch, runner: str):
    """Submitted together, the three prompts are prefilled in one forward (and decoded together after): the base rows
    beside the NaN adapter's row finish; its request fails with ``NonFiniteOutput``."""
    from runtime.engine import GenerateRequest, NonFiniteOutput, SamplingParams
    from runtime.engines.embedded import EmbeddedEngine

    _forced_past_every_check(monkeypatch)
    nan = poisoned(good, tmp_path / "nan", LORA_A, float("nan"), everywhere=True)
    engine = EmbeddedEngine(tiny_model_path, model_id="tiny", dtype="float32", runner=runner)

    async def go() -> list[Any]:
        await engine.start()
        try:
            await engine.load_adapter("nan@1", str(nan))
            sp = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
            rows = (("a", None), ("nan", "nan@1"), ("b", None))
            reqs = [GenerateRequest(request_id=rid, input_ids=(5, 6, 7, 8), sampling=sp, adapter=a) for rid, a in rows]
            return await asyncio.wait_for(asyncio.gather(*(engine.generate(r) for r in reqs), return_exceptions=True), 60)
        finally:
            await engine.close()

    results = asyncio.run(go())
    assert isinstance(results[1], NonFiniteOutput), results[1]
    assert [len(r.output_ids) for r in (results[0], results[2])] == [5, 5], results
