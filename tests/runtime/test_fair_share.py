"""Fair admission across owners (runtime/engines/fair_share.py, the Virtual Token Counter of Sheng et al., OSDI 2024).

The policy is checked as a pure class against counters worked out by hand from the paper's rules (prefill tokens
weighted 1, decoded tokens 2; the lowest counter's owner goes next; an arriving owner is lifted to the lowest active
counter; FCFS within an owner), then once in the embedded engine on the tiny model: with a batch of one row, an
owner's n=4 flood queued before another owner's lone request no longer keeps it waiting behind the whole flood.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from runtime.engine import GenerateRequest, SamplingParams
from runtime.engines.embedded import EmbeddedEngine
from runtime.engines.fair_share import FairQueue, owner_of


def drain(q: FairQueue[str], prompt: dict[str, int]) -> list[str]:
    """Admit everything, charging each item's prompt at admission (as the engine does)."""
    out = []
    while (item := q.pop()) is not None:
        owner = item[0]
        q.charge(owner, prefill=prompt[item])
        out.append(item)
    return out


def test_the_lowest_counter_goes_next_and_a_lone_request_passes_a_flood() -> None:
    # A queues A1..A3 (10 prompt tokens each), then B queues B1 (10). All fresh: A arrives at 0, B is lifted to min(A=0) = 0.
    q: FairQueue[str] = FairQueue()
    for item in ("A1", "A2", "A3", "B1"):
        q.push(item[0], item)
    assert q.active() == {"A": 0.0, "B": 0.0}
    # tie at 0 -> A1 (earlier head); A = 10 -> B1 (0 < 10); B = 10 -> tie, A2 (A's head is older); A = 20 -> A3
    assert drain(q, dict.fromkeys(("A1", "A2", "A3", "B1"), 10)) == ["A1", "B1", "A2", "A3"]
    assert q.active() == {"A": 30.0, "B": 10.0}


def test_decode_tokens_weigh_twice_a_prompt_token() -> None:
    q: FairQueue[str] = FairQueue()
    for item in ("A1", "A2", "B1", "B2"):
        q.push(item[0], item)
    assert q.pop() == "A1"
    q.charge("A", prefill=4)  # A = 4
    assert q.pop() == "B1"
    q.charge("B", prefill=10)  # B = 10
    q.charge("A", decode=4)  # A = 4 + 2 * 4 = 12
    assert (q.counter("A"), q.counter("B")) == (12.0, 10.0)
    assert q.pop() == "B2"  # 10 < 12


def test_an_arriving_owner_is_lifted_to_the_lowest_active_counter() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("A", "A1")
    q.push("C", "C1")
    assert q.pop() == "A1"
    q.charge("A", prefill=100, decode=50)  # A = 200 (running)
    assert q.pop() == "C1"
    q.charge("C", prefill=30)  # C = 30 (running)
    q.push("B", "B1")  # B arrives: lifted to min(A=200, C=30) = 30, not left at 0 to bank its idle time
    assert q.counter("B") == 30.0
    q.push("A", "A2")  # A is active (running): no lift, and B's 30 < A's 200
    assert q.pop() == "B1"


def test_an_owner_that_went_idle_keeps_its_counter_and_banks_nothing() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("A", "A1")
    q.push("B", "B1")
    assert q.pop() == "A1"
    q.charge("A", prefill=500)  # A = 500
    assert q.pop() == "B1"
    q.charge("B", prefill=10)  # B = 10
    q.done("A")  # A finishes: idle, its 500 remembered
    assert "A" not in q.active() and q.counter("A") == 500.0
    q.push("A", "A2")  # back: max(own 500, min(active B=10)) = 500, no debt forgiven
    assert q.counter("A") == 500.0
    q.charge("B", decode=100)  # B = 210
    q.done("B")  # B idle at 210
    q.push("B", "B2")  # max(210, min(A=500)) = 500: B's idle time is not banked
    assert q.counter("B") == 500.0
    assert q.pop() == "A2"  # tie at 500: A's head came first


def test_nobody_active_lifts_to_the_last_owner_that_left() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("A", "A1")
    assert q.pop() == "A1"
    q.charge("A", prefill=7, decode=3)  # A = 13
    q.done("A")
    q.push("B", "B1")  # nothing active: the paper's rule, max(0, last left = 13)
    assert q.counter("B") == 13.0


def test_fcfs_within_an_owner_and_between_single_request_owners() -> None:
    q: FairQueue[str] = FairQueue()
    for item in ("A1", "A2", "A3"):
        q.push("A", item)
    assert [q.pop(), q.pop(), q.pop()] == ["A1", "A2", "A3"]
    # owners with one request each and nothing served yet: arrival order, as before
    q2: FairQueue[str] = FairQueue()
    for owner in ("d", "b", "e", "a", "c"):
        q2.push(owner, owner)
    assert drain(q2, dict.fromkeys("abcde", 5)) == ["d", "b", "e", "a", "c"]


def test_state_is_bounded_and_left_clean() -> None:
    q: FairQueue[str] = FairQueue(remember=3)
    for i in range(10):
        q.push(f"o{i}", f"o{i}")
        assert q.pop() == f"o{i}"
        q.done(f"o{i}")
    assert len(q) == 0 and q.active() == {}
    assert len(q._idle) == 3 and q.running_of("o9") == 0
    q.push("x", "x1")
    assert q.pop() == "x1"
    q.done("x")  # a cancelled waiting request: popped and done without a charge
    assert q.active() == {}


def test_row_cap_is_an_equal_share_of_the_rows_while_others_are_active() -> None:
    q: FairQueue[str] = FairQueue()
    assert q.row_cap(32) == 32  # nobody active
    q.push("A", "A1")
    assert q.row_cap(32) == 32  # alone: the whole batch
    for owner in "BCDE":
        q.push(owner, owner + "1")
    assert q.row_cap(32) == 7  # five owners: ceil(32 / 5)
    assert q.row_cap(3) == 1  # never below one row


def test_pop_passes_over_an_owner_at_its_cap() -> None:
    q: FairQueue[str] = FairQueue()
    for item in ("A1", "A2", "A3", "B1", "B2"):
        q.push(item[0], item)
    assert q.pop(cap=1) == "A1"  # tie at 0, A's head is older
    assert q.pop(cap=1) == "B1"  # A runs 1 = cap: passed over although its counter is no higher
    assert q.pop(cap=1) is None  # both at their cap: nothing eligible, though three wait
    assert len(q) == 3
    q.done("A")
    assert q.pop(cap=1) == "A2"


def test_owner_of_reads_the_requests_owner() -> None:
    assert owner_of(GenerateRequest("r", (1, 2))) == "public"  # no owner and no caller bound
    assert owner_of(GenerateRequest("r", (1, 2), owner="key-abc")) == "key-abc"


# ---- in the engine -------------------------------------------------------------------------------


def test_engine_admits_a_lone_owner_before_a_floods_later_members(tiny_model_path: Path) -> None:
    """Batch of one: owner A's first request runs; A's three more and then B's one wait. FCFS served B last;
    with the counters B (lifted to A's counter on arrival, then below it as A decodes) goes before A3 and A4."""
    finished: list[str] = []

    def slow_step(rows: int) -> None:
        time.sleep(0.004)

    async def one(engine: EmbeddedEngine, owner: str, name: str, n: int) -> None:
        req = GenerateRequest(name, (5, 6, 7), SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True), owner=owner)
        await engine.generate(req)
        finished.append(name)

    async def body(engine: EmbeddedEngine) -> None:
        first = asyncio.ensure_future(one(engine, "A", "A1", 12))
        for _ in range(200):
            if engine.stats()["running"] == 1.0:
                break
            await asyncio.sleep(0.005)
        rest = [asyncio.ensure_future(one(engine, "A", f"A{i}", 12)) for i in (2, 3, 4)]
        await asyncio.sleep(0)  # A's queue forms first
        lone = asyncio.ensure_future(one(engine, "B", "B1", 12))
        await asyncio.gather(first, *rest, lone)

    async def main() -> None:
        engine = EmbeddedEngine(tiny_model_path, model_id="tiny", dtype="float32", max_batch_size=1, on_step=slow_step)
        await engine.start()
        try:
            await asyncio.wait_for(body(engine), 60)
        finally:
            await engine.close()

    asyncio.run(main())
    assert finished[0] == "A1"
    assert finished.index("B1") < finished.index("A3"), finished
    assert [f for f in finished if f.startswith("A")] == ["A1", "A2", "A3", "A4"]  # FCFS within the owner


def test_the_api_keys_owner_reaches_the_engine(tmp_path: Path, tiny_model_path: Path) -> None:
    """Through the HTTP path (runtime/generation.py binds the owner): each key's choices, streamed or not, are its owner's."""
    from runtime.identity import owner_of_token
    from tests.security._app import KEY1, KEY2, chat, served

    seen: list[str] = []

    class Recording(EmbeddedEngine):
        def _submit(self, req: GenerateRequest):  # type: ignore[no-untyped-def]
            seq = super()._submit(req)
            seen.append(seq.owner)
            return seq

    engine = Recording(tiny_model_path, model_id="tiny", dtype="float32")
    with served(tmp_path, tiny_model_path, engine=engine) as client:
        hello = [{"role": "user", "content": "hi"}]
        assert chat(client, KEY1, hello, n=2).status_code == 200
        assert chat(client, KEY2, hello, stream=True).status_code == 200
    assert seen == [owner_of_token(KEY1)] * 2 + [owner_of_token(KEY2)]


def test_engine_holds_an_owner_to_its_row_share_while_another_runs(tiny_model_path: Path) -> None:
    """Batch of eight: B's one long request runs, then A asks for eight. With the row share A holds at most
    ceil(8 / 2) = 4 rows while B runs (the rest wait); without it A takes all seven free rows."""

    def run(row_share: bool) -> int:
        peak = 0
        engine = EmbeddedEngine(tiny_model_path, model_id="tiny", dtype="float32", max_batch_size=8, row_share=row_share)

        def on_step(rows: int) -> None:
            nonlocal peak
            owners = [s.owner for s in [*engine._running, *engine._prefilling]]
            if "B" in owners:
                peak = max(peak, owners.count("A"))

        engine._on_step = on_step

        async def one(owner: str, name: str, n: int) -> None:
            req = GenerateRequest(name, (5, 6, 7), SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True), owner=owner)
            await engine.generate(req)

        async def main() -> None:
            await engine.start()
            try:
                long = asyncio.ensure_future(one("B", "B1", 120))
                for _ in range(400):
                    if engine.stats()["running"] == 1.0:
                        break
                    await asyncio.sleep(0.005)
                await asyncio.wait_for(asyncio.gather(long, *(one("A", f"A{i}", 8) for i in range(8))), 120)
            finally:
                await engine.close()

        asyncio.run(main())
        return peak

    assert run(row_share=True) == 4
    assert run(row_share=False) == 7
