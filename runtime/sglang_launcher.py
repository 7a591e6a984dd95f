"""``--sglang-launch``: run ``python -m sglang.launch_server`` as a child process for the SGLang backend.

``SGLangLauncher(settings, model_path, max_lora_rank=..., max_loaded_adapters=...).start()`` starts the
server with the flags dynamic LoRA loading needs (``--enable-lora``, ``--max-lora-rank``,
``--lora-target-modules``, ``--max-loras-per-batch``, ``--max-loaded-loras``; one tokenizer worker,
because SGLang's adapter registry is per worker, SGLang #31084), forwards each line of its output
into our structlog log (logger ``sglang``), waits until ``/health_generate`` answers 200 (or the child
exits, or ``launch_timeout_s`` passes), and returns the URL. ``stop()`` sends SIGTERM to the child's
process group (SGLang runs scheduler and detokenizer subprocesses), then SIGKILL after a grace period
(the process handling is ``runtime/launcher.py``'s, shared with ``--vllm-launch``).

The module run is ``settings.launch_module`` (default ``sglang.launch_server``); tests point it at the
fake server in ``tests/fakes/sglang_server.py``, which takes the same flags.

Not here: talking to the server once it is up (``runtime/engines/sglang.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from runtime.launcher import LaunchError, ServerLauncher
from runtime.settings import SGLangSettings

__all__ = ["LaunchError", "SGLangLauncher"]


class SGLangLauncher(ServerLauncher):
    name = "sglang"
    label = "SGLang"
    health_path = "/health_generate"
    default_port = 30000

    def __init__(self, settings: SGLangSettings, model_path: Path, *, max_lora_rank: int, max_loaded_adapters: int, grace_s: float = 20.0) -> None:
        super().__init__(url=settings.url, launch_timeout_s=settings.launch_timeout_s, connect_timeout_s=settings.connect_timeout_s, grace_s=grace_s)
        self.settings = settings
        self.model_path = Path(model_path)
        self.max_lora_rank = max_lora_rank
        self.max_loaded_adapters = max_loaded_adapters

    def _what(self) -> str:
        return f"SGLang ({self.settings.launch_module})"

    def command(self, host: str, port: int) -> list[str]:
        s = self.settings
        slots = s.slots(self.max_loaded_adapters)
        return [
            sys.executable,
            "-m",
            s.launch_module,
            "--model-path",
            str(self.model_path),
            "--host",
            host,
            "--port",
            str(port),
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--lora-target-modules",
            *s.lora_target_modules,
            "--max-loras-per-batch",
            str(slots),
            "--max-loaded-loras",
            str(s.max_loaded_loras or slots),
            "--tokenizer-worker-num",
            "1",
            *s.launch_args,
        ]
