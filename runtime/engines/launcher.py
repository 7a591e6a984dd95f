"""Run an engine server (SGLang, vLLM) as a child process of ``serve.py``: start it, wait until it is healthy, stop it.

``ServerLauncher`` is one child: ``start()`` picks the host and port (from ``url``, else a free port on
127.0.0.1), starts the command in its own process group (the servers run scheduler and worker subprocesses)
within our session (one autogroup for the CPU scheduler: see ``start``), forwards each line of its output into
our structlog log (logger = the backend's name), waits until ``health_path`` answers 200 (or the child exits,
or ``launch_timeout_s`` passes) and returns the base URL. ``stop()`` sends SIGTERM to the process group, then
SIGKILL after a grace period.
Subclasses (``runtime/engines/sglang_launcher.py``, ``runtime/engines/vllm_launcher.py``) give the command and its
environment. ``start_all`` starts several children at once (replicas) and stops them all if one fails.

Not here: talking to a server once it is up (``runtime/engines/``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlsplit

import httpx
import structlog

log = structlog.stdlib.get_logger(__name__)


class LaunchError(RuntimeError):
    """The child process did not come up healthy."""


class ServerLauncher:
    name: ClassVar[str] = ""  # log event prefix and the child's logger name
    label: ClassVar[str] = ""
    health_path: ClassVar[str] = "/health"
    default_port: ClassVar[int] = 8000

    def __init__(self, *, url: str | None, launch_timeout_s: float, connect_timeout_s: float = 5.0, grace_s: float = 20.0) -> None:
        self.requested_url = url
        self.launch_timeout_s = launch_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.grace_s = grace_s
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self.url = ""

    def command(self, host: str, port: int) -> list[str]:
        raise NotImplementedError

    def child_env(self) -> dict[str, str]:
        """Extra environment variables of the child (on top of ours)."""
        return {}

    def _what(self) -> str:
        return self.label

    def start(self) -> str:
        """Start the child and wait for it to be healthy; returns its base URL. Raises :class:`LaunchError`."""
        host, port = "127.0.0.1", 0
        if self.requested_url:
            parts = urlsplit(self.requested_url)
            host, port = parts.hostname or host, parts.port or self.default_port
        if port == 0:
            port = free_port(host)
        self.url = f"http://{host}:{port}"
        cmd = self.command(host, port)
        log.info(f"{self.name}_launch", command=" ".join(cmd))
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,  # a background process group of our session must never read the terminal
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            # its own process group, so stop() reaches the server's subprocesses too, but our session: where the kernel
            # groups tasks by session for fair CPU shares (sched_autogroup_enabled, most distributions' default), an
            # engine in a session of its own left loopwise's event loop waiting hundreds of ms for a core beside it
            process_group=0,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.child_env()},
        )
        log.info(f"{self.name}_started", pid=self.proc.pid, url=self.url)
        self._reader = threading.Thread(target=self._forward_output, name=f"{self.name}-log", daemon=True)
        self._reader.start()
        try:
            self._wait_healthy()
        except LaunchError:
            self.stop()
            raise
        return self.url

    def _forward_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        child_log = structlog.stdlib.get_logger(self.name)
        for line in self.proc.stdout:
            line = line.rstrip()
            if line:
                child_log.info(line, pid=self.proc.pid)

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.launch_timeout_s
        last = "no answer yet"
        with httpx.Client(timeout=httpx.Timeout(self.connect_timeout_s, read=30.0)) as http:
            while time.monotonic() < deadline:
                code = self.proc.poll()
                if code is not None:
                    raise LaunchError(f"{self._what()} exited with code {code} before it was healthy; its output is in the log above")
                try:
                    resp = http.get(self.url + self.health_path)
                    if resp.status_code == 200:
                        log.info(f"{self.name}_healthy", url=self.url)
                        return
                    last = f"HTTP {resp.status_code}"
                except httpx.TransportError as exc:
                    last = type(exc).__name__
                time.sleep(0.5)
        raise LaunchError(f"{self.label} at {self.url} was not healthy within {self.launch_timeout_s:.0f}s (last: {last})")

    def stop(self) -> None:
        """SIGTERM the child's process group, then SIGKILL after ``grace_s``. Safe to call twice."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        log.info(f"{self.name}_stopping", pid=proc.pid)
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            log.warning(f"{self.name}_kill", pid=proc.pid, after_s=self.grace_s)
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        deadline = time.monotonic() + 10  # the leader is gone; its workers may still be exiting
        while (left := live_group_members(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            log.warning(f"{self.name}_kill_leftovers", pid=proc.pid, members=left)
            _signal_group(proc, signal.SIGKILL)
        if self._reader is not None:
            self._reader.join(timeout=5)
        log.info(f"{self.name}_stopped", pid=proc.pid, returncode=proc.returncode)


def start_all(launchers: Sequence[ServerLauncher]) -> list[str]:
    """Start every launcher at once (each waits for its own health); if one fails, stop them all and raise."""
    with ThreadPoolExecutor(max_workers=max(1, len(launchers))) as pool:
        futures = [pool.submit(launcher.start) for launcher in launchers]
        errors = [f.exception() for f in futures]
    failed = [e for e in errors if e is not None]
    if failed:
        for launcher in launchers:
            launcher.stop()
        raise failed[0]
    return [launcher.url for launcher in launchers]


def _signal_group(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        log.info("child_already_gone", pid=proc.pid)


def live_group_members(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` that are still running (zombies excluded), from ``/proc``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields after the command: state, ppid, pgrp, ...
            members.append(int(stat.parent.name))
    return members


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
