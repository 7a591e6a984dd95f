"""Run the fake vLLM pooling server (``tests/fakes/vllm_server.py``) as a real process on a free port.

``FakeVLLMPooling(model_path, log_dir)`` starts ``python -m tests.fakes.vllm_server MODEL --runner pooling --convert
embed`` and waits for ``/health``; ``stop()`` ends it.

Not here: the fake's HTTP behaviour (``vllm_server.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.fakes.sglang_process import ROOT, free_port, wait_healthy


class FakeVLLMPooling:
    def __init__(self, model_path: Path, log_dir: Path, *, served_name: str = "tiny", timeout: float = 180) -> None:
        self.model_path = Path(model_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"fake-vllm-{self.port}.log"
        cmd = [sys.executable, "-m", "tests.fakes.vllm_server", str(self.model_path), "--port", str(self.port)]
        cmd += ["--runner", "pooling", "--convert", "embed", "--served-model-name", served_name]
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_healthy(self.proc, self.url + "/health", timeout, "fake vLLM", self.log)
        except TimeoutError:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
