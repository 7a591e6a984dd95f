"""Shared fixtures: the tiny model (built once per cache), SmolLM2 (converted once), and real server processes.

``ServerProcess`` starts ``python serve.py`` on a free port as a subprocess, waits for ``/ready``, and
keeps its log for assertions. The model cache is ``.data/models`` in the checkout (override with
``LOOPWISE_TEST_CACHE``), so SmolLM2 is converted at most once per machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_cache() -> Path:
    path = Path(os.environ.get("LOOPWISE_TEST_CACHE", ROOT / ".data" / "models"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_path(model_cache: Path) -> Path:
    from runtime.model_store import ensure_tiny

    return ensure_tiny(model_cache)


class ServerProcess:
    """A real ``serve.py`` process on a free port."""

    def __init__(self, args: list[str], data_dir: Path, env: dict[str, str] | None = None, timeout: float = 180) -> None:
        self.log_path = data_dir / f"server-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w+")
        cmd = [sys.executable, str(ROOT / "serve.py"), "--port", "0", "--data-dir", str(data_dir), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=self._log, text=True, env={**os.environ, **(env or {})})
        self.base_url = self._wait_for_url(timeout)
        self.url = self.base_url + "/v1"

    def _wait_for_url(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
                continue
            m = re.search(r"on (http://[\d.]+:\d+)/v1", line)
            if m:
                base = m.group(1)
                httpx.get(base + "/ready", timeout=10).raise_for_status()
                return base
        raise TimeoutError(f"server did not start in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()


@pytest.fixture(scope="session")
def start_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator:
    """Factory: ``start_server(*extra_args)`` → a running tiny-model server, stopped at session end."""
    started: list[ServerProcess] = []

    def start(
        *extra: str, model: Path | None = None, name: str = "tiny", env: dict[str, str] | None = None, data_dir: Path | None = None
    ) -> ServerProcess:
        data_dir = data_dir or tmp_path_factory.mktemp("server")
        # test servers run without the learner process unless a test asks for it (``--learner``)
        learner = [] if "--learner" in extra else ["--no-learner"]
        args = ["--model", str(model or tiny_model_path), "--served-model-name", name, *learner, *extra]
        server = ServerProcess(args, data_dir, env=env)
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def tiny_server(start_server) -> ServerProcess:
    """One shared tiny-model server for the read-only API tests."""
    return start_server()


CHROMIUM = Path(os.environ.get("LOOPWISE_CHROMIUM", "/usr/bin/chromium"))


@pytest.fixture(scope="module")
def chromium() -> Iterator:
    """Debian's Chromium (``make test`` installs it) driven by playwright; skipped where either is missing (nothing is downloaded).

    Module-scoped on purpose: playwright's sync API keeps an event loop running in this thread while it is
    open, and later tests that call ``asyncio.run`` would fail under it."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency (make install)")
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: `make test` installs Debian's chromium")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield browser
        browser.close()


# ---- PostgreSQL: one throwaway cluster per test session, a fresh database per test ----------------------


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[Any]:
    """A PostgreSQL cluster in a temp folder on a free port (``tests/pgcluster.py``), stopped at the end of the session."""
    from tests import pgcluster

    why = pgcluster.available()
    if why is not None:
        pytest.fail(why)
    cluster = pgcluster.PgCluster(fsync=False).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def pg_url(pg_cluster: Any, request: pytest.FixtureRequest) -> str:
    """The URL of a fresh, empty store on the session's cluster (a schema of its own)."""
    name = "t_" + re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:40] + f"_{time.monotonic_ns() % 10**9}"
    return pg_cluster.create_schema(name)
