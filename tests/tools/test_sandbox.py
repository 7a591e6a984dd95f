"""Sandbox, with real processes: limits (wall, CPU, processes, memory, output), no network, no secrets, fresh folder.

Everything hostile here is sized to be harmless on a shared machine: the fork bomb sleeps when a fork
fails and is capped at 16 processes for 2 s, the memory bombs hit a 64-128 MB address-space limit
(mostly untouched pages), the 1 GB print is killed after about 1 MB past the cap.
"""

from __future__ import annotations

import ast
import asyncio
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tools import Sandbox, SandboxLimits, SandboxResult
from tools.python_runner import format_result, python_tool


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox()


@pytest.fixture(scope="module")
def fallback_sandbox() -> Sandbox:
    return Sandbox(namespaces=False)


def _processes_with_env(fragment: str) -> list[int]:
    """Pids of live (non-zombie) processes whose environment contains ``fragment`` (root can read them all)."""
    found = []
    needle = fragment.encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z" and needle in Path(f"/proc/{entry.name}/environ").read_bytes():
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
            continue
    return found


def test_isolation_in_force_is_reported(sandbox: Sandbox) -> None:
    iso = sandbox.isolation
    assert iso.python and Path(iso.python).exists()
    if os.geteuid() == 0:
        assert iso.run_as_uid is not None, "as root the sandbox must drop to an unprivileged uid (NPROC is not enforced for uid 0)"
    print(f"\nisolation: namespaces={iso.namespaces} network={iso.network} uid={iso.run_as_uid} python={iso.python} notes={iso.notes}")


def test_trivial_program(sandbox: Sandbox) -> None:
    result = sandbox.run_python("import sys\nprint(1)\nprint('to stderr', file=sys.stderr)")
    assert (result.stdout, result.stderr, result.exit_code, result.signal) == ("1\n", "to stderr\n", 0, None)
    assert result.ok and not (result.timed_out or result.memory_exceeded or result.cpu_exceeded or result.output_truncated)
    assert 0 < result.wall_s < 5


def test_failures_are_results_not_exceptions(sandbox: Sandbox) -> None:
    crashed = sandbox.run_python("def f():\n    raise ValueError('bad value')\nf()")
    assert (crashed.ok, crashed.exit_code) == (False, 1)
    assert 'File "main.py", line 3' in crashed.stderr and "ValueError: bad value" in crashed.stderr
    exited = sandbox.run_python("import sys; sys.exit(3)")
    assert (exited.ok, exited.exit_code, exited.signal) == (False, 3, None)
    syntax = sandbox.run_python("def (:")
    assert syntax.exit_code == 1 and "SyntaxError" in syntax.stderr


def test_stdin_and_arbitrary_commands(sandbox: Sandbox) -> None:
    assert sandbox.run_python("print(sum(int(x) for x in input().split()))", stdin="1 2 3\n").stdout == "6\n"
    result = sandbox.run(["sh", "-c", "read x; echo got $x; echo oops >&2; exit 4"], stdin="hello\n")
    assert (result.stdout, result.stderr, result.exit_code) == ("got hello\n", "oops\n", 4)


def test_wall_timeout_kills_an_infinite_loop(sandbox: Sandbox) -> None:
    started = time.monotonic()
    result = sandbox.run_python("while True:\n    pass", limits=SandboxLimits(wall_s=1.0, cpu_s=30))
    assert result.timed_out and not result.ok
    assert result.signal == 9 and result.exit_code is None
    assert not result.cpu_exceeded and not result.memory_exceeded
    assert time.monotonic() - started < 3


def test_cpu_limit_kills_an_infinite_loop(sandbox: Sandbox) -> None:
    result = sandbox.run_python("while True:\n    pass", limits=SandboxLimits(cpu_s=1, wall_s=20))
    assert result.cpu_exceeded and not result.timed_out and not result.memory_exceeded
    assert result.signal == 9 and result.exit_code is None
    assert result.wall_s < 10


def test_wall_timeout_kills_sleepers_and_detached_descendants(sandbox: Sandbox) -> None:
    code = (
        "import os, subprocess, sys\n"
        "print(os.environ['HOME'], flush=True)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "import time; time.sleep(60)\n"
    )
    result = sandbox.run_python(code, limits=SandboxLimits(wall_s=1.0))
    assert result.timed_out
    home = result.stdout.split()[0]
    time.sleep(0.2)
    assert _processes_with_env(home) == []  # the setsid'd grandchild died with the run


def test_fork_bomb_is_capped_and_cleaned_up(sandbox: Sandbox) -> None:
    if os.geteuid() == 0 and sandbox.isolation.run_as_uid is None:
        pytest.skip("running as root without a uid to drop to: RLIMIT_NPROC is not enforced, a fork bomb would not be capped")
    code = (
        "import os, time\n"
        "print('home', os.environ['HOME'], flush=True)\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            print('child', os.getpid(), flush=True)\n"
        "    except OSError as exc:\n"
        "        print('refused', exc.errno, flush=True)\n"
        "        time.sleep(0.2)\n"
    )
    limits = SandboxLimits(max_processes=16, wall_s=2.0, cpu_s=5, memory_mb=64)
    result = sandbox.run_python(code, limits=limits)
    lines = result.stdout.splitlines()
    home = lines[0].split()[1]
    children = {line for line in lines if line.startswith("child")}
    assert result.timed_out
    assert 3 <= len(children) < limits.max_processes  # forking worked, and stopped at the limit
    assert any(line == "refused 11" for line in lines)  # EAGAIN from RLIMIT_NPROC
    time.sleep(0.2)
    assert _processes_with_env(home) == []


def test_memory_bombs(sandbox: Sandbox) -> None:
    at_once = sandbox.run_python("x = bytearray(4 * 1024**3)\nprint('allocated')", limits=SandboxLimits(memory_mb=128))
    assert at_once.memory_exceeded and not at_once.ok and "MemoryError" in at_once.stderr and at_once.stdout == ""
    gradual = sandbox.run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))", limits=SandboxLimits(memory_mb=64, wall_s=10))
    assert gradual.memory_exceeded and not gradual.timed_out and gradual.exit_code == 1
    fine = sandbox.run_python("x = bytearray(16 * 1024**2)\nprint(len(x))", limits=SandboxLimits(memory_mb=128))
    assert fine.ok and not fine.memory_exceeded


def test_a_1gb_print_is_capped_fast_without_server_memory(sandbox: Sandbox) -> None:
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    code = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)\nprint('done', file=sys.stderr)"
    result = sandbox.run_python(code, limits=SandboxLimits(output_bytes=10_000))
    elapsed = time.monotonic() - started
    assert result.output_truncated and not result.ok
    assert result.stdout == "x" * 10_000
    assert "done" not in result.stderr  # killed long before it finished writing 1 GB
    assert result.signal == 9 and not result.memory_exceeded and not result.timed_out
    assert elapsed < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss_before < 50_000  # KiB: the server kept < 50 MB


def test_output_just_over_the_cap_is_truncated_without_killing(sandbox: Sandbox) -> None:
    result = sandbox.run_python("print('a' * 2000)\nprint('end')", limits=SandboxLimits(output_bytes=1000))
    assert result.output_truncated and result.exit_code == 0 and not result.ok
    assert result.stdout == "a" * 1000


@pytest.fixture
def listener() -> tuple[socket.socket, int]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server, server.getsockname()[1]
    server.close()


_CONNECT = (
    "import socket, sys\n"
    "s = socket.socket()\n"
    "s.settimeout(2)\n"
    "try:\n"
    "    s.connect(('127.0.0.1', {port}))\n"
    "    print('connected')\n"
    "except OSError as exc:\n"
    "    print('refused', type(exc).__name__, exc)\n"
)


def _accepted(server: socket.socket) -> bool:
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


@pytest.mark.parametrize("mode", ["default", "fallback"])
def test_no_network(mode: str, sandbox: Sandbox, fallback_sandbox: Sandbox, listener: tuple[socket.socket, int]) -> None:
    server, port = listener
    box = sandbox if mode == "default" else fallback_sandbox
    result = box.run_python(_CONNECT.format(port=port))
    assert result.stdout.startswith("refused"), result
    assert not _accepted(server)
    if mode == "default" and box.isolation.namespaces:
        assert "Network is unreachable" in result.stdout  # the network namespace, not just Python's hook
        shell = box.run(["sh", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected || echo refused"])
        assert "connected" not in shell.stdout
    if mode == "fallback":
        assert "PermissionError" in result.stdout and "network access is disabled" in result.stdout


def test_network_true_really_connects(sandbox: Sandbox, listener: tuple[socket.socket, int]) -> None:
    """Control for the test above: the same program reaches the listener when the network is allowed."""
    server, port = listener
    result = sandbox.run_python(_CONNECT.format(port=port), limits=SandboxLimits(network=True))
    assert result.stdout == "connected\n"
    time.sleep(0.05)
    assert _accepted(server)


def test_server_secrets_are_not_visible(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOPWISE_TEST_SECRET", "s3cr3t-value-123")
    assert "s3cr3t" in (Path(f"/proc/{os.getpid()}/environ").read_text(errors="replace") + os.environ["LOOPWISE_TEST_SECRET"])
    code = (
        "import os\n"
        "print(sorted(os.environ))\n"
        "print(any('s3cr3t' in v for v in os.environ.values()))\n"
        f"try:\n    print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
        "except OSError as exc:\n    print('denied', exc.errno)\n"
    )
    result = sandbox.run_python(code)
    assert result.ok, result
    names, leaked, parent = result.stdout.splitlines()
    assert ast.literal_eval(names) == ["HOME", "LANG", "PATH", "PYTHONDONTWRITEBYTECODE", "TMPDIR"]
    assert leaked == "False"
    assert "s3cr3t" not in result.stdout and parent.startswith("denied")


def test_fresh_working_folder_each_run_removed_afterwards(sandbox: Sandbox) -> None:
    code = (
        "import os\n"
        "print(os.getcwd())\n"
        "print(sorted(os.listdir('.')))\n"
        "print(open('data/input.txt').read())\n"
        "import helper; print(helper.VALUE)\n"
        "open('written.txt', 'w').write('mine')\n"
        "import tempfile; print(tempfile.gettempdir() == os.getcwd() == os.environ['HOME'])\n"
    )
    files = {"data/input.txt": "hello files", "helper.py": "VALUE = 41 + 1\n"}
    first = sandbox.run_python(code, files=files)
    second = sandbox.run_python(code, files=files)
    assert first.ok and second.ok, (first, second)
    cwd1, listing1, content, helper, tmp_is_cwd = first.stdout.splitlines()
    cwd2, listing2, *_ = second.stdout.splitlines()
    assert cwd1 != cwd2
    assert listing1 == listing2 == str(["data", "helper.py", "main.py"])  # written.txt of run 1 is not in run 2
    assert (content, helper, tmp_is_cwd) == ("hello files", "42", "True")
    assert not Path(cwd1).exists() and not Path(cwd2).exists()
    with pytest.raises(ValueError, match="leaves the working folder"):
        sandbox.run_python("print(1)", files={"../escape.txt": "x"})


def test_file_size_limit(sandbox: Sandbox) -> None:
    result = sandbox.run_python("open('big', 'wb').write(b'x' * (3 * 1024 * 1024))", limits=SandboxLimits(file_size_mb=1))
    assert not result.ok
    assert result.signal == 25 or "File too large" in result.stderr  # SIGXFSZ, or EFBIG if the signal is ignored


def test_async_runs_are_concurrent_and_cancellation_kills(sandbox: Sandbox) -> None:
    token = f"cancel-me-{os.getpid()}-{time.monotonic_ns()}"

    async def main() -> tuple[list[SandboxResult], float, list[Path]]:
        started = time.monotonic()
        results = await asyncio.gather(*(sandbox.arun_python(f"import time; time.sleep(0.5); print({i})") for i in range(4)))
        concurrent_s = time.monotonic() - started
        task = asyncio.create_task(sandbox.arun_python(f"# {token}\nimport time\ntime.sleep(30)"))
        await asyncio.sleep(0.5)
        workdirs = [p.parent for p in Path(tempfile.gettempdir()).glob("loopwise-sbx-*/main.py") if token in p.read_text()]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)
        return list(results), concurrent_s, workdirs

    results, concurrent_s, workdirs = asyncio.run(main())
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "3\n"]
    assert concurrent_s < 1.8  # four 0.5 s sleeps overlapped
    assert len(workdirs) == 1  # the cancelled run was live ...
    assert _processes_with_env(str(workdirs[0])) == []  # ... and was killed
    assert not workdirs[0].exists()  # ... and cleaned up


def test_python_tool_observations(sandbox: Sandbox) -> None:
    limits = SandboxLimits(wall_s=1.0)
    tool = python_tool(sandbox, limits)
    ok = asyncio.run(tool(code="print(6 * 7)"))
    assert (ok.ok, ok.content, ok.error_kind, ok.flags["exit_code"]) == (True, "42", None, 0)
    err = asyncio.run(tool(code="print('partial')\n1/0"))
    assert not err.ok and err.error_kind == "exit_code"
    assert err.content.startswith('partial\n[stderr]\nTraceback (most recent call last):\n  File "main.py", line 2')
    assert "<string>" not in err.content and err.content.endswith("ZeroDivisionError: division by zero\n[exit code 1]")
    slow = asyncio.run(tool(code="import time; time.sleep(5)"))
    assert (slow.ok, slow.error_kind, slow.flags["timed_out"]) == (False, "timeout", True)
    assert slow.content == "(no output)" or slow.content.endswith("[timed out after 1 s]")
    flood = asyncio.run(python_tool(sandbox, SandboxLimits(output_bytes=100))(code="print('y' * 500)"))
    assert flood.content.endswith("[output truncated at 100 bytes]") and flood.flags["truncated"]
    silent = asyncio.run(tool(code="x = 1"))
    assert (silent.ok, silent.content) == (True, "(no output)")


def test_format_result_for_memory_and_cpu() -> None:
    limits = SandboxLimits(memory_mb=64, cpu_s=2)
    mem = SandboxResult("", "MemoryError\n", 1, None, False, True, False, False, 0.1)
    cpu = SandboxResult("", "", None, 9, False, False, True, False, 2.1)
    assert format_result(mem, limits).content == "[stderr]\nMemoryError\n[memory limit of 64 MB exceeded; exit code 1]"
    assert format_result(mem, limits).error_kind == "memory_exceeded"
    assert format_result(cpu, limits).content == "[CPU time limit of 2 s exceeded]"


def test_sandbox_python_is_not_the_servers_environment(sandbox: Sandbox) -> None:
    result = sandbox.run_python("import sys\nprint(sys.flags.isolated, sys.flags.no_site, sys.flags.dont_write_bytecode)")
    assert result.stdout == "1 1 1\n"
    assert sys.flags.isolated == 0  # the test process itself is not isolated: the flags above are the sandbox's
