"""``serve.py``'s supervision of the learner processes it starts: restart on exit, with backoff, and a state file.

    sup = Supervisor("calc-lora", start=lambda: start_learner(job, ...), folder=data_dir / "learner" / "calc-lora",
                     stopping=lambda: uvicorn_server.should_exit)
    sup.start()              # a watcher thread starts the process and watches it
    ...
    sup.request_stop()       # the server stops: SIGTERM to the learner, and no restart
    sup.join(timeout=20)     # wait for it to finish its round; SIGKILL after the timeout

A learner process that exits while the server runs is started again after a delay that doubles from
``Backoff.initial_s`` (1 s) up to ``Backoff.cap_s`` (60 s), back to the initial delay once a process has run
``Backoff.stable_s`` (120 s). Exit status 2 is not restarted: the learner refused its configuration (it says why in
the log) and would refuse it again. Why a restarted learner does not just fail again on the same data: the
learner records the failing batch and quarantines it at its second failure (``learner/quarantine.py``).

What the supervisor knows goes to ``<folder>/supervisor.json`` (written whole at every change; counts are per server
run), which ``GET /admin/learner`` merges into the learner's status as ``supervisor`` and ``/metrics`` exports
(``loopwise_learner_restarts_total``)::

    {"family", "state": "running" | "backoff" | "stopped" | "failed", "pid", "started_at", "restarts",
     "last_exit_code", "last_exit_signal", "last_exit_at", "last_ran_s", "last_error" (the learner's own record of
     why, from its status.json, when it wrote one), "backoff_s", "next_restart_at", "updated_at"}

Each exit, restart and refusal is logged (``learner.supervisor``) with the exit code or signal and the learner's error.

Concurrency: one watcher thread per learner starts every process of that learner and is the only writer of its
state. It must be the thread that starts them: the learner asks Linux for a SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``, ``learner/service.py``), and Linux sends it when the *thread* that forked it exits. The lock
orders a restart against ``request_stop``: once stopping is set no process is started, and the one running is the
one that gets the SIGTERM.

Not here: the learner's command line (``serve.py``'s ``start_learner``), what the learner does (``learner/service.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

__all__ = ["NO_RESTART", "STATE_FILE", "Backoff", "Supervisor"]

log = structlog.get_logger(__name__)

STATE_FILE = "supervisor.json"
NO_RESTART = 2  # the learner's exit status for a configuration it refuses (python -m learner run): restarting cannot help


@dataclass(frozen=True)
class Backoff:
    """Delays between restarts: ``initial_s``, doubling up to ``cap_s``; a process that ran ``stable_s`` resets it."""

    initial_s: float = 1.0
    cap_s: float = 60.0
    stable_s: float = 120.0

    def next(self, previous_s: float | None, ran_s: float) -> float:
        """The delay before the next start, after a process that ran ``ran_s`` (``previous_s``: the delay before it; None at first)."""
        if previous_s is None or ran_s >= self.stable_s:
            return self.initial_s
        return min(self.cap_s, previous_s * 2)


class Supervisor:
    """Starts one learner process, restarts it when it exits (module docstring), and writes ``supervisor.json``."""

    def __init__(
        self,
        family: str,
        start: Callable[[], subprocess.Popen[bytes]],
        folder: Path,
        *,
        stopping: Callable[[], bool] = lambda: False,
        backoff: Backoff = Backoff(),
    ) -> None:
        self.family = family
        self._start = start
        self.path = Path(folder) / STATE_FILE
        self._stopping = stopping
        self.backoff = backoff
        self._lock = threading.Lock()  # orders (re)starts against request_stop
        self._stop = threading.Event()
        self.proc: subprocess.Popen[bytes] | None = None
        self.state: dict[str, Any] = {"family": family, "state": "starting", "restarts": 0, "last_exit_code": None, "last_exit_at": None}
        self._thread = threading.Thread(target=self._watch, name=f"learner-supervisor-{family}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stopping(self) -> bool:
        return self._stop.is_set() or self._stopping()

    def request_stop(self) -> None:
        """The server is stopping: no more restarts; SIGTERM to the running learner (it finishes its round and exits)."""
        with self._lock:
            self._stop.set()
            proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the learner to exit, then SIGKILL it; the state becomes ``stopped``."""
        proc = self.proc
        if proc is not None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("the learner did not stop in time; killing it", family=self.family, pid=proc.pid, timeout_s=timeout)
                proc.kill()
                proc.wait()
        self._thread.join(timeout=5)

    # ---- the watcher thread ----------------------------------------------------------------------
    def _watch(self) -> None:
        delay: float | None = None
        while True:
            with self._lock:
                if self.stopping():
                    break
                started = time.time()
                try:
                    self.proc = self._start()
                except OSError as exc:  # could not even start (no python?): count it as an exit and back off
                    log.error("could not start the learner", family=self.family, error=str(exc))
                    self.proc = None
                if self.proc is not None:
                    self._write(state="running", pid=self.proc.pid, started_at=started, next_restart_at=None)
            code = self.proc.wait() if self.proc is not None else 1
            ran = time.time() - started
            if self.stopping():
                break
            if not self._exited(code, ran, started):
                return
            delay = self.backoff.next(delay, ran)
            self._write(state="backoff", backoff_s=delay, next_restart_at=time.time() + delay)
            log.warning("restarting the learner", family=self.family, in_s=delay, restart=self.state["restarts"] + 1)
            if self._stop.wait(delay) or self._stopping():
                break
            self.state["restarts"] += 1
        self._write(state="stopped", next_restart_at=None)

    def _exited(self, code: int, ran_s: float, started: float) -> bool:
        """Record and log an exit while the server runs; False when it must not be restarted (the learner refused its config)."""
        sig = _signal_name(-code) if code < 0 else None
        error = _learner_error(self.path.parent, since=started)
        self._write(last_exit_code=code, last_exit_signal=sig, last_exit_at=time.time(), last_ran_s=round(ran_s, 1), last_error=error)
        why = f"{error['type']}: {error['message']}" if error else ("killed by " + sig if sig else "no error recorded by the learner")
        if code == NO_RESTART:
            self._write(state="failed", next_restart_at=None)
            log.error("the learner refused its configuration; not restarting it (see its error above)", family=self.family, exit_code=code)
            return False
        log.error("the learner process exited", family=self.family, exit_code=code, signal=sig, ran_s=round(ran_s, 1), error=why)
        return True

    def _write(self, **fields: Any) -> None:
        self.state.update(fields, updated_at=time.time())
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(self.state))
            os.replace(tmp, self.path)
        except OSError as exc:  # the data folder is full or gone: supervision goes on, the state file lags
            log.warning("could not write the learner supervisor's state", path=str(self.path), error=str(exc))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _learner_error(folder: Path, since: float) -> dict[str, Any] | None:
    """The learner's own record of its last crash (``status.json``'s ``last_error``), when it wrote it after ``since``."""
    try:
        err = json.loads((folder / "status.json").read_text()).get("last_error")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    if isinstance(err, dict) and float(err.get("at") or 0) >= since:
        return {k: err.get(k) for k in ("type", "message", "traceback", "at", "failures", "quarantined")}
    return None
