"""What the frozen player sees in a testbed game: the memory in its system prompt, the episode's rounds.

The server is replaced by ``httpx.MockTransport`` (it answers every player call "paper" and every
memory rewrite with a fixed memory) because these tests are about the requests ``play_game`` builds;
the real server path is covered by ``test_train`` and the tournament tests.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from memory.methods import get_method
from memory.testbeds.play import EPISODE_HEADER, MEMORY_HEADER, PlayConfig, play_game

NEW_MEMORY = "The opponent loves rock. Play paper."


def _serve(requests: list[dict[str, Any]]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        requests.append(body)
        copilot = body.get("response_format") is None
        content = f"<memory>{NEW_MEMORY}</memory>" if copilot else '"paper"'
        n = len(requests)
        return httpx.Response(
            200,
            json={"choices": [{"message": {"role": "assistant", "content": content}}], "loopwise": {"turn_id": f"t{n}", "trajectory_id": f"r{n}"}},
        )

    return httpx.MockTransport(handler)


def _play(cfg: PlayConfig) -> tuple[Any, list[dict[str, Any]]]:
    requests: list[dict[str, Any]] = []

    async def go() -> Any:
        async with httpx.AsyncClient(base_url="http://play.test", transport=_serve(requests)) as client:
            return await play_game(client, "rps", "bias", 0, get_method("reflection"), cfg)

    return asyncio.run(go()), requests


def test_state_context_is_a_fresh_request_per_decision_with_the_episodes_rounds() -> None:
    game, requests = _play(PlayConfig(player_model="p", rounds=6, episode_rounds=3))
    player = [r for r in requests if r.get("response_format")]
    copilot = [r for r in requests if not r.get("response_format")]
    assert len(player) == 6 and len(copilot) == 1  # no rewrite after the last episode
    assert all(len(r["messages"]) == 2 and [m["role"] for m in r["messages"]] == ["system", "user"] for r in player)
    # episode 0: no memory; the decision of round k shows the k-1 finished rounds of this episode
    assert all(MEMORY_HEADER not in r["messages"][0]["content"] for r in player[:3])
    assert EPISODE_HEADER not in player[0]["messages"][1]["content"]
    assert player[2]["messages"][1]["content"].startswith(f"{EPISODE_HEADER}\n{game.rounds[0].line}\n{game.rounds[1].line}\n\n")
    # episode 1: the rewritten memory is in the user message before the decision; episode 0's rounds are not shown
    assert all(r["messages"][0]["content"] == player[0]["messages"][0]["content"] for r in player)  # the rules only
    assert player[3]["messages"][1]["content"].startswith(f"{MEMORY_HEADER}\n{NEW_MEMORY}\n\nRound 4.")
    assert f"{game.rounds[3].line}\n\n{MEMORY_HEADER}\n{NEW_MEMORY}\n\nRound 5." in player[4]["messages"][1]["content"]
    assert game.rounds[2].line not in player[5]["messages"][1]["content"]
    assert game.rounds[3].line in player[5]["messages"][1]["content"]
    # the copilot saw exactly episode 0's rounds
    assert "\n".join(r.line for r in game.rounds[:3]) in copilot[0]["messages"][1]["content"]
    # player request seeds: per decision, the same whatever the memory
    assert len({r["seed"] for r in player}) == 6
    assert game.player_turn_ids == [f"t{i}" for i in (1, 2, 3, 5, 6, 7)]


def test_memory_in_the_system_prompt() -> None:
    _, requests = _play(PlayConfig(player_model="p", rounds=4, episode_rounds=2, memory_in="system"))
    player = [r for r in requests if r.get("response_format")]
    assert all(MEMORY_HEADER not in r["messages"][0]["content"] for r in player[:2])
    assert all(r["messages"][0]["content"].endswith(f"{MEMORY_HEADER}\n{NEW_MEMORY}") for r in player[2:])
    assert all(MEMORY_HEADER not in r["messages"][1]["content"] for r in player)


def test_chat_context_grows_one_chat_per_episode() -> None:
    _, requests = _play(PlayConfig(player_model="p", rounds=4, episode_rounds=2, player_context="chat"))
    player = [r for r in requests if r.get("response_format")]
    assert [len(r["messages"]) for r in player] == [2, 4, 2, 4]
    assert player[1]["messages"][2] == {"role": "assistant", "content": '"paper"'}
    assert player[3]["messages"][0]["content"].endswith(NEW_MEMORY)


def test_player_seeds_do_not_depend_on_recording() -> None:
    """Seeds count decisions, not recorded turn ids (a server without recording gives none)."""
    _, with_ids = _play(PlayConfig(player_model="p", rounds=4, episode_rounds=2))
    seen: list[int] = []

    def no_ids(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("response_format"):
            seen.append(body["seed"])
        content = '"paper"' if body.get("response_format") else f"<memory>{NEW_MEMORY}</memory>"
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": content}}]})

    async def go() -> Any:
        async with httpx.AsyncClient(base_url="http://play.test", transport=httpx.MockTransport(no_ids)) as client:
            return await play_game(client, "rps", "bias", 0, get_method("reflection"), PlayConfig(player_model="p", rounds=4, episode_rounds=2))

    assert asyncio.run(go()).player_turn_ids == []
    assert seen == [r["seed"] for r in with_ids if r.get("response_format")]


def test_unknown_player_context_is_refused() -> None:
    with pytest.raises(ValueError, match="player_context"):
        PlayConfig(player_model="p", player_context="transcript")
