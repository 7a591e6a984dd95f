"""``python serve.py`` itself, once per backend: what the in-process servers of the other HTTP tests leave out.

Most HTTP tests serve ``serve.build``'s app in the test process (``tests/conftest.py``). This module starts the
real process on each backend and checks what only it does: it announces its URL on stdout and stays quiet on a
pipe about keys, serves the OpenAI surface through the real client (chat, stream, models, feedback, metrics),
records to the database in its ``--data-dir`` with private file modes, and ends cleanly on SIGTERM.
"""

from __future__ import annotations

import contextlib
import signal
import sqlite3
import stat
import time

import httpx
from _client import MODEL, USER, client, metrics

ADMIN = "smoke-admin"


def test_serve_py_serves_records_and_stops_on_sigterm(start_backend_server):
    srv = start_backend_server("--admin-key", ADMIN, process=True)
    oai = client(srv)
    assert MODEL in {m.id for m in oai.models.list()}
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    ids = r.model_extra["loopwise"]
    chunks = list(oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    fb = httpx.post(srv.url + "/feedback", json={"turn_id": ids["turn_id"], "reward": 1.0}, timeout=30)
    assert fb.status_code == 200, fb.text
    assert metrics(srv)['loopwise_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 2

    db = srv.data_dir / "interactions.db"
    deadline = time.monotonic() + 30
    while True:  # the recorder commits shortly after the response
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as conn:
            found = conn.execute("SELECT count(*) FROM turns WHERE turn_id = ?", (ids["turn_id"],)).fetchone()[0]
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert found == 1
    assert stat.S_IMODE(srv.data_dir.stat().st_mode) == 0o700 and stat.S_IMODE(db.stat().st_mode) == 0o600

    srv.stop()  # SIGTERM
    assert srv.proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM after a clean shutdown
    log = srv.log()
    assert "Traceback" not in log and ADMIN not in log, log[-3000:]
