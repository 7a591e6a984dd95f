"""Real SGLang servers for the tests marked ``engines`` (SGLang's pure-PyTorch CPU path, installed by ``make sglang``).

``SGLangServer(model_path)`` runs ``sglang.launch_server`` through loopwise's own launcher
(``runtime/engines/sglang_launcher.py``, so the flags ``--sglang-launch`` uses on CPU are the ones tested) with the
virtualenv's Python, on a fixed free port: float32, LoRA up to rank 8 in 9 slots per batch (8 adapters and the
base model, as loopwise's ``--max-loaded-adapters 8`` asks), a small KV cache (8192 tokens: the machine is
shared). ``kill()`` SIGKILLs its process group (a crash), ``start()`` brings it back on the same port, with no
adapters. ``adapters()`` lists SGLang's own adapter names (``/v1/models``): ``_engines.EngineServer``'s, as vLLM's are.

The tiny test model runs on SGLang's torch-native attention as it is (head_dim 16), so the adapters the
backend suite builds for it fit both the fake and the real server.

``skip_reason()`` says why real SGLang tests do not run here: SGLang is not installed (``make sglang``), this
is the default suite (``make test-engines`` runs them), or the engines asked for leave SGLang out. ``SGLANG`` is the
engine's checks shared with vLLM's (``_engines.Engine``: ``test_sglang_real.py``).
"""

from __future__ import annotations

from pathlib import Path

from runtime.engines.sglang_launcher import SGLangLauncher
from runtime.settings import SGLangSettings, default_sglang_venv
from tests.runtime._engines import Engine, EngineServer

SGLANG = Engine("sglang", "SGLang", admin_timeout=300)


def sglang_python() -> Path:
    return default_sglang_venv() / "bin" / "python"


def installed() -> bool:
    """``make sglang`` finished there (its stamp), not just a virtualenv being built."""
    return sglang_python().exists() and any(default_sglang_venv().glob(".installed-*"))


def not_installed() -> str:
    return f"SGLang's CPU path is not installed at {default_sglang_venv()} (`make sglang` installs it; `make test-engines` runs these tests)"


def skip_reason() -> str | None:
    return SGLANG.skip_reason(None if installed() else not_installed())


class SGLangServer(EngineServer[SGLangLauncher]):
    def __init__(self, model_path: Path, *, max_loaded_adapters: int = 8, max_lora_rank: int = 8, kv_tokens: int = 8192) -> None:
        settings = SGLangSettings(python=sglang_python(), device="cpu", max_total_tokens=kv_tokens, launch_timeout_s=600)
        super().__init__(
            lambda url: SGLangLauncher(
                settings, model_path, max_lora_rank=max_lora_rank, max_loaded_adapters=max_loaded_adapters, dtype="float32", url=url
            )
        )
