"""The replica set's routing, failover and adapter bookkeeping, in process against scripted servers.

Each ``Scripted`` server is an ``HTTPEngine`` whose network calls are replaced by a script: it serves a
request by yielding ``tokens`` chunks (one id per chunk, the id = its replica index + 1, so the test sees
who served), can refuse connections (down), die mid-stream, refuse adapter loads, and "restart"
(forgetting its adapters). The real-server versions of these checks are ``test_vllm_real.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.engine import AdapterError, EngineClosed, EngineInfo, GenerateRequest, SamplingParams, StreamChunk, Timings, collect
from runtime.engines.http_engine import AdapterGone, HTTPEngine, LocalModel, ServerDown, ServerLost
from runtime.engines.replicas import ReplicaSet
from runtime.settings import VLLMSettings


class Scripted(HTTPEngine):
    backend = "scripted"
    label = "Scripted"

    def __init__(self, index: int, *, listing: bool = True) -> None:
        super().__init__(
            f"http://replica-{index}", Path("."), model_id="m", settings=VLLMSettings(), local=LocalModel(Path("."), None, None, 64, 10, (0,))
        )
        self.index = index
        self.listing = listing  # whether probe() lists the loaded adapters (vLLM) or not (SGLang)
        self.down = False  # connections refused
        self.die_after: int | None = None  # tokens before the connection drops mid-stream
        self.refuse_loads = False
        self.server_side: set[str] = set()  # what the "server" has loaded (survives only until restart())
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.gate: asyncio.Event | None = None  # when set, the next stream waits on it after its first token
        self.probe_stall: asyncio.Event | None = None  # when set, probes wait on it (a server too busy to answer /health)
        self.token_delay = 0.0  # seconds between two tokens of a stream

    async def open(self) -> None:
        self._client = object()  # type: ignore[assignment]

    async def _connect(self) -> EngineInfo:
        self._check_up()
        return EngineInfo(backend="scripted", model="m", max_model_len=64, vocab_size=10, eos_token_ids=(0,))

    def _check_up(self) -> None:
        if self.down:
            raise ServerDown(f"cannot reach {self.url}") from httpx.ConnectError("refused")

    def restart(self) -> None:
        self.server_side.clear()

    async def stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        self._check_up()
        if req.adapter is not None and self._names.get(req.adapter) not in self.server_side:
            raise AdapterGone(f"{self.url} does not have {req.adapter}")
        gate, self.gate = self.gate, None
        self._in_flight += 1
        try:
            n = req.sampling.max_new_tokens
            for k in range(n):
                if self.die_after is not None and k >= self.die_after:
                    raise ServerLost(f"{self.url} died after {k} tokens")
                last = k == n - 1
                yield StreamChunk((self.index + 1,), "x", finish_reason="length" if last else None, timings=Timings() if last else None)
                if k == 0 and gate is not None:
                    await gate.wait()
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
        finally:
            self._in_flight -= 1

    async def generate(self, req: GenerateRequest) -> Any:
        return await collect(req, self.stream(req))

    async def health(self) -> None:
        self._check_up()

    async def probe(self) -> set[str] | None:
        self._check_up()
        if self.probe_stall is not None:
            await self.probe_stall.wait()
        return set(self.server_side) if self.listing else None

    async def _load(self, client: Any, server_name: str, path: str) -> None:
        self._check_up()
        if self.refuse_loads:
            raise AdapterError(f"{self.url} refuses {server_name}: rank too large")
        self.server_side.add(server_name)
        self.loads.append(server_name)

    async def _unload(self, client: Any, server_name: str, timeout: float | None = None) -> None:
        self._check_up()
        if server_name not in self.server_side:
            raise AdapterGone(server_name)
        self.server_side.discard(server_name)
        self.unloads.append(server_name)


def req(n: int = 2, adapter: str | None = None, session: str | None = None, owner: str | None = None) -> GenerateRequest:
    return GenerateRequest("r", (1, 2), SamplingParams(max_new_tokens=n), adapter=adapter, session=session, owner=owner)


async def served_by(rs: ReplicaSet, r: GenerateRequest) -> int:
    out = await rs.generate(r)
    return out.output_ids[0] - 1


async def until(cond: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def started(*engines: Scripted, interval: float = 0.05) -> ReplicaSet:
    rs = ReplicaSet(engines, health_interval_s=interval)
    await rs.start()
    return rs


def test_least_loaded_replica_gets_the_next_request():
    async def main() -> None:
        a, b = Scripted(0), Scripted(1)
        rs = await started(a, b)
        gate = a.gate = asyncio.Event()
        held = [aiter(rs.stream(req(n=3))) for _ in range(2)]
        firsts = [await anext(it) for it in held]  # both open streams: one on each replica (round-robin tie-break)
        assert sorted(c.token_ids[0] - 1 for c in firsts) == [0, 1]
        # replica 0 holds one stream; replica 1's stream finishes → replica 1 is the least loaded from now on
        rest = [c async for c in held[[c.token_ids[0] for c in firsts].index(2)]]
        assert rest[-1].finish_reason == "length"
        assert [await served_by(rs, req()) for _ in range(3)] == [1, 1, 1]
        gate.set()
        await rs.close()

    run(main())


def test_adapter_requests_go_to_a_replica_that_has_the_adapter():
    async def main() -> None:
        a, b = Scripted(0), Scripted(1)
        rs = await started(a, b, interval=60)  # no monitor interference
        await rs.load_adapter("fam@1", "/adapters/x")
        assert len(a.loads) == len(b.loads) == 1 and a.loads != b.loads  # every replica, each under a fresh name
        b.forget_adapters(["fam@1"])  # replica 1 no longer has it (as if a reload there failed)
        assert {await served_by(rs, req(adapter="fam@1")) for _ in range(6)} == {0}
        assert {await served_by(rs, req()) for _ in range(6)} == {0, 1}  # the base model is on both
        a.forget_adapters(["fam@1"])
        with pytest.raises(EngineClosed, match="being loaded again"):  # wanted, but no live replica has it now: 503
            await rs.generate(req(adapter="fam@1"))
        with pytest.raises(AdapterError, match="not loaded on any live"):  # never loaded: 404
            await rs.generate(req(adapter="other@1"))
        await rs.close()

    run(main())


def test_a_session_stays_on_its_replica_while_it_can():
    async def main() -> None:
        a, b = Scripted(0), Scripted(1)
        rs = await started(a, b, interval=60)
        first = await served_by(rs, req(session="s1"))
        other = 1 - first
        gate = (a, b)[first].gate = asyncio.Event()
        it = aiter(rs.stream(req(n=3, session="s1")))  # the session's own open stream makes its replica the busier one
        assert (await anext(it)).token_ids == (first + 1,)
        assert rs.status()[first]["in_flight"] == 1 and rs.status()[other]["in_flight"] == 0
        assert {await served_by(rs, req(session="s1")) for _ in range(4)} == {first}
        assert await served_by(rs, req(session="s2")) == other  # a new session goes to the least loaded
        rs.replicas[first].up = False  # its replica goes away: the session moves, and stays on the new one
        assert {await served_by(rs, req(session="s1")) for _ in range(3)} == {other}
        gate.set()
        await it.aclose()
        await rs.close()

    run(main())


def test_another_keys_session_of_the_same_name_is_not_steered_to_its_replica():
    """Replica pins were keyed by the session name alone: a key reusing another key's session name was sent to that
    session's replica (and its prefix cache, a timing probe of what the other tenant's prompts start with)."""

    async def main() -> None:
        a, b = Scripted(0), Scripted(1)
        rs = await started(a, b, interval=60)
        first = await served_by(rs, req(session="s1", owner="key-a"))
        gate = (a, b)[first].gate = asyncio.Event()
        it = aiter(rs.stream(req(n=3, session="s1", owner="key-a")))  # key A's session keeps its replica busy
        await anext(it)
        assert await served_by(rs, req(session="s1", owner="key-b")) == 1 - first  # key B's "s1" goes to the least loaded
        assert await served_by(rs, req(session="s1", owner="key-a")) == first  # key A's stays where it was
        gate.set()
        await it.aclose()
        await rs.close()

    run(main())


def test_an_unreachable_replica_is_taken_out_and_the_request_goes_elsewhere():
    async def main() -> None:
        a, b = Scripted(0), Scripted(1)
        rs = await started(a, b, interval=60)
        a.down = True
        assert [await served_by(rs, req()) for _ in range(4)] == [1, 1, 1, 1]
        assert [r["up"] for r in rs.status()] == [False, True]
        b.down = True
        with pytest.raises(EngineClosed):
            await rs.generate(req())
        await rs.close()

    run(main())


def test_a_replica_dying_mid_stream_fails_that_request_only():
    async def main() -> None:
        a, b = Scripted(0), Scripted(1)
        rs = await started(a, b, interval=60)
        a.die_after = b.die_after = 2
        got: list[int] = []
        with pytest.raises(ServerLost):
            async for chunk in rs.stream(req(n=5)):
                got.extend(chunk.token_ids)
        assert len(got) == 2  # the tokens already handed out were not re-generated elsewhere
        a.die_after = b.die_after = None
        assert len((await rs.generate(req(n=5))).output_ids) == 5
        await rs.close()

    run(main())


def test_a_refused_load_is_rolled_back_on_every_replica():
    async def main() -> None:
        a, b = Scripted(0), Scripted(1)
        rs = await started(a, b, interval=60)
        b.refuse_loads = True
        with pytest.raises(AdapterError, match="rank too large"):
            await rs.load_adapter("big@1", "/adapters/big")
        assert a.server_side == set() and a.unloads == a.loads  # loaded on replica 0, then unloaded again
        assert rs.adapters() == {} and a.adapters() == {} and b.adapters() == {}
        b.refuse_loads = False
        await rs.load_adapter("big@1", "/adapters/big")  # the name was not used up
        assert rs.adapters() == {"big@1": "/adapters/big"}
        await rs.close()

    run(main())


@pytest.mark.parametrize("listing", [True, False], ids=["lists-adapters", "cannot-list"])
def test_a_replica_that_comes_back_gets_its_adapters_again(listing):
    async def main() -> None:
        a, b = Scripted(0, listing=listing), Scripted(1, listing=listing)
        rs = await started(a, b)
        await rs.load_adapter("keep@1", "/adapters/k")
        b.down = True
        b.restart()  # the process died and lost everything
        with pytest.raises(ServerDown):  # what b would answer; the set routes around it
            await b.health()
        await until(lambda: not rs.replicas[1].up)
        await rs.load_adapter("new@1", "/adapters/n")  # loaded while b is down: only a has it now
        await rs.unload_adapter("keep@1")
        assert set(a.adapters()) == {"new@1"}
        assert {await served_by(rs, req(adapter="new@1")) for _ in range(4)} == {0}
        b.down = False
        await until(lambda: rs.replicas[1].up)
        assert set(b.adapters()) == {"new@1"} and b.server_side == {b.adapters()["new@1"]}  # what is wanted now, nothing else
        assert {await served_by(rs, req(adapter="new@1")) for _ in range(8)} == {0, 1}
        await rs.close()

    run(main())


def test_a_quick_restart_between_two_probes_is_noticed_from_the_adapter_list():
    async def main() -> None:
        a, b = Scripted(0), Scripted(1)
        rs = await started(a, b)
        await rs.load_adapter("fam@1", "/adapters/f")
        old = b.adapters()["fam@1"]
        b.restart()  # never seen down: the monitor finds our name missing from its list
        await until(lambda: b.adapters().get("fam@1") not in (None, old))
        assert b.server_side == {b.adapters()["fam@1"]}
        assert rs.replicas[1].up
        await rs.close()

    run(main())


class SlowListing(Scripted):
    """A server whose probe answer (its adapter list, taken when asked) is still on its way while loads land."""

    async def probe(self) -> set[str] | None:
        self._check_up()
        listed = set(self.server_side)
        if self.probe_stall is not None:
            await self.probe_stall.wait()
        return listed


def test_a_load_that_lands_while_a_probe_is_out_is_not_taken_for_a_lost_adapter():
    """The probe's list predates the load: the monitor must not forget the new version there and load it again (it
    did: the replica stopped serving the version a hot swap had just made routable until the second load)."""

    async def main() -> None:
        a, b = Scripted(0), SlowListing(1)
        rs = await started(a, b)
        b.probe_stall = asyncio.Event()
        await asyncio.sleep(0.2)  # b's monitor is waiting on a probe that listed nothing
        await rs.load_adapter("fam@1", "/adapters/f")
        name = b.adapters()["fam@1"]
        stall, b.probe_stall = b.probe_stall, None
        stall.set()
        await asyncio.sleep(0.3)  # several probes more
        assert b.adapters()["fam@1"] == name and b.loads == [name] and b.unloads == []
        assert rs.replicas[1].up and rs.replicas[1].has("fam@1")  # and it routes the version all along
        await rs.close()

    run(main())


def test_a_lost_adapter_found_by_a_request_fails_over_and_is_reloaded():
    async def main() -> None:
        a, b = Scripted(0, listing=False), Scripted(1, listing=False)  # nothing but requests can tell
        rs = await started(a, b, interval=60)
        await rs.load_adapter("fam@1", "/adapters/f")
        a.restart()
        b.restart()
        with pytest.raises(AdapterGone):  # both lost it: the last replica's answer is the request's
            await rs.generate(req(adapter="fam@1"))
        assert [r.needs_sync for r in rs.replicas] == [True, True]
        for r in rs.replicas:
            r.wake.set()
        await until(lambda: all(r.has("fam@1") for r in rs.replicas))
        assert {await served_by(rs, req(adapter="fam@1")) for _ in range(6)} == {0, 1}
        await rs.close()

    run(main())


def test_a_replica_too_busy_to_answer_its_probe_but_still_streaming_stays_in():
    """A server whose health probe times out while it keeps handing out tokens is busy, not dead (SGLang's /health is a
    generate that queues behind the batch): taking it out would fail every new request while it serves fine."""

    async def main() -> None:
        a = Scripted(0)
        rs = ReplicaSet([a], health_interval_s=0.01, probe_timeout_s=0.05)
        await rs.start()
        a.probe_stall = asyncio.Event()
        a.token_delay = 0.01
        got = [c async for c in rs.stream(req(n=60))]  # ~0.6 s of tokens: about ten probes time out meanwhile
        assert len(got) == 60 and rs.replicas[0].failures >= 3
        assert rs.replicas[0].up
        assert await served_by(rs, req()) == 0
        # no tokens for longer than a probe timeout and the probes still time out: now it is taken out
        await until(lambda: not rs.replicas[0].up)
        a.probe_stall.set()
        await until(lambda: rs.replicas[0].up)
        await rs.close()

    run(main())
