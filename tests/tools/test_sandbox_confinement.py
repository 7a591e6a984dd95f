"""The sandbox's file-system confinement, with real processes: a private ``/proc`` and ``/tmp``, the host's files out
of sight, only the run's folder writable, and a distinct uid per concurrent run (when the server is root).

Sandboxed code once read the server's command line (with its keys) from ``/proc``, the data folder's databases,
and a concurrent run's files in the shared ``/tmp``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from tools import Sandbox


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    box = Sandbox()
    if not box.isolation.mounts:
        pytest.skip(f"no mount namespace on this machine: {box.isolation.notes}")
    return box


def test_the_confinement_in_force_is_reported() -> None:
    iso = Sandbox().isolation
    if iso.namespaces and os.path.exists("/usr/bin/mount"):
        assert iso.mounts, iso.notes  # this kind of machine (and CI) has user + mount namespaces
    if os.geteuid() == 0 and iso.namespaces:
        assert iso.uid_pool > 1


def test_proc_shows_only_the_runs_own_processes(sandbox: Sandbox) -> None:
    code = (
        "import os, json\n"
        "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        f"try:\n    cmd = open('/proc/{os.getpid()}/cmdline', 'rb').read().decode(errors='replace')\n"
        "except OSError as exc:\n    cmd = 'unreadable %d' % exc.errno\n"
        "print(json.dumps({'pids': pids, 'server': cmd}))\n"
    )
    result = sandbox.run_python(code)
    assert result.ok, result
    seen = json.loads(result.stdout)
    assert seen["pids"] == [1]  # the run's own PID namespace, and its own /proc
    assert seen["server"].startswith("unreadable")


def test_host_files_are_out_of_sight(sandbox: Sandbox) -> None:
    data = Path(tempfile.mkdtemp(prefix="loopwise-host-data-", dir="/tmp"))
    try:
        data.chmod(0o755)
        secret = data / "interactions.db"
        secret.write_text("tenant data")
        secret.chmod(0o644)  # world-readable in a world-readable folder: only the mount namespace keeps it out of reach
        here = Path(__file__).resolve()
        code = (
            "import os\n"
            f"for p in [{str(secret)!r}, {str(here)!r}, '/root']:\n"
            "    try:\n        print(p, 'visible', len(os.listdir(p)) if os.path.isdir(p) else len(open(p).read()))\n"
            "    except OSError as exc:\n        print(p, 'hidden', exc.errno)\n"
            "print(sorted(os.listdir('/')))\n"
        )
        result = sandbox.run_python(code)
    finally:
        shutil.rmtree(data)
    assert result.ok, result
    lines = result.stdout.splitlines()
    assert all(line.endswith(" hidden 2") for line in lines[:3]), lines  # ENOENT: not there at all, not just unreadable
    top = eval(lines[3])
    assert {"tmp", "proc", "usr"} <= set(top) and not {"root", "work", "home", "var"} & set(top), top


def test_only_the_runs_folder_and_a_private_tmp_are_writable(sandbox: Sandbox) -> None:
    marker = f"loopwise-private-{uuid.uuid4().hex}"
    code = (
        "import os\n"
        f"for p in ['/usr/lib/x', '/etc/x', '/x', '/dev/x', 'mine.txt', '/tmp/{marker}']:\n"
        "    try:\n        open(p, 'w').write('x'); print(p, 'written')\n"
        "    except OSError as exc:\n        print(p, 'refused', exc.errno)\n"
    )
    result = sandbox.run_python(code)
    assert result.ok, result
    status = {line.split()[0]: line.split()[1] for line in result.stdout.splitlines()}
    assert {k for k, v in status.items() if v == "written"} == {"mine.txt", f"/tmp/{marker}"}, status
    assert not Path("/tmp", marker).exists()  # its /tmp is not the host's


def test_concurrent_runs_see_neither_each_others_files_nor_uids(sandbox: Sandbox) -> None:
    marker = f"loopwise-shared-{uuid.uuid4().hex}"
    writer = (
        "import os, time, json\n"
        f"open('/tmp/{marker}', 'w').write('a'); open('secret.txt', 'w').write('a')\n"
        "print(json.dumps({'cwd': os.getcwd(), 'map': open('/proc/self/uid_map').read().split()}))\n"
        "time.sleep(1.5)\n"
    )

    def reader(path_hint: str) -> str:
        return (
            "import os, time, json\n"
            "time.sleep(0.5)\n"
            f"found = [p for p in os.listdir('/tmp') if p == {marker!r}]\n"
            f"others = [d for d in os.listdir({path_hint!r}) if d != os.path.basename(os.getcwd())] if os.path.isdir({path_hint!r}) else []\n"
            "print(json.dumps({'found': found, 'others': others, 'map': open('/proc/self/uid_map').read().split()}))\n"
        )

    async def both():
        root = os.path.dirname(Path(sandbox._workdir_root or "/tmp").resolve() / "x")
        return await asyncio.gather(sandbox.arun_python(writer), sandbox.arun_python(reader(root)))

    a, b = asyncio.run(both())
    assert a.ok and b.ok, (a, b)
    seen_a, seen_b = json.loads(a.stdout), json.loads(b.stdout)
    assert seen_b["found"] == [] and seen_b["others"] == []
    if os.geteuid() == 0:
        assert seen_a["map"][1] != seen_b["map"][1]  # two concurrent runs, two host uids
        assert int(seen_a["map"][1]) != 0 and int(seen_b["map"][1]) != 0
