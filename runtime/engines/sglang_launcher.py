"""``--sglang-launch``: run ``python -m sglang.launch_server`` as a child process for the SGLang backend.

``SGLangLauncher(settings, model_path, max_lora_rank=..., max_loaded_adapters=...).start()`` starts the
server with the flags dynamic LoRA loading needs (``--enable-lora``, ``--max-lora-rank``,
``--lora-target-modules``, ``--max-loras-per-batch``, ``--max-loaded-loras``; one tokenizer worker,
because SGLang's adapter registry is per worker, SGLang #31084), forwards each line of its output
into our structlog log (logger ``sglang``), waits until ``/health_generate`` answers 200 (or the child
exits, or ``launch_timeout_s`` passes), and returns the URL. ``stop()`` sends SIGTERM to the child's
process group (SGLang runs scheduler and detokenizer subprocesses), then SIGKILL after a grace period
(the process handling is ``runtime/engines/launcher.py``'s, shared with ``--vllm-launch``).

The Python is ``--sglang-python``; by default the virtualenv ``make sglang`` builds (``SGLANG_VENV`` in the
Makefile, ``LOOPWISE_SGLANG_VENV`` at run time, ``~/.cache/loopwise/sglang-cpu`` when unset) where it exists,
else this process's own (``pip install -e '.[sglang]'`` next to loopwise, on a GPU host).

On CPU (``--sglang-device cpu``, or ``auto`` where our torch sees no CUDA device) it adds what SGLang's
pure-PyTorch path needs (the virtualenv ``make sglang`` builds, with its shims: docs/engines.md):
``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``, torch-native attention, sampling and LoRA kernels, no overlap
schedule, and a bounded KV cache (``--max-total-tokens``, default 16384: SGLang would size it from the
machine's free RAM). On any device: ``--constrained-json-disable-any-whitespace`` (compact JSON under
``response_format`` and forced tool calls, as the embedded engine writes it), and ``--dtype`` when it is not
``auto`` (loopwise's ``auto`` and SGLang's differ). A flag that ``--sglang-arg`` already gives is not added twice. Nothing leaves the machine:
``HF_HUB_OFFLINE=1`` (the model is a local folder).

The module run is ``settings.launch_module`` (default ``sglang.launch_server``); tests point it at the
fake server in ``tests/fakes/sglang_server.py``, which takes the same flags.

Not here: talking to the server once it is up (``runtime/engines/sglang.py``).
"""

from __future__ import annotations

from pathlib import Path

from runtime.engines.launcher import LaunchError, ServerLauncher
from runtime.settings import SGLangSettings

__all__ = ["CPU_KV_TOKENS", "LaunchError", "SGLangLauncher", "resolve_device"]

CPU_KV_TOKENS = 16384  # --max-total-tokens on CPU unless --sglang-max-total-tokens says otherwise


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` where this process's torch sees a CUDA device, else ``cpu``."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class SGLangLauncher(ServerLauncher):
    name = "sglang"
    label = "SGLang"
    health_path = "/health_generate"
    default_port = 30000

    def __init__(
        self,
        settings: SGLangSettings,
        model_path: Path,
        *,
        max_lora_rank: int,
        max_loaded_adapters: int,
        dtype: str = "auto",
        url: str | None = None,
        grace_s: float = 20.0,
    ) -> None:
        super().__init__(
            url=url or settings.url, launch_timeout_s=settings.launch_timeout_s, connect_timeout_s=settings.connect_timeout_s, grace_s=grace_s
        )
        self.settings = settings
        self.model_path = Path(model_path)
        self.max_lora_rank = max_lora_rank
        self.max_loaded_adapters = max_loaded_adapters
        self.dtype = dtype
        self.python = settings.python_path()
        self.device = resolve_device(settings.device)

    def _what(self) -> str:
        return f"SGLang ({self.settings.launch_module}, {self.python})"

    def command(self, host: str, port: int) -> list[str]:
        if not self.python.exists():
            raise LaunchError(
                f"no SGLang Python at {self.python}: `make sglang` installs SGLang's CPU path into its own virtualenv "
                "(or pass --sglang-python, or set LOOPWISE_SGLANG_VENV to the virtualenv)"
            )
        s = self.settings
        slots = s.slots(self.max_loaded_adapters)
        cmd = [
            str(self.python),
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
        ]
        # compact JSON under response_format and tools, as the embedded engine writes it (and the learner's grammar mask reads it)
        defaults: list[tuple[str, ...]] = [("--constrained-json-disable-any-whitespace",)]
        if self.dtype != "auto":
            defaults.append(("--dtype", self.dtype))
        if self.device == "cpu":
            defaults += [
                ("--device", "cpu"),
                ("--attention-backend", "torch_native"),
                ("--sampling-backend", "pytorch"),
                ("--lora-backend", "torch_native"),  # the default (csgmv) is Triton GPU kernels
                ("--disable-overlap-schedule",),
                ("--max-total-tokens", str(s.max_total_tokens or CPU_KV_TOKENS)),
            ]
        elif s.max_total_tokens:
            defaults.append(("--max-total-tokens", str(s.max_total_tokens)))
        given = {a.split("=", 1)[0] for a in s.launch_args if a.startswith("--")}
        for flag in defaults:
            if flag[0] not in given:
                cmd += flag
        return [*cmd, *s.launch_args]

    def child_env(self) -> dict[str, str]:
        env = {"HF_HUB_OFFLINE": "1"}
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        return env
