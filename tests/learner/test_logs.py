"""One log format per destination (``learner/logs.py``), checked in fresh interpreters (logging is global state):
JSON lines when not a terminal, readable lines on a terminal (a real pseudo-terminal), learner lines tagged,
httpx's per-request lines only at DEBUG, third-party warnings dropped, and a live status line that log lines
and relayed child output print above instead of tearing."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

EMIT = """
import logging, warnings, structlog
from learner.logs import configure_logging
chosen = configure_logging({level!r}, {fmt!r}, process={process!r})
print("chosen", chosen, flush=True)
logging.getLogger("runtime.app").info("serving model %s", "tiny")
structlog.get_logger("learner.service").info("learner round", version=3)
logging.getLogger("httpx").info("HTTP Request: GET http://127.0.0.1/admin/adapters 200 OK")
warnings.warn_explicit("a library's own warning", UserWarning, "lib.py", 1, module="transformers.modeling_utils")
warnings.warn_explicit("deprecated in a library", FutureWarning, "lib.py", 1, module="transformers.modeling_utils")
warnings.warn_explicit("a warning of ours", UserWarning, "x.py", 1, module="runtime.engines.embedded")
"""


def run(level: str = "info", fmt: str = "json", process: str = "server", env: dict[str, str] | None = None) -> tuple[str, str]:
    code = EMIT.format(level=level, fmt=fmt, process=process)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stderr
    return p.stdout, p.stderr


def test_json_when_not_a_terminal_with_httpx_at_debug_and_library_warnings_dropped():
    out, err = run(fmt="auto", process="learner")
    assert "chosen json" in out  # stderr is a pipe here
    events = [json.loads(line) for line in err.splitlines()]  # every line is JSON: no other format mixed in
    by_event = {e["event"]: e for e in events}
    assert by_event["serving model tiny"]["logger"] == "runtime.app" and by_event["serving model tiny"]["level"] == "info"
    assert by_event["learner round"]["version"] == 3 and all(e["process"] == "learner" for e in events)
    assert not any("HTTP Request" in e["event"] for e in events)
    warned = [e["event"] for e in events if e["logger"] == "py.warnings"]
    assert len(warned) == 1 and "a warning of ours" in warned[0]


def test_debug_shows_internal_http_calls_as_debug():
    _, err = run(level="debug", fmt="json")
    http = [json.loads(line) for line in err.splitlines() if "HTTP Request" in line]
    assert len(http) == 1 and http[0]["level"] == "debug" and http[0]["process"] == "server"


def test_learner_lines_are_tagged_in_the_console_format():
    out, err = run(fmt="console", process="learner")
    assert "chosen console" in out
    lines = err.splitlines()
    assert not any(line.lstrip().startswith("{") for line in lines)
    assert any(re.search(r"\d\d:\d\d:\d\d .*info.*learner │ serving model tiny", line) for line in lines), lines
    assert any("learner │ learner round" in line and "version=3" in line for line in lines), lines
    _, err = run(fmt="console", process="server")
    assert any("serving model tiny" in line and "│" not in line for line in err.splitlines())


STATUS = """
import logging, subprocess, sys, time
from learner.logs import StatusLine, configure_logging, relay
print(configure_logging("info", "auto", process="server"), flush=True)
line = StatusLine(refresh_per_second=20).start()
CHILD = "import time\\nfor i in range(5):\\n    print(f'child line {i} ' + 'y' * 20, flush=True); time.sleep(0.03)"
child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
t = relay(child.stdout, "child")
for i in range(20):
    line.update(f"STATUS {i} " + "s" * 20)
    logging.getLogger("runtime.app").info("log line %d %s", i, "x" * 20)
    time.sleep(0.02)
child.wait(); t.join(5)
line.stop()
print("done", flush=True)
"""

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def test_a_live_status_line_is_not_torn_by_log_lines_or_relayed_output():
    master, slave = pty.openpty()
    os.set_blocking(master, False)
    env = {**os.environ, "COLUMNS": "160", "LINES": "40", "TERM": "xterm-256color"}
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(STATUS)], cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    raw = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            raw += chunk
        elif p.poll() is not None:
            break
    os.close(master)
    assert p.wait(10) == 0, raw.decode(errors="replace")[-2000:]
    text = ANSI.sub("", raw.decode(errors="replace"))
    lines = [seg for line in text.split("\n") for seg in line.split("\r") if seg.strip()]
    assert lines[0].strip() == "console"  # a terminal: readable lines
    logged = [line for line in lines if "log line" in line]
    child = [line for line in lines if "child line" in line]
    assert len({re.search(r"log line (\d+)", line).group(1) for line in logged}) == 20
    assert len({re.search(r"child line (\d)", line).group(1) for line in child}) == 5
    for line in logged + child:  # each whole on its own line, never mixed with the status line
        assert "STATUS" not in line and ("x" * 20 in line or "y" * 20 in line), line
    assert any(line.startswith("STATUS") for line in lines)  # the status line was drawn
    assert lines[-1].strip() == "done"


def test_the_console_url_printed_at_startup():
    from runtime.identity import InternalKey
    from serve import console_line

    url = "http://127.0.0.1:8000"
    internal = InternalKey("k-internal")
    assert console_line(url, internal, with_key=True) == "loopwise console: http://127.0.0.1:8000/console#key=k-internal"
    assert "k-internal" not in console_line(url, internal, with_key=False)  # not into a pipe or a log file
    assert "mine" not in console_line(url, "mine", with_key=True) and "/console" in console_line(url, "mine", with_key=True)
    assert "--admin-key" in console_line(url, None, with_key=True)
