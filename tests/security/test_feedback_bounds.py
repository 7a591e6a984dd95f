"""One key cannot pile rewards onto a turn without bound.

Every stored reward (with its comment of up to 10,000 characters) is read back by the learner for each rewarded
trajectory in its window: a key rating one 200-turn conversation's every turn, 600 times a minute, stored 120,000
rewards a minute on it, and the learner's next round loaded them all (out of memory, then again after every
restart). Now a turn or trajectory holds at most ``--feedback-max-per-target`` rewards; more are a 409
``too_many_rewards``, a repeated idempotency key is still answered as a duplicate, and other targets are unaffected.
A real server on a real port (``--feedback-max-per-target 3``).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.runtime._client import assert_error

KEY = "feedback-bounds-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server("--api-key", KEY, "--feedback-max-per-target", "3", "--durability", "sync")


def _turn(server: Any, text: str) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    r = httpx.post(server.url + "/chat/completions", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["loopwise"]


def _rate(server: Any, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/feedback", json={"source": "thumbs", **body}, headers=HEADERS, timeout=30)


def test_a_target_takes_a_bounded_number_of_rewards(server: Any) -> None:
    ids = _turn(server, "rate me")
    for i in range(3):
        r = _rate(server, turn_id=ids["turn_id"], reward=1.0 - i, idempotency_key=f"k{i}", comment="x" * 10_000)
        assert r.status_code == 200 and not r.json()["duplicate"], r.text
    err = assert_error(_rate(server, turn_id=ids["turn_id"], reward=1.0), 409, code="too_many_rewards")
    assert "at most 3" in err["message"], err
    again = _rate(server, turn_id=ids["turn_id"], reward=1.0, idempotency_key="k0")  # a retry of a stored one
    assert again.status_code == 200 and again.json()["duplicate"] is True, again.text
    # the trajectory is another target, and another turn is unaffected
    assert _rate(server, trajectory_id=ids["trajectory_id"], reward=1.0).status_code == 200
    other = _turn(server, "rate me too")
    assert _rate(server, turn_id=other["turn_id"], reward=0.5).status_code == 200
