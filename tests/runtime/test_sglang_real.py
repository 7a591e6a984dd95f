"""loopwise in front of a real SGLang server (marker ``sglang``; needs a GPU host with SGLang running).

    LOOPWISE_SGLANG_URL=http://127.0.0.1:30000 LOOPWISE_SGLANG_MODEL=/path/to/the/same/model \
        .venv/bin/python -m pytest -m sglang tests/runtime/test_sglang_real.py

``LOOPWISE_SGLANG_MODEL`` is the local Hugging Face folder of the model SGLang serves (loopwise
tokenizes and templates with it); it defaults to the ``model_path`` SGLang reports, when that is a
local folder. SGLang must run with ``--enable-lora --max-lora-rank 8`` (or more) and
``--lora-target-modules all`` (``bench/gpu_sglang.sh`` launches it so). Skipped without the URL.

Not here: the CPU-only tests of the backend (``test_sglang_backend.py``, against the fake).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.runtime._client import chat_body, post_chat, stream_chat
from tests.runtime.test_adapter_serving import make_adapter

URL = os.environ.get("LOOPWISE_SGLANG_URL")
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(not URL, reason="LOOPWISE_SGLANG_URL is not set (no real SGLang server)")]
ADMIN = "adm"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
MODEL = "tiny"  # the served model name start_server gives loopwise


@pytest.fixture(scope="module")
def model_dir() -> Path:
    local = os.environ.get("LOOPWISE_SGLANG_MODEL")
    if not local:
        local = httpx.get(f"{URL}/get_model_info", timeout=30).json()["model_path"]
    path = Path(local)
    if not path.is_dir():
        pytest.skip(f"set LOOPWISE_SGLANG_MODEL to the local folder of the model SGLang serves ({local} is not a folder here)")
    return path


@pytest.fixture(scope="module")
def real(start_server, model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("real-sglang") / "adapters"
    make_adapter(model_dir, root / "a0", seed=1, r=4)
    srv = start_server("--model", str(model_dir), "--backend", "sglang", "--sglang-url", URL, "--admin-key", ADMIN, "--adapter-root", str(root))
    srv.adapter_root = root
    return srv


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


def test_adapter_load_select_unload(real):
    r = httpx.post(real.base_url + "/admin/adapters", json={"path": str(real.adapter_root / "a0"), "family": "g"}, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    out = post_chat(real, {**chat_body(max_tokens=8, temperature=0), "model": "g@1"}, timeout=120)
    assert out.status_code == 200 and out.json()["loopwise"]["adapter"] == "g@1"
    assert httpx.delete(real.base_url + "/admin/adapters/g@1", headers=AUTH, timeout=300).status_code == 200
    assert httpx.get(real.base_url + "/health", timeout=60).status_code == 200
