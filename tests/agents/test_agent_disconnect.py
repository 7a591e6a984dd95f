"""A client that leaves cancels its agent's runs: chat with an agent as the model, and the runs API.

A served server process (tiny model, one batch slot so an agent's turns and choices run one after the
other) and an agent whose runs are long: eight turns of up to 256 tokens, which the tiny model's random
text fills. Four runs are asked for (n = 4 in one chat, or four runs side by side); the clients time out after
a second; the runs must stop generating within seconds, not
finish their thousands of tokens for nobody, and the server must stay healthy. Before the fix the runs
went on to their end (the running-requests gauge stayed up and every token was generated).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.runtime._client import metrics, wait_for_metric

LONG = {
    "name": "long-agent",
    "system_prompt": "Think aloud at length.",
    "stop_policy": "fixed",
    "max_turns": 8,
    "max_tokens_per_turn": 256,
    "token_budget": 4096,
    "temperature": 1.0,
}
RUN_TOKENS = LONG["max_turns"] * LONG["max_tokens_per_turn"]  # what one run would generate at most (its context is less)
CLIENTS = 4


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--agent", json.dumps(LONG), "--max-batch-size", "1", process=True)


def _left_after_a_second(server, path: str, bodies: list[dict]) -> float:
    """Post ``bodies`` side by side, each client giving up after one second; the tokens generated from then until
    the engine is idle again."""
    before = metrics(server)["loopwise_generated_tokens_total"]

    async def post_all() -> list[BaseException | httpx.Response]:
        async with httpx.AsyncClient(timeout=1.0) as http:
            return await asyncio.gather(*(http.post(server.url + path, json=b) for b in bodies), return_exceptions=True)

    outcomes = asyncio.run(post_all())
    assert all(isinstance(o, httpx.TimeoutException) for o in outcomes), outcomes
    wait_for_metric(server, "loopwise_running_requests", 0, timeout=8)
    wait_for_metric(server, "loopwise_queue_depth", 0, timeout=8)
    generated = metrics(server)["loopwise_generated_tokens_total"] - before
    time.sleep(1.0)  # nothing resumes later: a cancelled run's next turn is never submitted
    assert metrics(server)["loopwise_generated_tokens_total"] - before == generated
    return generated


def _still_serves(server) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    quick = httpx.post(server.url + "/chat/completions", json=body, timeout=30)
    assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] <= 3
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    log = server.log()
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log[-3000:]


def test_a_chat_client_that_leaves_cancels_the_agents_runs(server):
    # n=4 runs of eight long turns on one batch slot: finishing would take thousands of tokens
    body = {"model": "long-agent", "messages": [{"role": "user", "content": "Tell me everything."}], "n": CLIENTS, "seed": 3}
    generated = _left_after_a_second(server, "/chat/completions", [body])
    assert generated < CLIENTS * RUN_TOKENS / 2, f"{generated} tokens generated for a chat whose client left after 1 s"
    _still_serves(server)


def test_a_runs_client_that_leaves_cancels_its_run(server):
    bodies = [{"input": "Tell me everything.", "seed": 5 + i} for i in range(CLIENTS)]
    generated = _left_after_a_second(server, "/agents/long-agent/runs", bodies)
    assert generated < CLIENTS * RUN_TOKENS / 2, f"{generated} tokens generated for runs whose clients left after 1 s"
    _still_serves(server)
    # a run that is waited for still answers in full
    r = httpx.post(server.url + "/agents/long-agent/runs", json={"input": "Short, please.", "seed": 9, "max_turns": 1}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["turns"] == 1
