"""Run untrusted code in a separate, resource-limited process: ``Sandbox.run_python`` / ``arun_python`` / ``run``.

    from tools.sandbox import Sandbox, SandboxLimits
    result = Sandbox().run_python("print(1)")          # SandboxResult(stdout='1\\n', exit_code=0, ...)
    result = await Sandbox().arun_python(code, stdin="3\\n", files={"data.txt": "..."})

Every run gets a fresh temporary working folder (the code's cwd, ``HOME`` and ``TMPDIR``; ``files`` are
written there first) that is removed afterwards, and an environment built from scratch (``PATH``,
``HOME``, ``TMPDIR``, ``LANG``): nothing of the server's ``os.environ`` (API keys, database URLs) is
inherited. Python runs as ``python -I -S -B`` (isolated mode, no site-packages: standard library only).
The program's failures never raise: they come back as flags on ``SandboxResult`` (``timed_out``,
``memory_exceeded``, ``cpu_exceeded``, ``output_truncated``, ``exit_code``/``signal``).

How the process is confined (an exec chain of util-linux tools, so the server never runs Python code
between fork and exec, and forks stay cheap even when the server holds gigabytes):

    setpriv --pdeathsig KILL [--reuid/--regid <run uid>] ─ unshare --user --map-root-user --mount --net
        --pid --fork --kill-child ─ sh (mounts the run's root, pivot_root) ─ setpriv (no capabilities)
        ─ prlimit (cpu, as, nproc, fsize, nofile, core) ─ python -I -S -B

(``--pdeathsig``: if the server dies, the run dies with it. ``unshare`` re-raises its child's fatal
signal on itself; it runs under the server's own ``RLIMIT_CORE``, so where the server allows core
dumps, a segfaulting program also leaves a small core of ``unshare``, in the working folder by default.)

- **File system**: a fresh mount namespace whose root is an empty read-only tmpfs holding read-only
  binds of the system folders (``/usr``, ``/bin``, ``/lib*``, ``/etc``, and the interpreter's prefix
  when it lives elsewhere), ``/dev/{null,zero,full,random,urandom}``, a private ``/proc`` (only the run's
  own PID namespace), a private size-limited ``/tmp`` and ``/dev/shm``, and the run's working folder,
  bound read-write at its host path: the only host folder the code can write, and the only one of the
  server's it can see. The server's data folder, other runs' folders, the host's ``/tmp``, ``/proc``,
  ``/home`` and ``/root`` are not there at all. The old root is detached (``pivot_root``), and the
  program runs with an empty capability bounding set, so it cannot mount, unmount or ``chroot`` its
  way back.
- **Users**: when the server is root, each concurrent run drops to its own uid from a pool of unused
  uids (``UID_BASE`` onwards, no passwd entry), so runs cannot signal, trace or read each other even
  through a shared path; the working folder belongs to that uid. A server that is not root has only
  its own uid: runs are then kept apart by their namespaces alone.
- **Network**: a fresh network namespace (only a loopback interface, which is down): ``connect`` fails
  with "Network is unreachable", for every program, not only Python. Abstract unix sockets are per
  namespace too. Where user namespaces are not allowed, the fallback is a Python audit hook that refuses
  ``socket.connect/bind/sendto/getaddrinfo`` — this only covers Python code, and audit hooks are not a
  security boundary (ctypes, a spawned ``curl``, or ``run(argv)`` bypass it).
- **Processes**: ``RLIMIT_NPROC`` is checked per user namespace, so inside the fresh user namespace it
  counts only this run's processes (a fork bomb stops at ``max_processes``). A fresh PID namespace means
  that killing its first process kills every descendant, even ones that called ``setsid``; the wall
  timeout kills the process group with SIGKILL. Linux never enforces ``RLIMIT_NPROC`` for real uid 0,
  so a server running as root drops the sandbox to an unprivileged uid first (``setpriv``), using an
  interpreter that behaves the same for that user (probed once; on this kind of machine, where the
  server's Python lives under a 0700 ``/root``, the system ``/usr/bin/python3`` is chosen). Without user
  namespaces the limit counts all processes of the uid, so it is raised by the number the uid already runs.
- **CPU / memory / files**: ``RLIMIT_CPU`` (per process, whole seconds: ceil(cpu_s); soft = hard, so the
  kernel sends SIGKILL, which also reaches the PID namespace's first process), ``RLIMIT_AS`` (address
  space, which is stricter than resident memory; programs that reserve large virtual ranges, such as
  the JVM or CUDA, need a larger ``memory_mb``), ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE`` = 1024, ``RLIMIT_CORE`` = 0.
  The private ``/tmp`` holds at most ``4 * file_size_mb`` (at least 16 MB).
- **Output**: stdout and stderr are read incrementally and each kept up to ``output_bytes``; a program
  that keeps writing past the cap (more than ``max(output_bytes, 1 MiB)`` extra) is killed, so a 1 GB
  print costs the server at most a few hundred kilobytes.

What it does NOT protect against:
- The system folders are readable (read-only): world-readable files under ``/etc`` and ``/usr`` can be
  read, as any local user could. ``/sys`` is not mounted.
- Where the machine refuses mount namespaces (``Isolation.mounts`` is false, said in ``notes`` and the
  log), the file system is shared: the code can read whatever its uid can read. Where user namespaces
  are refused too, so is the network confinement (see above). Run the server as a dedicated user, or in
  a container, on such machines.
- The program is PID 1 of its namespace, so signals it sends *itself* with a default action (``kill -TERM
  $$``, ``os.kill(os.getpid(), 9)``) are ignored; faults (a real segfault) and our kills still work.
- ``CPU`` is limited per process, not per tree; the wall timeout bounds the tree. The working folder's
  total size is not bounded (each file is, by ``RLIMIT_FSIZE``).
- No cgroup: memory is bounded per process by address space, not as total resident memory of the tree.
- Kernel exploits, side channels, and anything a local unprivileged user could do.
- Detection of memory exhaustion is heuristic: ``MemoryError``/``Cannot allocate memory``/``bad_alloc``
  in stderr, or a SIGKILL that was neither the wall timeout, the CPU limit, nor the output cap.

Requires Linux with util-linux (``prlimit``, ``setpriv``, ``unshare``; ``mount``, ``umount`` and
``pivot_root`` for the file-system confinement); ``SandboxUnavailable`` is raised at construction
otherwise. Exceptions: ``SandboxError`` ▸ ``SandboxUnavailable``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import selectors
import shutil
import signal as signal_module
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")  # bound read-only into a run's root
UID_BASE = 1_500_000_000  # runs of a root server get uids UID_BASE .. UID_BASE + UID_POOL - 1 (no passwd entries)
UID_POOL = 1024
_READ_CHUNK = 65536
_FLOOD_ALLOWANCE = 1 << 20  # bytes past the cap a program may write before it is killed
_EXIT_GRACE_S = 0.2  # after the main process exits, how long descendants may keep the pipes open
_TAIL_BYTES = 4096  # stderr tail kept for the memory heuristic even when the head was truncated
_UNSHARE_SIGKILL_QUIRK = b"unshare: sigprocmask unblock failed: Invalid argument\n"
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")
_NETWORK_EVENTS = (
    "socket.connect",
    "socket.bind",
    "socket.sendto",
    "socket.sendmsg",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyaddr",
)

# Runs inside the sandboxed interpreter (as ``python -I -S -B -c``): optionally installs the network
# audit hook, then executes main.py as __main__ with the working folder importable.
_BOOTSTRAP = """\
import sys
def _lw_boot(block_network):
    if block_network:
        events = frozenset({events!r})
        def hook(event, args):
            if event in events:
                raise PermissionError("network access is disabled in this sandbox (" + event + ")")
        sys.addaudithook(hook)
    sys.argv[:] = ["main.py"]
    sys.path.insert(0, "")
    with open("main.py", "rb") as f:
        code = compile(f.read(), "main.py", "exec")
    main = sys.modules["__main__"].__dict__
    del main["_lw_boot"]
    main["__file__"] = "main.py"
    exec(code, main)
_lw_boot({block})
"""


# Runs as the first process of the run's user + mount + PID namespaces (uid 0 there, the run's uid outside):
# builds the run's root on an empty tmpfs, pivots into it, detaches the old root, drops every capability
# and execs the confined command. Arguments: root mountpoint, working folder, /tmp size in MB, the
# read-only folders, "--", the command. Once confined it writes one byte to the ready fd, so the run's wall clock
# starts with the program, not with the confinement's setup (the program inherits that fd: once the supervisor has
# read the byte and closed its end, writing there only fails).
_CONFINE = r"""
set -e
path=$PATH; PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
r=$1; w=$2; tmp_mb=$3; ready=$4; shift 4
mount -t tmpfs -o size=1m,mode=755,nosuid,nodev loopwise-root "$r"
while [ "$1" != "--" ]; do
  d=$1; shift
  if [ -L "$d" ]; then mkdir -p "$r$(dirname "$d")"; ln -s "$(readlink "$d")" "$r$d"
  elif [ -d "$d" ]; then mkdir -p "$r$d"; mount --rbind -o ro "$d" "$r$d"
  fi
done
shift
mkdir -p "$r/dev/shm" "$r/proc" "$r/tmp"
for n in null zero full random urandom; do touch "$r/dev/$n"; mount --bind "/dev/$n" "$r/dev/$n"; done
ln -s /proc/self/fd "$r/dev/fd"
mount -t proc -o nosuid,nodev,noexec proc "$r/proc"
mount -t tmpfs -o "size=${tmp_mb}m,mode=1777,nosuid,nodev" loopwise-tmp "$r/tmp"
mount -t tmpfs -o "size=${tmp_mb}m,mode=1777,nosuid,nodev,noexec" loopwise-shm "$r/dev/shm"
mkdir -p "$r$w"
mount --bind "$w" "$r$w"
mount -o remount,ro,bind "$r"
cd "$r"
pivot_root . .
umount -l .
cd "$w"
PATH=$path
unset OLDPWD PWD
printf x > "/proc/self/fd/$ready"  # (dash redirects only fds 0-9; reopening the pipe through /proc works for any)
exec "$@"
"""
SETUP_LIMIT_S = 60.0  # longest the confinement's setup may take (a loaded machine) before the run counts as timed out


class SandboxError(Exception):
    """Base class for sandbox setup errors (never raised for the sandboxed program's own failures)."""


class SandboxUnavailable(SandboxError):
    """The machine lacks what the sandbox needs (Linux, util-linux's prlimit/setpriv/unshare)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one run. ``cpu_s`` is rounded up to whole seconds (RLIMIT_CPU's unit)."""

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    max_processes: int = 32
    file_size_mb: int = 16
    output_bytes: int = 64_000
    network: bool = False


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run produced; failures of the program are flags, not exceptions."""

    stdout: str
    stderr: str
    exit_code: int | None  # None when the process was killed by a signal
    signal: int | None
    timed_out: bool
    memory_exceeded: bool
    cpu_exceeded: bool
    output_truncated: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.memory_exceeded or self.cpu_exceeded or self.output_truncated)


@dataclass(frozen=True)
class Isolation:
    """What confinement is in force on this machine (probed once per process and interpreter)."""

    namespaces: bool  # user + network + PID namespaces
    run_as_uid: int | None  # first uid of the pool runs drop to (when the server is root), else None
    python: str  # interpreter used by run_python
    notes: tuple[str, ...] = field(default=())
    mounts: bool = False  # a mount namespace with the run's own root (private /proc and /tmp, only its folder writable)
    uid_pool: int = 0  # distinct uids concurrent runs get (0: every run has the server's uid, or run_as_uid)
    ro_dirs: tuple[str, ...] = ()  # host folders bound read-only into a run's root

    @property
    def network(self) -> str:
        return "network namespace" if self.namespaces else "python audit hook (python code only)"


def _require_tool(name: str) -> str:
    path = shutil.which(name, path=_SYSTEM_PATH + ":" + os.environ.get("PATH", ""))
    if path is None:
        raise SandboxUnavailable(f"the sandbox needs `{name}` from util-linux; install util-linux (apt-get install util-linux)")
    return path


def _probe_output(argv: list[str], pass_fds: tuple[int, ...] = ()) -> str | None:
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=30, env={"PATH": _SYSTEM_PATH, "LANG": "C.UTF-8"}, cwd="/", pass_fds=pass_fds)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.info("sandbox_probe_failed", argv=argv[:6], error=repr(exc))
        return None
    if proc.returncode != 0:
        log.info("sandbox_probe_failed", argv=argv[:6], returncode=proc.returncode, stderr=proc.stderr[-300:].decode(errors="replace"))
        return None
    return proc.stdout.decode(errors="replace")


_INTERPRETER_PROBE = "import sys, os, json; print(sys.version, os.__file__, json.__file__)"
_PREFIX_PROBE = (
    "import sys, os, json; print(json.dumps(sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, "
    "os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))})))"
)
_isolation_cache: dict[tuple[str, bool | None], Isolation] = {}
_isolation_lock = threading.Lock()


def probe_isolation(python: str | None = None, namespaces: bool | None = None) -> Isolation:
    """Find out (once) which confinement works here: namespaces, the uid to drop to, the interpreter.

    ``namespaces=False`` forces the fallback without namespaces (tests use it); ``None`` detects.
    """
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable("the sandbox needs Linux (rlimits, namespaces)")
    key = (python or sys.executable, namespaces)
    with _isolation_lock:
        if key in _isolation_cache:
            return _isolation_cache[key]
        setpriv, unshare = _require_tool("setpriv"), _require_tool("unshare")
        _require_tool("prlimit")
        notes: list[str] = []
        drop = [setpriv, f"--reuid={UID_BASE}", f"--regid={UID_BASE}", "--clear-groups"] if os.geteuid() == 0 else []
        ns_argv = [unshare, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"]
        use_ns = False
        if namespaces is not False:
            use_ns = _probe_output([*drop, *ns_argv, "true"]) is not None
            if not use_ns:
                notes.append("user/network/PID namespaces unavailable: network blocked for Python code only, NPROC counts the whole uid")
        prefix = [*drop, *(ns_argv if use_ns else [])]
        candidates = [python] if python else [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]
        chosen: str | None = None
        for cand in dict.fromkeys(candidates):
            if not os.path.exists(cand):
                continue
            expected = _probe_output([cand, "-I", "-S", "-c", _INTERPRETER_PROBE])
            if expected is not None and _probe_output([*prefix, cand, "-I", "-S", "-c", _INTERPRETER_PROBE]) == expected:
                chosen = cand
                break
            notes.append(f"{cand} does not run the same for the sandbox user; skipped")
        run_as: int | None = UID_BASE if drop else None
        if chosen is None and drop:
            # No interpreter is usable by an unprivileged uid: keep the server's uid (root), and say so loudly.
            chosen, run_as = python or sys.executable, None
            notes.append("no interpreter usable by an unprivileged uid: running as root inside the namespaces; NPROC is not enforced for root")
        elif chosen is None:
            raise SandboxUnavailable(f"no usable Python interpreter among {candidates}")
        ro_dirs = _read_only_dirs(chosen)
        mounts = False
        if use_ns:
            mounts = _probe_mounts(drop, ns_argv, chosen, ro_dirs)
            if not mounts:
                notes.append("mount namespaces unavailable: the file system is shared (the code reads what its uid may read)")
        iso = Isolation(
            namespaces=use_ns,
            run_as_uid=run_as,
            python=chosen,
            notes=tuple(notes),
            mounts=mounts,
            uid_pool=UID_POOL if run_as is not None else 0,
            ro_dirs=ro_dirs,
        )
        log.info(
            "sandbox_isolation",
            namespaces=iso.namespaces,
            mounts=iso.mounts,
            run_as_uid=iso.run_as_uid,
            uid_pool=iso.uid_pool,
            python=iso.python,
            notes=list(iso.notes),
        )
        _isolation_cache[key] = iso
        return iso


def _read_only_dirs(python: str) -> tuple[str, ...]:
    """The system folders plus the interpreter's prefixes that lie outside them (a venv or a uv-managed Python)."""
    found = _probe_output([python, "-I", "-S", "-c", _PREFIX_PROBE])
    prefixes = json.loads(found) if found else []
    extra = [p for p in prefixes if p and not any(p == d or p.startswith(d + "/") for d in _SYSTEM_DIRS)]
    return tuple(d for d in dict.fromkeys([*_SYSTEM_DIRS, *extra]) if os.path.lexists(d))


def _probe_mounts(drop: list[str], ns_argv: list[str], python: str, ro_dirs: tuple[str, ...]) -> bool:
    """Whether a run's own root can be built here (the interpreter answering the same inside it as outside)."""
    if any(shutil.which(t, path="/usr/local/sbin:/usr/sbin:/sbin:" + _SYSTEM_PATH) is None for t in ("mount", "umount", "pivot_root")):
        return False
    expected = _probe_output([python, "-I", "-S", "-c", _INTERPRETER_PROBE])
    top = Path(tempfile.mkdtemp(prefix="loopwise-probe-"))
    try:
        root, work = top / "root", top / "work"
        root.mkdir()
        work.mkdir()
        uid = UID_BASE if drop else None
        if uid is not None:
            for p in (top, root, work):
                os.chown(p, uid, uid)
        ready_r, ready_w = os.pipe()
        try:
            if uid is not None:
                os.fchown(ready_w, uid, uid)
            argv = [*drop, ns_argv[0], "--mount", *ns_argv[1:], *_confine_argv(str(root), str(work), 16, ro_dirs, ready_w)]
            out = _probe_output([*argv, python, "-I", "-S", "-c", _INTERPRETER_PROBE], pass_fds=(ready_w,))
        finally:
            os.close(ready_r)
            os.close(ready_w)
        return out is not None and out == expected
    finally:
        _remove_tree(top)


def _confine_argv(root: str, workdir: str, tmp_mb: int, ro_dirs: tuple[str, ...], ready_fd: int) -> list[str]:
    return ["/bin/sh", "-c", _CONFINE, "loopwise-confine", root, workdir, str(tmp_mb), str(ready_fd), *ro_dirs, "--"]


class _UidPool:
    """Distinct uids for concurrent runs of a root server (``UID_BASE`` onwards)."""

    def __init__(self, base: int, size: int) -> None:
        self._free = list(range(base + size - 1, base - 1, -1))
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise SandboxError(f"more than {UID_POOL} sandboxed runs at once")
            return self._free.pop()

    def release(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid)


def _uid_process_count(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += 1
            except FileNotFoundError:
                continue
    return count


_executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="sandbox")
_uid_pool = _UidPool(UID_BASE, UID_POOL)


class Sandbox:
    """Runs code in a confined child process; one instance can serve many concurrent runs."""

    def __init__(
        self,
        limits: SandboxLimits = SandboxLimits(),
        *,
        python: str | None = None,
        namespaces: bool | None = None,
        workdir_root: str | None = None,
    ) -> None:
        self.limits = limits
        self.isolation = probe_isolation(python, namespaces)
        self._workdir_root = workdir_root
        self._tools = {name: _require_tool(name) for name in ("setpriv", "prlimit", "unshare")}

    # -- public API -------------------------------------------------------------------------------

    def run_python(
        self, code: str, *, stdin: str | None = None, files: dict[str, str] | None = None, limits: SandboxLimits | None = None
    ) -> SandboxResult:
        return self._run_python(code, stdin=stdin, files=files, limits=limits, cancel=None)

    async def arun_python(
        self, code: str, *, stdin: str | None = None, files: dict[str, str] | None = None, limits: SandboxLimits | None = None
    ) -> SandboxResult:
        cancel = threading.Event()
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(_executor, lambda: self._run_python(code, stdin=stdin, files=files, limits=limits, cancel=cancel))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancel.set()  # the worker kills the process group within ~50 ms and cleans up
            raise

    def run(
        self, argv: list[str], *, stdin: str | None = None, files: dict[str, str] | None = None, limits: SandboxLimits | None = None
    ) -> SandboxResult:
        """Run an arbitrary command (resolved on the sandbox's PATH) in the sandbox."""
        return self._execute(list(argv), stdin=stdin, files=files, limits=limits or self.limits, cancel=None)

    async def arun(
        self, argv: list[str], *, stdin: str | None = None, files: dict[str, str] | None = None, limits: SandboxLimits | None = None
    ) -> SandboxResult:
        cancel = threading.Event()
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(
            _executor, lambda: self._execute(list(argv), stdin=stdin, files=files, limits=limits or self.limits, cancel=cancel)
        )
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancel.set()
            raise

    # -- internals --------------------------------------------------------------------------------

    def _run_python(
        self, code: str, *, stdin: str | None, files: dict[str, str] | None, limits: SandboxLimits | None, cancel: threading.Event | None
    ) -> SandboxResult:
        lim = limits or self.limits
        block = not lim.network and not self.isolation.namespaces
        bootstrap = _BOOTSTRAP.format(events=_NETWORK_EVENTS, block=block)
        argv = [self.isolation.python, "-I", "-S", "-B", "-c", bootstrap]
        return self._execute(argv, stdin=stdin, files={**(files or {}), "main.py": code}, limits=lim, cancel=cancel)

    def _command(self, argv: list[str], lim: SandboxLimits, uid: int | None, root: Path | None, workdir: Path, ready_fd: int | None) -> list[str]:
        iso = self.isolation
        cmd = [self._tools["setpriv"], "--pdeathsig", "KILL"]
        if uid is not None:
            cmd += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        nproc = lim.max_processes
        if iso.namespaces:
            net = [] if lim.network else ["--net"]
            mount = ["--mount"] if root is not None else []
            cmd += [self._tools["unshare"], "--user", "--map-root-user", *mount, *net, "--pid", "--fork", "--kill-child"]
            if root is not None:
                assert ready_fd is not None
                cmd += _confine_argv(str(root), str(workdir), max(16, 4 * lim.file_size_mb), iso.ro_dirs, ready_fd)
                # inside the run's root: no capabilities left, so nothing can be mounted, unmounted or chroot-ed
                cmd += [self._tools["setpriv"], "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--"]
        else:
            nproc += _uid_process_count(uid if uid is not None else os.getuid())
        cpu = max(1, math.ceil(lim.cpu_s))
        mem = lim.memory_mb * 1024 * 1024
        fsize = lim.file_size_mb * 1024 * 1024
        # NPROC is set after unshare: a user namespace checks its parent level against the limit in
        # force when it was created, so setting it earlier would cap all sandboxes of the uid together.
        cmd += [
            self._tools["prlimit"],
            f"--cpu={cpu}:{cpu}",
            f"--as={mem}",
            f"--nproc={nproc}",
            f"--fsize={fsize}",
            "--nofile=1024",
            "--core=0",
            "--",
        ]
        return cmd + argv

    def _make_workdir(self, files: dict[str, str], uid: int | None) -> tuple[Path, Path | None]:
        """The run's working folder (with ``files``) and, under a mount namespace, the empty mountpoint of its root."""
        workdir = Path(tempfile.mkdtemp(prefix="loopwise-sbx-", dir=self._workdir_root))
        root = Path(tempfile.mkdtemp(prefix="loopwise-root-", dir=self._workdir_root)) if self.isolation.mounts else None
        base = workdir.resolve()
        for rel, content in files.items():
            target = (workdir / rel).resolve()
            if base not in target.parents:
                _remove_tree(workdir)
                if root is not None:
                    _remove_tree(root)
                raise ValueError(f"sandbox file path {rel!r} leaves the working folder")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content, encoding="utf-8")
        if uid is not None:
            for dirpath, dirnames, filenames in os.walk(workdir):
                for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                    os.chown(name, uid, uid)
            if root is not None:
                os.chown(root, uid, uid)
        return workdir, root

    def _execute(
        self, argv: list[str], *, stdin: str | None, files: dict[str, str] | None, limits: SandboxLimits, cancel: threading.Event | None
    ) -> SandboxResult:
        started = time.monotonic()
        uid = _uid_pool.acquire() if self.isolation.run_as_uid is not None else None
        try:
            workdir, root = self._make_workdir(files or {}, uid)
            try:
                env = {"PATH": _SYSTEM_PATH, "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
                stdin_file = None
                if stdin is not None:
                    stdin_file = tempfile.TemporaryFile()
                    stdin_file.write(stdin.encode("utf-8"))
                    stdin_file.seek(0)
                ready_r, ready_w = os.pipe() if root is not None else (None, None)
                if ready_w is not None and uid is not None:
                    os.fchown(ready_w, uid, uid)  # the confinement reopens it through /proc as the run's uid
                try:
                    proc = subprocess.Popen(
                        self._command(argv, limits, uid, root, workdir, ready_w),
                        stdin=stdin_file if stdin_file is not None else subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        cwd=workdir,
                        env=env,
                        start_new_session=True,
                        close_fds=True,
                        pass_fds=(ready_w,) if ready_w is not None else (),
                    )
                except BaseException:
                    if ready_r is not None:
                        os.close(ready_r)
                    raise
                finally:
                    if stdin_file is not None:
                        stdin_file.close()
                    if ready_w is not None:
                        os.close(ready_w)
                return _supervise(proc, limits, started, cancel, ready_r)
            finally:
                _remove_tree(workdir)
                if root is not None:
                    _remove_tree(root)
        finally:
            if uid is not None:
                _uid_pool.release(uid)  # its processes are gone: the PID namespace died with its first process


class _Stream:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.head = bytearray()
        self.tail = b""
        self.dropped = 0

    def feed(self, data: bytes) -> None:
        room = self.cap - len(self.head)
        if room > 0:
            self.head += data[:room]
        self.dropped += max(0, len(data) - max(room, 0))
        self.tail = (self.tail + data)[-_TAIL_BYTES:]

    def strip_suffix(self, suffix: bytes) -> None:
        self.tail = self.tail.removesuffix(suffix)
        if self.head.endswith(suffix):
            del self.head[-len(suffix) :]

    def text(self) -> str:
        return self.head.decode("utf-8", errors="replace")


def _pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # kernel < 5.3 or a platform without it: fall back to polling
        return None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal_module.SIGKILL)
    except ProcessLookupError:
        pass  # already gone: nothing left to kill


def _supervise(
    proc: subprocess.Popen[bytes], lim: SandboxLimits, started: float, cancel: threading.Event | None, ready_fd: int | None = None
) -> SandboxResult:
    """Read both pipes up to the cap, enforce the wall timeout, reap the process with its rusage.

    With ``ready_fd`` the wall clock starts when the confinement says the program starts (its setup gets
    ``SETUP_LIMIT_S``); without, at ``started``."""
    run = _Supervision(proc, lim, started, ready_fd)
    try:
        run.watch(cancel)
    finally:
        run.reap()
    return run.result()


class _Supervision:
    """One sandboxed process under ``_supervise``: its two output streams, a selector over its pipes, its pidfd (readable
    once it exits) and the confinement's ready pipe, the wall deadline, and how the watch ended."""

    def __init__(self, proc: subprocess.Popen[bytes], lim: SandboxLimits, started: float, ready_fd: int | None) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.proc, self.lim, self.started = proc, lim, started
        self.stdout, self.stderr = proc.stdout, proc.stderr
        self.streams = {proc.stdout.fileno(): _Stream(lim.output_bytes), proc.stderr.fileno(): _Stream(lim.output_bytes)}
        self.out, self.err = self.streams[proc.stdout.fileno()], self.streams[proc.stderr.fileno()]
        self.sel = selectors.DefaultSelector()
        for fd in self.streams:
            self.sel.register(fd, selectors.EVENT_READ)
        self.pipes_open = set(self.streams)
        # A pidfd becomes readable when the process exits, so its exit wakes the select (no polling).
        self.pidfd = _pidfd_open(proc.pid)
        if self.pidfd is not None:
            self.sel.register(self.pidfd, selectors.EVENT_READ)
        self.ready_fd = ready_fd
        if ready_fd is not None:
            self.sel.register(ready_fd, selectors.EVENT_READ)
        self.deadline = started + (SETUP_LIMIT_S if ready_fd is not None else lim.wall_s)
        self.timed_out = self.flooded = self.cancelled = False
        self.status: int | None = None  # the wait status, once reaped
        self.cpu_used = 0.0  # user + system seconds, from the rusage once reaped
        self.exited_at = 0.0
        self.poll_s = 0.001

    def watch(self, cancel: threading.Event | None) -> None:
        """Read the pipes until the process has exited and they are closed (or descendants kept them open for
        ``_EXIT_GRACE_S`` after its exit), or until the deadline passes, ``cancel`` is set or the output floods."""
        flood_limit = max(self.lim.output_bytes, _FLOOD_ALLOWANCE)
        while True:
            now = time.monotonic()
            if now >= self.deadline:
                self.timed_out = True
                return
            if cancel is not None and cancel.is_set():
                self.cancelled = True
                return
            self._wait(min(self.deadline - now, 0.05))
            if self.out.dropped + self.err.dropped > flood_limit:
                self.flooded = True
                return
            if self.status is None:
                pid, st, ru = os.wait4(self.proc.pid, os.WNOHANG)
                if pid:
                    self.status, self.cpu_used, self.exited_at = st, ru.ru_utime + ru.ru_stime, time.monotonic()
            if self.status is not None and (not self.pipes_open or time.monotonic() - self.exited_at > _EXIT_GRACE_S):
                return  # done, or descendants hold the pipes open after the main process exited

    def _wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` for output, the exit or the ready pipe, and take what came."""
        if self.pidfd is None and self.status is None and not self.pipes_open:
            timeout, self.poll_s = min(timeout, self.poll_s), min(self.poll_s * 2, 0.02)  # no pidfd: poll for the exit
        if not self.sel.get_map():
            time.sleep(timeout)
            return
        for key, _ in self.sel.select(timeout=timeout):
            if key.fd == self.pidfd:
                self.sel.unregister(self.pidfd)
            elif key.fd == self.ready_fd:  # confined: the program starts now (or setup failed: the exit status says)
                os.read(self.ready_fd, 16)
                self.sel.unregister(self.ready_fd)
                os.close(self.ready_fd)
                self.ready_fd = None
                self.deadline = time.monotonic() + self.lim.wall_s
            elif data := os.read(key.fd, _READ_CHUNK):
                self.streams[key.fd].feed(data)
            else:
                self.sel.unregister(key.fd)
                self.pipes_open.discard(key.fd)

    def reap(self) -> None:
        """Kill the process group, reap the process (waiting for it if it still runs), close every descriptor."""
        _kill_group(self.proc.pid)
        if self.status is None:
            _, self.status, rusage = os.wait4(self.proc.pid, 0)
            self.cpu_used = rusage.ru_utime + rusage.ru_stime
        self.proc.returncode = os.waitstatus_to_exitcode(self.status)
        self.sel.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
        if self.ready_fd is not None:
            os.close(self.ready_fd)
        self.stdout.close()
        self.stderr.close()

    def result(self) -> SandboxResult:
        """The reaped run's result: its output, exit, and which limit (if any) ended it; a failed run is logged."""
        assert self.status is not None  # reap() has run
        out, err, lim = self.out, self.err, self.lim
        timed_out, flooded, cancelled, cpu_used = self.timed_out, self.flooded, self.cancelled, self.cpu_used
        wall = time.monotonic() - self.started
        exit_code = os.WEXITSTATUS(self.status) if os.WIFEXITED(self.status) else None
        sig = os.WTERMSIG(self.status) if os.WIFSIGNALED(self.status) else None
        if exit_code == 1 and err.tail.endswith(_UNSHARE_SIGKILL_QUIRK):
            # unshare re-raises its child's fatal signal on itself, which cannot work for SIGKILL: it
            # exits 1 with this message instead. Report what really happened to the program.
            exit_code, sig = None, int(signal_module.SIGKILL)
            err.strip_suffix(_UNSHARE_SIGKILL_QUIRK)
        cpu_limit = max(1, math.ceil(lim.cpu_s))
        # rusage under-reports against the kernel's RLIMIT_CPU clock (0.7 s seen for a 1 s kill), hence the margin.
        cpu_exceeded = (
            sig in (signal_module.SIGXCPU, signal_module.SIGKILL) and not (timed_out or flooded or cancelled) and cpu_used >= cpu_limit * 0.5
        )
        tail = (err.tail + bytes(err.head[-_TAIL_BYTES:])).decode("utf-8", errors="replace")
        memory_exceeded = (exit_code not in (0, None) and any(m in tail for m in _MEMORY_MARKERS)) or (
            sig == signal_module.SIGKILL and not (timed_out or flooded or cancelled or cpu_exceeded)
        )
        result = SandboxResult(
            stdout=out.text(),
            stderr=err.text(),
            exit_code=exit_code,
            signal=sig,
            timed_out=timed_out,
            memory_exceeded=memory_exceeded,
            cpu_exceeded=cpu_exceeded,
            output_truncated=bool(out.dropped or err.dropped),
            wall_s=wall,
        )
        if not result.ok:
            log.info(
                "sandbox_run_failed",
                exit_code=exit_code,
                signal=sig,
                timed_out=timed_out,
                memory_exceeded=memory_exceeded,
                cpu_exceeded=cpu_exceeded,
                output_truncated=result.output_truncated,
                cancelled=cancelled,
                wall_s=round(wall, 3),
                cpu_s=round(cpu_used, 3),
            )
        return result


def _remove_tree(path: Path) -> None:
    def retry_writable(func: object, failed: str, exc_info: object) -> None:
        # The sandboxed code may have removed permissions from its own files: restore and retry once.
        os.chmod(os.path.dirname(failed), 0o700)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, 0o700)
            shutil.rmtree(failed)
        else:
            os.unlink(failed)

    try:
        shutil.rmtree(path, onerror=retry_writable)
    except OSError:
        log.exception("sandbox_workdir_cleanup_failed", path=str(path))
