"""Admission: request-dependent CPU work (templating, tokenizing, grammar compilation) runs off the event loop,
bounded in size and time; each key has its own concurrency and queue quota, counted in choices (``n``).

A grammar ``[a-z]{0,10000}`` compiled on the event loop once stalled every client for seconds, and a 4 MB
prompt's templating for 3 s; one key could fill the whole queue.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest

from runtime.admission import KeyQuota, QuotaExceeded
from tests.security._app import KEY1, KEY2, MODEL, auth, chat, served

HELLO = [{"role": "user", "content": "hi"}]


# ---- the quota itself (pure asyncio, no timing) ----------------------------------------------------


def test_quota_counts_choices_and_queues_within_limits():
    async def main():
        q = KeyQuota(max_running=3, max_queued=2)
        a = await q.acquire("k", 2)
        b_task = asyncio.create_task(q.acquire("k", 2))  # 2 + 2 > 3: waits, queued 2
        await asyncio.sleep(0)
        assert q.running("k") == 2 and q.queued("k") == 2 and not b_task.done()
        with pytest.raises(QuotaExceeded):  # neither fits nor queues (2 queued + 2 > 2)
            await q.acquire("k", 2)
        other = await q.acquire("other", 3)  # another key has its own budget
        a()
        b = await asyncio.wait_for(b_task, 1)
        assert q.running("k") == 2 and q.queued("k") == 0
        with pytest.raises(QuotaExceeded, match="n"):
            await q.acquire("k", 4)  # can never fit
        b()
        other()
        assert q.running("k") == 0 and q.running("other") == 0 and q.owners() == 0  # idle owners are forgotten

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_the_queue():
    async def main():
        q = KeyQuota(max_running=1, max_queued=1)
        a = await q.acquire("k", 1)
        waiter = asyncio.create_task(q.acquire("k", 1))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert q.queued("k") == 0
        a()
        (await q.acquire("k", 1))()

    asyncio.run(main())


# ---- through the app ------------------------------------------------------------------------------


@pytest.fixture
def tight(tmp_path, tiny_model_path):
    from runtime.settings import AdmissionSettings

    with served(tmp_path, tiny_model_path, admission=AdmissionSettings(max_running_per_key=2, max_queued_per_key=0)) as app:
        yield app


def test_a_key_over_its_quota_gets_429_and_others_are_served(tight):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 64, "stream": True, "n": 2}
    with tight.stream("POST", "/v1/chat/completions", json=body, headers=auth(KEY1)) as held:  # holds both of key 1's slots
        assert held.status_code == 200
        lines = held.iter_lines()
        next(lines)
        r = chat(tight, KEY1, HELLO)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error" and "retry-after" in r.headers
        assert chat(tight, KEY2, HELLO).status_code == 200
        for _ in lines:  # (TestClient cannot disconnect mid-stream; a real client's disconnect also releases)
            pass
    assert chat(tight, KEY1, HELLO).status_code == 200  # released when the stream ended
    r = chat(tight, KEY1, HELLO, n=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_templating_runs_off_the_event_loop_and_grammars_in_the_worker(tmp_path, tiny_model_path, monkeypatch):
    from runtime.chat_format import ChatFormatter

    threads: dict[str, str] = {}
    render = ChatFormatter.render_plain

    def spy_render(self, *a, **kw):
        threads["render"] = threading.current_thread().name
        return render(self, *a, **kw)

    monkeypatch.setattr(ChatFormatter, "render_plain", spy_render)
    with served(tmp_path, tiny_model_path) as app:
        schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z]{0,20}"}}, "required": ["a"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        r = chat(app, KEY1, HELLO, response_format=fmt, max_tokens=8)
        assert r.status_code == 200, r.text
        worker = app.app.state.engine._grammar_worker
        assert worker.compiles == 1 and worker._proc is not None and worker._proc.pid != os.getpid()
        assert chat(app, KEY2, HELLO, response_format=fmt, max_tokens=8).status_code == 200
        assert worker.compiles == 1  # cached
    assert threads["render"].startswith("loopwise-prepare"), threads


BOMB = {"type": "object", "properties": {"s": {"type": "string", "pattern": "[a-z]{0,10000}"}}, "required": ["s"]}  # 25 s to compile here


def _bomb_beside_a_plain_request(app: Any, **kw: Any) -> dict[str, int]:
    """Key 1 sends the grammar bomb (``kw``: e.g. the model); 0.2 s later key 2 a plain request. Both statuses."""
    results: dict[str, int] = {}

    def bomb() -> None:
        fmt = {"type": "json_schema", "json_schema": {"name": "b", "schema": BOMB}}
        results["bomb"] = chat(app, KEY1, HELLO, response_format=fmt, **kw).status_code

    t = threading.Thread(target=bomb)
    t.start()
    time.sleep(0.2)
    results["plain"] = chat(app, KEY2, HELLO).status_code  # served while the bomb compiles
    t.join()
    return results


def test_a_grammar_bomb_is_killed_at_its_deadline_and_fails_only_its_own_request(tmp_path, tiny_model_path):
    from runtime.settings import AdmissionSettings

    with served(tmp_path, tiny_model_path, admission=AdmissionSettings(grammar_timeout_s=1.0, grammar_penalty_s=30)) as app:
        small = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
        assert chat(app, KEY2, HELLO, response_format=small, max_tokens=4).status_code == 200  # the worker is up
        worker = app.app.state.engine._grammar_worker
        assert _bomb_beside_a_plain_request(app) == {"bomb": 400, "plain": 200}
        assert worker.kills == 1  # the compilation did not go on burning a core after its request gave up
        again = chat(app, KEY1, HELLO, response_format=small, max_tokens=4)
        assert again.status_code == 429 and again.json()["error"]["code"] == "grammar_penalty"
        other = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
        assert chat(app, KEY2, HELLO, response_format=other, max_tokens=4).status_code == 200  # a fresh worker serves others


def test_a_prompt_that_cannot_fit_is_refused_before_templating(tmp_path, tiny_model_path, monkeypatch):
    from runtime.chat_format import ChatFormatter

    calls = []
    render = ChatFormatter.render_plain
    monkeypatch.setattr(ChatFormatter, "render_plain", lambda self, *a, **kw: calls.append(1) or render(self, *a, **kw))
    with served(tmp_path, tiny_model_path) as app:
        r = chat(app, KEY1, [{"role": "user", "content": "word " * 800_000}])  # 4 MB: could never fit the context
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert calls == []


def test_an_agents_grammar_bomb_is_compiled_in_the_worker_and_killed_at_its_deadline(tmp_path, tiny_model_path):
    """An agent served as a model finalizes with the client's response_format: that grammar was built on the event loop
    and compiled by the engine at submit time, on the event loop, with no deadline (every request froze for 25 s)."""
    from agents.host import Host
    from runtime.settings import AdmissionSettings
    from tools.builtins import default_registry

    agent = {"name": "fmt-agent", "tools": [], "max_turns": 1, "max_tokens_per_turn": 4}
    host = Host([agent], default_registry(python=False, cuda=False))
    with served(tmp_path, tiny_model_path, agents=host, admission=AdmissionSettings(grammar_timeout_s=1.0, grammar_penalty_s=30)) as app:
        small = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
        assert chat(app, KEY2, HELLO, model="fmt-agent", response_format=small).status_code == 200
        worker = app.app.state.engine._grammar_worker
        assert worker.compiles >= 1  # the agent's format went through the worker
        assert _bomb_beside_a_plain_request(app, model="fmt-agent") == {"bomb": 400, "plain": 200}
        assert worker.kills == 1
