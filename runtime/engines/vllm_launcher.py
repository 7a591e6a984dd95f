"""``--vllm-launch``: run ``vllm serve`` as child processes for the vLLM backend, one per replica.

``VLLMLauncher(settings, model_path, ...)`` is one server (the process handling is ``runtime/engines/launcher.py``'s:
own process group, output forwarded into our log under logger ``vllm``, ``/health`` waited for,
SIGTERM then SIGKILL on stop). ``vllm_launchers(...)`` builds one per replica; ``start_all`` starts them.

The command is ``<vllm python> -m vllm.entrypoints.cli.main serve MODEL`` with what loopwise needs:

- ``--enable-lora --max-lora-rank R --max-loras N --max-cpu-loras N+1``: dynamic adapters, ``R`` the
  smallest rank vLLM allows (1, 8, 16, 32, 64, ...) that is at least ``--max-lora-rank``, ``N`` =
  ``--max-loaded-adapters`` (in vLLM a base-model request takes no LoRA slot), one more in vLLM's CPU cache for
  the moment of a hot swap at capacity (the registry loads the new version before it unloads the evicted one);
- ``--logprobs-mode processed_logprobs``: logprobs of the distribution tokens are sampled from
  (``logits / T``, grammar mask applied), loopwise's convention (``runtime/engines/vllm.py``);
- ``--generation-config vllm``: no sampling defaults from ``generation_config.json`` (loopwise sends
  every sampling knob itself);
- ``--structured-outputs-config {"backend": "xgrammar", "disable_any_whitespace": true}``: compact JSON
  under ``response_format`` (as the embedded engine writes it) and loopwise's EBNF grammars as-is;
- ``--kv-cache-memory-bytes`` (``--vllm-kv-cache``, default 256M: vLLM's CPU default is 4 GiB per
  server), ``--dtype`` (``--dtype``), ``--max-model-len`` when set, then ``--vllm-arg`` s.

Environment: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (the load/unload routes), ``HF_HUB_OFFLINE=1``
and no usage statistics (nothing leaves the machine), and with several replicas on one CPU host each
gets its own share of the cores (``VLLM_CPU_OMP_THREADS_BIND``) unless that variable is already set.

The Python is ``--vllm-python``, default the virtualenv ``make vllm`` builds (``VLLM_VENV`` in the
Makefile, ``LOOPWISE_VLLM_VENV`` at run time, ``~/.cache/loopwise/vllm-cpu`` when unset).

Not here: talking to the servers once they are up (``runtime/engines/vllm.py``, ``replicas.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from runtime.engines.launcher import LaunchError, ServerLauncher
from runtime.settings import VLLMSettings

__all__ = ["LaunchError", "VLLMLauncher", "lora_rank", "vllm_launchers"]

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank choices


def lora_rank(max_rank: int) -> int:
    """The smallest rank vLLM accepts for ``--max-lora-rank`` that serves adapters up to ``max_rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= max_rank:
            return r
    raise LaunchError(f"--max-lora-rank {max_rank} is above vLLM's largest ({VLLM_LORA_RANKS[-1]})")


def cpu_share(index: int, of: int, cores: list[int]) -> str:
    """The cores replica ``index`` of ``of`` binds its OpenMP threads to (an equal contiguous share, at least one)."""
    if of <= 1 or not cores:
        return ""
    per = max(1, len(cores) // of)
    start = (index * per) % len(cores)
    share = cores[start : start + per] or cores[-per:]
    return ",".join(map(str, share))


class VLLMLauncher(ServerLauncher):
    name = "vllm"
    label = "vLLM"
    health_path = "/health"
    default_port = 8000

    def __init__(
        self,
        settings: VLLMSettings,
        model_path: Path,
        *,
        served_name: str,
        max_lora_rank: int,
        max_loaded_adapters: int,
        dtype: str = "auto",
        max_model_len: int | None = None,
        url: str | None = None,
        index: int = 0,
        of: int = 1,
        grace_s: float = 20.0,
    ) -> None:
        super().__init__(url=url, launch_timeout_s=settings.launch_timeout_s, connect_timeout_s=settings.connect_timeout_s, grace_s=grace_s)
        self.settings = settings
        self.model_path = Path(model_path)
        self.served_name = served_name
        self.max_lora_rank = max_lora_rank
        self.max_loaded_adapters = max_loaded_adapters
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.index, self.of = index, of
        self.python = settings.python_path()

    def _what(self) -> str:
        return f"vLLM replica {self.index + 1} of {self.of} ({self.python})"

    def command(self, host: str, port: int) -> list[str]:
        if not self.python.exists():
            raise LaunchError(
                f"no vLLM Python at {self.python}: `make vllm` installs vLLM's CPU build there "
                "(or pass --vllm-python, or set LOOPWISE_VLLM_VENV to the virtualenv)"
            )
        cmd = [
            str(self.python),
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            str(self.model_path),
            "--host",
            host,
            "--port",
            str(port),
            "--served-model-name",
            self.served_name,
            "--enable-lora",
            "--max-lora-rank",
            str(lora_rank(self.max_lora_rank)),
            "--max-loras",
            str(self.max_loaded_adapters),
            "--max-cpu-loras",
            str(self.max_loaded_adapters + 1),  # a hot swap at capacity loads the new version before unloading the old
            "--logprobs-mode",
            "processed_logprobs",
            "--generation-config",
            "vllm",
            "--structured-outputs-config",
            json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
            "--kv-cache-memory-bytes",
            self.settings.kv_cache,
            "--dtype",
            self.dtype,
        ]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        return [*cmd, *self.settings.launch_args]

    def child_env(self) -> dict[str, str]:
        env = {
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            share = cpu_share(self.index, self.of, sorted(os.sched_getaffinity(0)))
            if share:
                env["VLLM_CPU_OMP_THREADS_BIND"] = share
                env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        return env

    def start(self) -> str:
        try:
            return super().start()
        except OSError as exc:  # e.g. the Python is not executable
            raise LaunchError(f"cannot start vLLM with {self.python}: {exc}") from exc


def vllm_launchers(
    settings: VLLMSettings,
    model_path: Path,
    *,
    served_name: str,
    max_lora_rank: int,
    max_loaded_adapters: int,
    dtype: str = "auto",
    max_model_len: int | None = None,
    urls: tuple[str, ...] = (),
) -> list[VLLMLauncher]:
    """One launcher per replica: at ``urls`` when given (one server each), else ``settings.replicas`` on free ports."""
    where: list[str | None] = list(urls) or [None] * settings.replicas
    return [
        VLLMLauncher(
            settings,
            model_path,
            served_name=served_name,
            max_lora_rank=max_lora_rank,
            max_loaded_adapters=max_loaded_adapters,
            dtype=dtype,
            max_model_len=max_model_len,
            url=url,
            index=i,
            of=len(where),
        )
        for i, url in enumerate(where)
    ]
