"""Real vLLM servers for the tests marked ``engines`` (vLLM's CPU build, installed by ``make vllm``).

``VLLMServer(model_path, log_dir)`` runs ``vllm serve`` through loopwise's own launcher
(``runtime/vllm_launcher.py``, so the flags ``--vllm-launch`` uses are the ones tested) on a fixed free
port, with a small KV cache (64 MB: the machine is shared), float32 and LoRA up to rank 8. ``kill()``
SIGKILLs its process group (a crash), ``start()`` brings it back on the same port.

``skip_reason()`` says why real-engine tests do not run here: vLLM is not installed (``make vllm``), this
is the default suite (``make test-engines`` runs them; they take minutes of CPU), or the engines asked for
(``LOOPWISE_TEST_ENGINES``, ``_engines.py``) leave vLLM out.

The tiny test model cannot run on vLLM's CPU attention (head_dim 16); ``ensure_tiny(head_dim=32)`` is the
same model shape-for-shape with 2 wider heads, so the adapters the tests build fit both.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from runtime.launcher import free_port
from runtime.settings import VLLMSettings, default_vllm_venv
from runtime.vllm_launcher import VLLMLauncher
from tests.runtime._engines import ASKED_TEXT, ENGINES, asked


def vllm_python() -> Path:
    return default_vllm_venv() / "bin" / "python"


def skip_reason() -> str | None:
    if not vllm_python().exists():
        return f"vLLM's CPU build is not installed at {default_vllm_venv()} (`make vllm` installs it; `make test-engines` runs these tests)"
    if not ENGINES:
        return "real vLLM servers: `make test-engines` runs this (the default suite leaves real engines out to stay within its time budget)"
    if not asked("vllm"):
        return f"real vLLM servers: not among the engines asked for (LOOPWISE_TEST_ENGINES={ASKED_TEXT!r}; `make test-engines ENGINES=vllm`)"
    return None


class VLLMServer:
    def __init__(self, model_path: Path, *, served_name: str = "tiny", kv_cache: str = "64M", max_loaded_adapters: int = 8) -> None:
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        settings = VLLMSettings(kv_cache=kv_cache, launch_timeout_s=900)
        self.launcher = VLLMLauncher(
            settings,
            model_path,
            served_name=served_name,
            max_lora_rank=8,
            max_loaded_adapters=max_loaded_adapters,
            dtype="float32",
            url=self.url,
        )
        self.start()

    def start(self) -> None:
        self.launcher.start()

    def alive(self) -> bool:
        return self.launcher.proc is not None and self.launcher.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server and its workers (a crash, not a shutdown)."""
        proc = self.launcher.proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        self.launcher.stop()

    def adapters(self) -> set[str]:
        """The adapter names the server itself lists (``/v1/models`` entries with a parent)."""
        data = httpx.get(self.url + "/v1/models", timeout=30).json()["data"]
        return {m["id"] for m in data if m.get("parent")}

    def finished_requests(self) -> float:
        """Requests this server finished (vLLM's ``vllm:request_success_total``, summed over its labels)."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("vllm:request_success_total"):
                total += float(line.rsplit(" ", 1)[1])
        return total
