"""``--sglang-launch``: run ``python -m sglang.launch_server`` as a child process for the SGLang backend.

``SGLangLauncher(settings, model_path, max_lora_rank=..., max_loaded_adapters=...).start()`` starts the
server with the flags dynamic LoRA loading needs (``--enable-lora``, ``--max-lora-rank``,
``--lora-target-modules``, ``--max-loras-per-batch``, ``--max-loaded-loras``; one tokenizer worker,
because SGLang's adapter registry is per worker, SGLang #31084), forwards each line of its output
into our structlog log (logger ``sglang``), waits until ``/health_generate`` answers 200 (or the child
exits, or ``launch_timeout_s`` passes), and returns the URL. ``stop()`` sends SIGTERM to the child's
process group (SGLang runs scheduler and detokenizer subprocesses), then SIGKILL after a grace period.

The module run is ``settings.launch_module`` (default ``sglang.launch_server``); tests point it at the
fake server in ``tests/fakes/sglang_server.py``, which takes the same flags.

Not here: talking to the server once it is up (``runtime/engines/sglang.py``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import structlog

from runtime.settings import SGLangSettings

log = structlog.stdlib.get_logger(__name__)
child_log = structlog.stdlib.get_logger("sglang")


class LaunchError(RuntimeError):
    """The SGLang child process did not come up healthy."""


class SGLangLauncher:
    def __init__(self, settings: SGLangSettings, model_path: Path, *, max_lora_rank: int, max_loaded_adapters: int, grace_s: float = 20.0) -> None:
        self.settings = settings
        self.model_path = Path(model_path)
        self.max_lora_rank = max_lora_rank
        self.max_loaded_adapters = max_loaded_adapters
        self.grace_s = grace_s
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self.url = ""

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

    def start(self) -> str:
        """Start the child and wait for it to be healthy; returns its base URL. Raises :class:`LaunchError`."""
        host, port = "127.0.0.1", 0
        if self.settings.url:
            parts = urlsplit(self.settings.url)
            host, port = parts.hostname or host, parts.port or 30000
        if port == 0:
            port = _free_port(host)
        self.url = f"http://{host}:{port}"
        cmd = self.command(host, port)
        log.info("sglang_launch", command=" ".join(cmd))
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group, so stop() reaches SGLang's subprocesses too
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.info("sglang_started", pid=self.proc.pid, url=self.url)
        self._reader = threading.Thread(target=self._forward_output, name="sglang-log", daemon=True)
        self._reader.start()
        try:
            self._wait_healthy()
        except LaunchError:
            self.stop()
            raise
        return self.url

    def _forward_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip()
            if line:
                child_log.info(line, pid=self.proc.pid)

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.settings.launch_timeout_s
        last = "no answer yet"
        with httpx.Client(timeout=httpx.Timeout(self.settings.connect_timeout_s, read=30.0)) as http:
            while time.monotonic() < deadline:
                code = self.proc.poll()
                if code is not None:
                    raise LaunchError(
                        f"SGLang ({self.settings.launch_module}) exited with code {code} before it was healthy; its output is in the log above"
                    )
                try:
                    resp = http.get(self.url + "/health_generate")
                    if resp.status_code == 200:
                        log.info("sglang_healthy", url=self.url)
                        return
                    last = f"HTTP {resp.status_code}"
                except httpx.TransportError as exc:
                    last = type(exc).__name__
                time.sleep(0.5)
        raise LaunchError(f"SGLang at {self.url} was not healthy within {self.settings.launch_timeout_s:.0f}s (last: {last})")

    def stop(self) -> None:
        """SIGTERM the child's process group, then SIGKILL after ``grace_s``. Safe to call twice."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        log.info("sglang_stopping", pid=proc.pid)
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            log.warning("sglang_kill", pid=proc.pid, after_s=self.grace_s)
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        log.info("sglang_stopped", pid=proc.pid, returncode=proc.returncode)


def _signal_group(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        log.info("sglang_already_gone", pid=proc.pid)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
