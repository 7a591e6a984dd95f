"""Real SGLang servers for the tests marked ``engines`` (SGLang's pure-PyTorch CPU path, installed by ``make sglang``).

``SGLangServer(model_path)`` runs ``sglang.launch_server`` through loopwise's own launcher
(``runtime/sglang_launcher.py``, so the flags ``--sglang-launch`` uses on CPU are the ones tested) with the
virtualenv's Python, on a fixed free port: float32, LoRA up to rank 8 in 9 slots per batch (8 adapters and the
base model, as loopwise's ``--max-loaded-adapters 8`` asks), a small KV cache (8192 tokens: the machine is
shared). ``kill()`` SIGKILLs its process group (a crash), ``start()`` brings it back on the same port, with no
adapters. ``adapters()`` lists SGLang's own adapter names (``/v1/models``).

The tiny test model runs on SGLang's torch-native attention as it is (head_dim 16), so the adapters the
backend suite builds for it fit both the fake and the real server.

``skip_reason()`` says why real SGLang tests do not run here: SGLang is not installed (``make sglang``), this
is the default suite (``make test-engines`` runs them), or the engines asked for leave SGLang out.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from runtime.launcher import free_port
from runtime.settings import SGLangSettings, default_sglang_venv
from runtime.sglang_launcher import SGLangLauncher
from tests.runtime._engines import ASKED_TEXT, ENGINES, asked


def sglang_python() -> Path:
    return default_sglang_venv() / "bin" / "python"


def installed() -> bool:
    """``make sglang`` finished there (its stamp), not just a virtualenv being built."""
    return sglang_python().exists() and any(default_sglang_venv().glob(".installed-*"))


def not_installed() -> str:
    return f"SGLang's CPU path is not installed at {default_sglang_venv()} (`make sglang` installs it; `make test-engines` runs these tests)"


def skip_reason() -> str | None:
    if not installed():
        return not_installed()
    if not ENGINES:
        return "real SGLang servers: `make test-engines` runs this (the default suite leaves real engines out to stay within its time budget)"
    if not asked("sglang"):
        return f"real SGLang servers: not among the engines asked for (LOOPWISE_TEST_ENGINES={ASKED_TEXT!r}; `make test-engines ENGINES=sglang`)"
    return None


class SGLangServer:
    def __init__(self, model_path: Path, *, max_loaded_adapters: int = 8, max_lora_rank: int = 8, kv_tokens: int = 8192) -> None:
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        settings = SGLangSettings(python=sglang_python(), device="cpu", max_total_tokens=kv_tokens, launch_timeout_s=600)
        self.launcher = SGLangLauncher(
            settings, model_path, max_lora_rank=max_lora_rank, max_loaded_adapters=max_loaded_adapters, dtype="float32", url=self.url
        )
        self.start()

    @property
    def model_path(self) -> Path:
        return self.launcher.model_path

    def start(self) -> None:
        self.launcher.start()

    def alive(self) -> bool:
        return self.launcher.proc is not None and self.launcher.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server and its scheduler and detokenizer (a crash, not a shutdown)."""
        proc = self.launcher.proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        self.launcher.stop()

    def adapters(self) -> set[str]:
        """The adapter names SGLang itself lists (``/v1/models`` entries with a parent)."""
        data = httpx.get(self.url + "/v1/models", timeout=30).json()["data"]
        return {m["id"] for m in data if m.get("parent")}
