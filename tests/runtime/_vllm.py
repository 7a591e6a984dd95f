"""Real vLLM servers for the tests marked ``engines`` (vLLM's CPU build, installed by ``make vllm``).

``VLLMServer(model_path)`` runs ``vllm serve`` through loopwise's own launcher
(``runtime/engines/vllm_launcher.py``, so the flags ``--vllm-launch`` uses are the ones tested) on a fixed free
port, with a small KV cache (64 MB: the machine is shared), float32 and LoRA up to rank 8. ``kill()``
SIGKILLs its process group (a crash), ``start()`` brings it back on the same port.

``skip_reason()`` says why real-engine tests do not run here: vLLM is not installed (``make vllm``), this
is the default suite (``make test-engines`` runs them; they take minutes of CPU), or the engines asked for
(``LOOPWISE_TEST_ENGINES``, ``_engines.py``) leave vLLM out. ``VLLM`` is the engine's checks shared with SGLang's
(``_engines.Engine``: ``test_vllm_real.py``); the server is an ``_engines.EngineServer``.

The tiny test model cannot run on vLLM's CPU attention (head_dim 16); ``ensure_tiny(head_dim=32)`` is the
same model shape-for-shape with 2 wider heads, so the adapters the tests build fit both.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from runtime.engines.vllm_launcher import VLLMLauncher
from runtime.settings import VLLMSettings, default_vllm_venv
from tests.runtime._engines import Engine, EngineServer

VLLM = Engine("vllm", "vLLM", admin_timeout=120)


def vllm_python() -> Path:
    return default_vllm_venv() / "bin" / "python"


def skip_reason() -> str | None:
    missing = f"vLLM's CPU build is not installed at {default_vllm_venv()} (`make vllm` installs it; `make test-engines` runs these tests)"
    return VLLM.skip_reason(None if vllm_python().exists() else missing)


class VLLMServer(EngineServer[VLLMLauncher]):
    def __init__(self, model_path: Path, *, served_name: str = "tiny", kv_cache: str = "64M", max_loaded_adapters: int = 8) -> None:
        settings = VLLMSettings(kv_cache=kv_cache, launch_timeout_s=900)
        super().__init__(
            lambda url: VLLMLauncher(
                settings,
                model_path,
                served_name=served_name,
                max_lora_rank=8,
                max_loaded_adapters=max_loaded_adapters,
                dtype="float32",
                url=url,
            )
        )

    def finished_requests(self) -> float:
        """Requests this server finished (vLLM's ``vllm:request_success_total``, summed over its labels)."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("vllm:request_success_total"):
                total += float(line.rsplit(" ", 1)[1])
        return total
