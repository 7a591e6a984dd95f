"""Shared fixtures: the tiny model (built once per cache), SmolLM2 (converted once), and servers on real ports.

``start_server(*flags)`` gives a server built from ``serve.py``'s flags. By default it is an
:class:`InProcServer`: ``serve.build`` (the composition ``serve.py`` runs) served by uvicorn on a free port
in a thread of the test process, so the real client packages talk to it over a socket, without the ~8 s a
new interpreter spends importing torch and transformers. ``process=True`` starts ``python serve.py`` itself
as a :class:`ServerProcess`, which keeps its log for assertions; ``--learner``, ``--sglang-launch``,
``--vllm-launch``, ``--threads`` and ``env`` imply it (a child process, or an effect on the whole process).
The model cache is ``.data/models`` in the checkout (override with ``LOOPWISE_TEST_CACHE``), so SmolLM2 is
converted at most once per machine.

Three session-wide settings save CPU and change no result: ``OMP_WAIT_POLICY=passive`` (idle OpenMP threads
sleep instead of spinning; the processes the tests start inherit it), ``OMP_NUM_THREADS=1`` on a parallel run (one
intra-op thread per process: the xdist workers and their servers already share the cores) and one SSL context shared by every httpx client of
the test process (``one_ssl_context_for_all_clients``).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import _file_order

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Idle OpenMP threads sleep rather than spin (set here, before anything imports torch; children inherit it). The suite
# runs small models next to its own client threads and servers on few cores, where a spinning pool thread burns a core
# doing nothing: a tiny-model chat request in process cost ~95 ms of CPU spinning, ~18 ms sleeping. Same threads, same
# kernels, same results; ``OMP_WAIT_POLICY=active make test`` restores the spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")


ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    # One OpenMP thread per process on the parallel run: three pytest-xdist workers and the servers and learners they
    # start share two cores, so a second intra-op thread per process only adds contention (load 4-5 on 2 cores; make
    # test 409 -> 379 s). Set in the controlling process, before it starts the workers, so that each worker and each
    # process a test starts has it before torch loads. Tests that are about threads pass --threads or set it themselves;
    # ``OMP_NUM_THREADS=2 make test`` restores torch's default. A one-process run (``make test-engines``: real vLLM
    # servers under hot swaps, ``JOBS=0``) keeps the default: there a single-threaded engine only runs slower.
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


# the order files reach the xdist workers: longest first (tests/_file_order.py)
def pytest_addoption(parser: pytest.Parser) -> None:
    _file_order.add_option(parser)


@pytest.hookimpl(trylast=True)  # after the deselections of tests/runtime/conftest.py
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _file_order.order_by_recorded_seconds(items)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _file_order.note_report(report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _file_order.write_record(session)


@pytest.fixture(scope="session", autouse=True)
def one_ssl_context_for_all_clients() -> Iterator[None]:
    """Every httpx client of the test process (``httpx.get``/``post``, openai's, anthropic's, the runtime's own) shares
    one default SSL context instead of building its own.

    Building one loads the whole CA bundle: about 35 ms of CPU per client, and ``httpx.post(...)`` builds a client per
    call, so a test making a few hundred plain-HTTP requests spent seconds parsing certificates it never used
    (the suite's requests all go to 127.0.0.1 over http). Only the default (``verify=True``, no client cert) is
    shared, keyed by the environment it was read from; any other ``verify`` builds its own as before. Where httpx's
    private hook is missing (another httpx), nothing changes but the speed."""
    from httpx._transports import default as transports

    create = getattr(transports, "create_ssl_context", None)
    if create is None:
        yield
        return
    shared: dict[tuple[bool, str | None, str | None], Any] = {}
    lock = threading.Lock()

    def create_shared(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None:
            return create(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        with lock:
            if key not in shared:
                shared[key] = create(verify=verify, cert=cert, trust_env=trust_env)
            return shared[key]

    transports.create_ssl_context = create_shared
    try:
        yield
    finally:
        transports.create_ssl_context = create


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
        self.data_dir = data_dir
        self.log_path = data_dir / f"server-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w+")
        self._terminated = False
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
        if not self._log.closed:  # also readable after stop()
            self._log.flush()
        return self.log_path.read_text()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM, once (``stop`` waits for the exit): the session's servers are all told first, so they shut down side by side."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.terminate()

    def stop(self) -> None:
        self.terminate()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=45)  # serve.py waits up to 20 s for its learners to finish their round
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()


class InProcServer:
    """``serve.build(settings)`` (the app ``serve.py`` serves, from the same flags) behind uvicorn on a free port, in a thread.

    What ``serve.main`` adds around the app stays out: logging setup, the umask, the learner process, the
    announce line. Use a :class:`ServerProcess` for those."""

    def __init__(self, args: list[str], data_dir: Path, timeout: float = 180) -> None:
        import uvicorn

        import serve

        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        settings = serve.settings_from_args(["--port", "0", "--data-dir", str(data_dir), *args])
        self.built = serve.build(settings)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((settings.server.host, 0))
        self._uv = uvicorn.Server(uvicorn.Config(self.built.app, log_config=None, timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._uv.run, kwargs={"sockets": [sock]}, name=f"inproc-server-{data_dir.name}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uv.started:
            if not self._thread.is_alive():
                raise RuntimeError("the in-process server stopped while starting (its lifespan failed; see the captured log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the in-process server did not start in {timeout}s")
            time.sleep(0.02)
        host, port = sock.getsockname()[:2]
        self.base_url = f"http://{host}:{port}"
        self.url = self.base_url + "/v1"
        httpx.get(self.base_url + "/ready", timeout=10).raise_for_status()

    def log(self) -> str:
        raise NotImplementedError("an in-process server has no log of its own: start_server(..., process=True) for one")

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._uv.should_exit

    def terminate(self) -> None:
        """Start uvicorn's graceful shutdown without waiting for it (``stop`` waits)."""
        self._uv.should_exit = True

    def stop(self) -> None:
        """uvicorn's graceful shutdown: in-flight requests finish, then the lifespan closes the engine and the recorder."""
        self.terminate()
        self._thread.join(timeout=30)


# flags whose effect reaches past the app (a child process, process-wide torch threads): those servers are processes
PROCESS_FLAGS = ("--learner", "--sglang-launch", "--vllm-launch", "--threads")


@pytest.fixture(scope="session")
def start_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator:
    """Factory: ``start_server(*extra_args)`` → a running tiny-model server (in process unless ``process=True``), stopped at session end."""
    started: list[ServerProcess | InProcServer] = []

    def start(
        *extra: str,
        model: Path | None = None,
        name: str = "tiny",
        env: dict[str, str] | None = None,
        data_dir: Path | None = None,
        process: bool = False,
    ) -> ServerProcess | InProcServer:
        data_dir = data_dir or tmp_path_factory.mktemp("server")
        # test servers run without the learner process unless a test asks for it (``--learner``)
        learner = [] if "--learner" in extra else ["--no-learner"]
        args = ["--model", str(model or tiny_model_path), "--served-model-name", name, *learner, *extra]
        process = process or env is not None or any(flag in extra for flag in PROCESS_FLAGS)
        server = ServerProcess(args, data_dir, env=env) if process else InProcServer(args, data_dir)
        started.append(server)
        return server

    yield start
    for s in started:  # all told to stop first: each waits for its learners' round (up to 20 s), side by side, not one after another
        s.terminate()
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def tiny_server(start_server) -> InProcServer:
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
