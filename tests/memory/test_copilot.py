"""The memory copilot inside the agent host, over a scripted engine (real tokenizer, formatter, recorder, SQLite).

What is checked: the memory reaches the next run's system prompt (in the recorded context ids), the
rewrite is recorded as the copilot's own trajectory and stored as a version with its provenance, the
answer comes back while a rewrite is still waiting on the model, a failing copilot is logged and keeps
the old memory, callers without a user get no user memory, and ``when: episode`` buffers until a
rewarded run.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from structlog.testing import capture_logs
from transformers import AutoTokenizer

from agents.host import Host
from memory.copilot import COPILOT_AGENT, MEMORY_HEADER
from memory.store import MemoryStore, Provenance
from runtime.engine import GenerateRequest, GenerateResult
from runtime.identity import Caller, use_caller
from tests.agents._scripted import ScriptedEngine, make_client
from tools.builtins import default_registry

ALICE = Caller("key-aaaa", "alice")


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path):
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def is_copilot(req: GenerateRequest) -> bool:
    return req.request_id.startswith("memopilot-")


class GatedEngine(ScriptedEngine):
    """Copilot calls wait for ``gate`` (or raise ``fail``); player calls answer at once."""

    def __init__(self, tok, script, gate: asyncio.Event | None = None, fail: Exception | None = None) -> None:
        super().__init__(tok, script)
        self.gate, self.fail = gate, fail

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if is_copilot(req):
            if self.fail is not None:
                raise self.fail
            if self.gate is not None:
                await self.gate.wait()
        return await super().generate(req)


def reply(req: GenerateRequest) -> str:
    return "<memory>Alice wants answers in French.</memory>" if is_copilot(req) else "The answer is 5."


def make_host(tok, tmp_path: Path, engine: ScriptedEngine, memory: dict | None = None):
    client, recorder, store = make_client(tok, engine, tmp_path)
    mem = MemoryStore(tmp_path / "memory.db")
    cfg = {"name": "mem-agent", "stop_policy": "answer", "constrain_format": False, "memory": memory or {"scope": "user"}}
    host = Host([cfg], default_registry(), memory=mem)
    host.bind(client)
    agent = host.get("mem-agent")
    assert agent is not None and agent.copilot is not None
    return agent, recorder, store, mem


def test_memory_reaches_the_next_prompt_with_versions_and_provenance(tok, tmp_path):
    lessons = iter(["<memory>Alice wants answers in French.</memory>", "Sure:\n<memory>Alice wants French; she asks sums.</memory>"])
    engine = ScriptedEngine(tok, lambda req: next(lessons) if is_copilot(req) else "The answer is 5.")
    agent, recorder, store, mem = make_host(tok, tmp_path, engine)

    async def go():
        with use_caller(ALICE):
            first = await agent.chat([{"role": "user", "content": "2+3?"}], session_id="alice", request_id="r1", options={})
            await agent.copilot.drain()
            second = await agent.chat([{"role": "user", "content": "4+1?"}], session_id="alice", request_id="r2", options={})
            await agent.copilot.drain()
        await recorder.flush()
        return first, second

    first, second = asyncio.run(go())
    assert first.content == "The answer is 5."
    cur = mem.current("key-aaaa", "user:alice")
    assert cur is not None and cur.text == "Alice wants French; she asks sums." and cur.version == 2  # rewritten after each interaction
    versions = mem.versions("key-aaaa", "user:alice")
    assert [v.version for v in versions] == [2, 1] and versions[1].text == "Alice wants answers in French."
    assert versions[0].provenance.trajectory_id == second.loopwise["trajectory_id"]
    p1 = versions[1].provenance
    assert p1.method == "memopilot" and p1.adapter is None  # the base model: no memopilot adapter is published
    assert p1.trajectory_id == first.loopwise["trajectory_id"] and p1.turn_id == first.loopwise["turn_id"]
    assert p1.copilot_trajectory_id and p1.copilot_turn_id and p1.meta["agent"] == "mem-agent"

    # the copilot's call is its own recorded trajectory, in the player's session
    cop = store.get_trajectory(p1.copilot_trajectory_id)
    assert cop is not None and cop.session_id == "alice" and len(cop.turns) == 1
    assert cop.meta["agent"] == COPILOT_AGENT and cop.meta["memory_scope"] == "user:alice"
    assert cop.meta["player_trajectory_id"] == first.loopwise["trajectory_id"]
    turn = cop.turns[0]
    assert turn.model == COPILOT_AGENT and turn.output_text == "<memory>Alice wants answers in French.</memory>"
    assert "2+3?" in turn.messages[1]["content"] and "The answer is 5." in turn.messages[1]["content"]

    # the first run had no memory; the second got it in its system prompt, in the ids the model saw
    t1 = store.get_trajectory(first.loopwise["trajectory_id"]).turns[0]
    t2 = store.get_trajectory(second.loopwise["trajectory_id"]).turns[0]
    assert MEMORY_HEADER not in t1.messages[0]["content"]
    assert t2.messages[0]["role"] == "system" and "Alice wants answers in French." in t2.messages[0]["content"]
    assert "Alice wants answers in French." in tok.decode(t2.context_ids)
    recorder.close()


def test_the_answer_does_not_wait_for_the_rewrite(tok, tmp_path):
    gate = asyncio.Event()
    engine = GatedEngine(tok, reply, gate=gate)
    agent, recorder, store, mem = make_host(tok, tmp_path, engine)

    async def go():
        with use_caller(ALICE):
            answer = await asyncio.wait_for(agent.chat([{"role": "user", "content": "hi"}], session_id="s", request_id="r", options={}), 10)
        pending_after_answer = len(agent.copilot._tasks)
        assert mem.current("key-aaaa", "user:alice") is None  # the rewrite is still waiting on the model
        gate.set()
        await agent.copilot.drain()
        return answer, pending_after_answer

    answer, pending = asyncio.run(go())
    assert answer.content == "The answer is 5." and pending == 1
    assert mem.current("key-aaaa", "user:alice").text == "Alice wants answers in French."
    recorder.close()


def test_a_failing_copilot_is_logged_and_keeps_the_old_memory(tok, tmp_path):
    engine = GatedEngine(tok, reply, fail=RuntimeError("copilot engine exploded"))
    agent, recorder, store, mem = make_host(tok, tmp_path, engine)
    mem.write("key-aaaa", "user:alice", "old lesson", Provenance("memopilot"))

    async def go():
        with capture_logs() as logs, use_caller(ALICE):
            answer = await agent.chat([{"role": "user", "content": "hi"}], session_id="s", request_id="r", options={})
            await agent.copilot.drain()
        return answer, logs

    answer, logs = asyncio.run(go())
    assert answer.content == "The answer is 5."
    failed = [e for e in logs if e["event"] == "memory rewrite failed"]
    assert len(failed) == 1 and failed[0]["log_level"] == "error" and failed[0]["scope"] == "user:alice"
    assert [v.text for v in mem.versions("key-aaaa", "user:alice")] == ["old lesson"]
    recorder.close()


def test_no_user_means_no_user_memory_and_owners_stay_apart(tok, tmp_path):
    engine = ScriptedEngine(tok, reply)
    agent, recorder, store, mem = make_host(tok, tmp_path, engine)
    mem.write("key-bbbb", "user:alice", "Bob's tenant: secret", Provenance("memopilot"))

    async def go():
        with use_caller(Caller("key-aaaa", None)):
            await agent.chat([{"role": "user", "content": "hi"}], session_id="s", request_id="r1", options={})
        with use_caller(ALICE):  # same scope name, other owner: key-bbbb's memory never shows
            res = await agent.chat([{"role": "user", "content": "hi"}], session_id="s", request_id="r2", options={})
        await agent.copilot.drain()
        await recorder.flush()
        return res

    res = asyncio.run(go())
    assert sum(is_copilot(r) for r in engine.calls) == 1  # only the run with a user had a rewrite
    assert "secret" not in str(store.get_trajectory(res.loopwise["trajectory_id"]).turns[0].messages)
    assert mem.current("key-aaaa", "user:alice").text == "Alice wants answers in French."
    assert mem.current("key-bbbb", "user:alice").text == "Bob's tenant: secret"
    recorder.close()


def test_append_all_in_episode_mode_buffers_until_a_rewarded_run(tok, tmp_path):
    engine = ScriptedEngine(tok, lambda req: "5")
    agent, recorder, store, mem = make_host(tok, tmp_path, engine, {"scope": "session", "method": "append-all", "when": "episode"})

    async def go():
        with use_caller(ALICE):
            await agent.run({"input": "round one"}, session_id="game-1", request_id="r1")
            await agent.copilot.drain()
            assert mem.current("key-aaaa", "session:game-1") is None  # no reward yet: still buffered
            out = await agent.run({"task": "calc_arith", "problem_index": 0}, session_id="game-1", request_id="r2")
            await agent.copilot.drain()
        return out

    out = asyncio.run(go())
    assert out["reward"] is not None
    doc = mem.current("key-aaaa", "session:game-1")
    assert doc is not None and doc.version == 1 and doc.provenance.method == "append-all" and doc.provenance.copilot_trajectory_id is None
    assert "User: round one" in doc.text and f"Outcome: reward {out['reward']:g}" in doc.text
    assert doc.text.index("round one") < doc.text.index(out["problem"]["prompt"][:20])
    assert not any(is_copilot(r) for r in engine.calls)  # append-all makes no model call
    recorder.close()


def test_an_agent_memory_longer_than_the_store_accepts_is_refused_when_the_agent_is_made(tmp_path):
    """The store refuses text over its limit, so an agent allowed longer memory would keep its old memory forever
    (each rewrite refused, logged, dropped): refuse the agent instead, at startup and on the admin API."""
    mem = MemoryStore(tmp_path / "memory.db", max_chars=500)
    cfg = {"name": "mem-agent", "stop_policy": "answer", "memory": {"scope": "user", "max_chars": 501}}
    with pytest.raises(ValueError, match="memory.max_chars 501 is over the memory store's limit of 500"):
        Host([cfg], default_registry(), memory=mem)
    host = Host([{**cfg, "memory": {"scope": "user", "max_chars": 500}}], default_registry(), memory=mem)
    assert host.names() == ["mem-agent"]
    with pytest.raises(ValueError, match="over the memory store's limit"):
        host.create({**cfg, "name": "second", "memory": {"scope": "user", "max_chars": 4000}})
    assert host.names() == ["mem-agent"]
