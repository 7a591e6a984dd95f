"""An internal grammar (an agent's self-check format, handed to the engine uncompiled) is compiled off the event loop.

Clients' grammars are compiled by the admission in the killable grammar worker; the engine compiled the rest in
``_submit`` on the event loop, the first one with xgrammar's import and a read of the whole vocabulary (about a
second on SmolLM2), during which no other request was served. The real embedded engine on the tiny model, with its
compile slowed to 0.6 s: the event loop keeps ticking meanwhile, and the constrained answer still follows its grammar.
"""

from __future__ import annotations

import asyncio
import time

from runtime.engine import GenerateRequest, Grammar, SamplingParams
from runtime.engines.embedded import EmbeddedEngine


def test_an_uncompiled_grammar_is_compiled_off_the_event_loop(tiny_model_path) -> None:
    async def main() -> tuple[float, str]:
        eng = EmbeddedEngine(tiny_model_path, model_id="tiny", dtype="float32")
        await eng.start()
        real = eng.compile_grammar

        def slow_compile(grammar: Grammar, timeout_s: float | None = None) -> object:
            time.sleep(0.6)  # as a first compile's import and vocabulary read: blocking, whichever thread runs it
            return real(grammar, timeout_s)

        eng.compile_grammar = slow_compile  # type: ignore[method-assign]
        gaps: list[float] = []

        async def heartbeat() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.02)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.1)  # the heartbeat is ticking before the request arrives
        try:
            prompt = tuple(eng.tokenizer.encode("answer in json", add_special_tokens=False))
            sp = SamplingParams(max_new_tokens=24, temperature=0, grammar=Grammar("json_object", ""))
            res = await eng.generate(GenerateRequest("g", prompt, sp))
        finally:
            beat.cancel()
            await eng.close()
        return max(gaps), res.text

    worst, text = asyncio.run(main())
    assert worst < 0.4, f"the event loop stalled {worst:.2f} s while a grammar compiled"
    assert text.lstrip().startswith("{"), text  # decoded under the grammar (a JSON object, perhaps cut by the limit)
