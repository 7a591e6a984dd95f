"""Run the fake SGLang server (``tests/fakes/sglang_server.py``) as a real process on a free port.

``FakeSGLang(model_path, log_dir, *flags)`` starts ``python -m tests.fakes.sglang_server`` and waits for
``/health_generate``; ``kill()`` sends SIGKILL (SGLang dying), ``restart()`` starts it again on the same
port with the same flags, ``stop()`` ends it. Used by the test fixtures and ``bench/sglang_overhead.py``.

Not here: the fake's HTTP behaviour (``sglang_server.py``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
# LoRA on, and seeds honoured (as SGLang on a GPU with --enable-deterministic-inference; its CPU path ignores them)
DEFAULT_FLAGS = (
    *("--enable-lora", "--max-lora-rank", "64", "--lora-target-modules", "all", "--max-loras-per-batch", "16", "--max-loaded-loras", "64"),
    "--enable-deterministic-inference",
)


def wait_healthy(proc: subprocess.Popen[bytes], health_url: str, timeout: float, label: str, log: Callable[[], str]) -> None:
    """Until ``health_url`` answers 200; a process that exits first, or a deadline passed, raises with its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{label} exited with {proc.returncode}:\n{log()}")
        try:
            if httpx.get(health_url, timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{label} not healthy in {timeout}s:\n{log()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeSGLang:
    def __init__(self, model_path: Path, log_dir: Path, *flags: str, timeout: float = 180) -> None:
        self.model_path = Path(model_path)
        self.flags = flags or DEFAULT_FLAGS
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"fake-sglang-{self.port}.log"
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "tests.fakes.sglang_server", "--model-path", str(self.model_path), "--port", str(self.port), *self.flags]
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.wait_healthy()

    def wait_healthy(self) -> None:
        assert self.proc is not None
        wait_healthy(self.proc, self.url + "/health_generate", self.timeout, "fake SGLang", self.log)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
