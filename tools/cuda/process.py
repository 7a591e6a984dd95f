"""Run one compiler or GPU-harness process, confined and bounded by a wall timeout: ``run_confined``.

    result = run_confined(["nvcc", "-c", "kernel.cu"], cwd=workdir, env=env, timeout_s=180)
    result.timed_out, result.exit_code, result.output

The command goes through the same util-linux exec chain as ``tools.sandbox`` (so the server never runs
Python between fork and exec):

    setpriv --pdeathsig KILL ─ unshare --user --map-root-user --net --pid --fork --kill-child ─ prlimit ─ argv

- **Wall timeout**: the process runs in its own session; at the deadline the whole process group gets
  SIGKILL, and because the command is the first process of a fresh PID namespace, every descendant dies
  with it (nvcc's cicc/ptxas/gcc, ninja, a hung kernel's host process). ``--pdeathsig``: if the server dies,
  the run dies too.
- **Network**: a fresh, empty network namespace (a kernel or a compile cannot reach anything).
- **Limits** (``prlimit``): CPU seconds per process, file size (which also bounds the output log: a process
  that writes past it gets SIGXFSZ), no core dumps, and optionally address space. CUDA reserves
  terabytes of virtual address space, so the GPU harness runs without ``RLIMIT_AS``; its memory is bounded
  by the GPU and the wall timeout, not by an rlimit.
- Where user namespaces are unavailable (or ``LOOPWISE_CUDA_ISOLATION=none``), only setpriv and prlimit
  remain: the timeout then kills the process group, which a descendant that calls ``setsid`` can leave.

What it does NOT do, unlike ``tools.sandbox.Sandbox``: it does not drop to ``nobody`` when the server is
root. The compile needs the Python headers and the GPU harness needs the server's own interpreter with
torch, which on machines like this one live under a 0700 ``/root`` that ``nobody`` cannot read. Inside the
user namespace the process has no capabilities on the host, but it reads and writes what the server's uid
may (the file system is shared, as in the sandbox). No cgroup, no seccomp, no GPU isolation: a kernel
can read other processes' device memory only as far as the driver allows any process of that uid.
"""

from __future__ import annotations

import functools
import os
import select
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
_LOG_NAME = "_output.log"


@dataclass(frozen=True)
class ProcessResult:
    """How a confined run ended; ``output`` is stdout and stderr interleaved, cut to ``output_bytes``."""

    exit_code: int | None  # None when killed by a signal
    signal: int | None
    timed_out: bool
    output: str
    output_truncated: bool
    wall_s: float
    confined: bool  # user/net/PID namespaces were in force


def _tool(name: str) -> str | None:
    return shutil.which(name, path=_SYSTEM_PATH + ":" + os.environ.get("PATH", ""))


@functools.lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """Whether ``unshare --user --map-root-user --net --pid`` works here (probed once per process)."""
    if os.environ.get("LOOPWISE_CUDA_ISOLATION", "").lower() == "none":
        return False
    unshare = _tool("unshare")
    if unshare is None:
        return False
    try:
        proc = subprocess.run(
            [unshare, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "true"],
            capture_output=True,
            timeout=30,
            env={"PATH": _SYSTEM_PATH},
            cwd="/",
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.info("cuda_namespaces_unavailable", error=repr(exc))
        return False
    if proc.returncode != 0:
        log.info("cuda_namespaces_unavailable", stderr=proc.stderr[-300:].decode(errors="replace"))
    return proc.returncode == 0


def confinement_prefix(*, cpu_s: float, file_size_mb: int, address_space_mb: int | None, max_processes: int | None) -> tuple[list[str], bool]:
    """The exec chain put in front of the command, and whether it includes the namespaces."""
    prefix: list[str] = []
    setpriv, prlimit, unshare = _tool("setpriv"), _tool("prlimit"), _tool("unshare")
    if setpriv:
        prefix += [setpriv, "--pdeathsig", "KILL"]
    use_ns = unshare is not None and namespaces_available()
    if use_ns:
        assert unshare is not None
        prefix += [unshare, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"]
    if prlimit:
        cpu = max(1, int(cpu_s + 0.999))
        limits = [f"--cpu={cpu}:{cpu}", f"--fsize={file_size_mb << 20}", "--core=0", "--nofile=4096"]
        if address_space_mb is not None:
            limits.append(f"--as={address_space_mb << 20}")
        if max_processes is not None and use_ns:  # NPROC counts per user namespace only inside one
            limits.append(f"--nproc={max_processes}")
        prefix += [prlimit, *limits, "--"]
    return prefix, use_ns


def base_env(workdir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """An environment built from scratch (nothing of the server's secrets), plus the GPU selection variables."""
    env = {"PATH": _SYSTEM_PATH, "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C", "LC_ALL": "C", "PYTHONDONTWRITEBYTECODE": "1"}
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LD_LIBRARY_PATH"):
        if name in os.environ:
            env[name] = os.environ[name]
    env.update(extra or {})
    return env


def _wait_unreaped(pid: int, deadline: float) -> bool:
    """Wait until ``pid`` exits or the deadline passes, leaving it a zombie; True when it exited."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):  # kernel < 5.3: poll instead
        pidfd = None
    try:
        while True:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if pidfd is not None:
                select.select([pidfd], [], [], remaining)
            else:
                time.sleep(min(remaining, 0.05))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def run_confined(
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    timeout_s: float,
    cpu_s: float | None = None,
    address_space_mb: int | None = None,
    file_size_mb: int = 1024,
    max_processes: int | None = 256,
    output_bytes: int = 200_000,
) -> ProcessResult:
    """Run ``argv`` in ``cwd``; never raises for the program's own failures (they are fields)."""
    prefix, confined = confinement_prefix(
        cpu_s=cpu_s if cpu_s is not None else timeout_s, file_size_mb=file_size_mb, address_space_mb=address_space_mb, max_processes=max_processes
    )
    log_path = cwd / _LOG_NAME
    started = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            prefix + argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
        try:
            timed_out = not _wait_unreaped(proc.pid, started + timeout_s)
        finally:
            # Before reaping (so the group id cannot have been reused): the group goes, strays included.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # the group is already empty
            proc.wait()
    wall = time.monotonic() - started
    size = log_path.stat().st_size
    with open(log_path, "rb") as f:
        data = f.read(output_bytes)
    rc = proc.returncode
    return ProcessResult(
        exit_code=rc if rc >= 0 else None,
        signal=-rc if rc < 0 else None,
        timed_out=timed_out,
        output=data.decode("utf-8", errors="replace"),
        output_truncated=size > output_bytes,
        wall_s=wall,
        confined=confined,
    )
