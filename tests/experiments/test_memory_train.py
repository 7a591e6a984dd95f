"""MemoPilot training: turn rewards and per-turn-index advantages on hand tables; a tiny-model run publishes memopilot@1.

The end-to-end test starts one tiny-model server (admin key, adapter root), trains one iteration with
``python -m experiments.memory_train`` through it, checks the published adapter moved away from its initialisation and
is loaded, then plays a small tournament including ``memopilot@1`` on the same server.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from safetensors.numpy import load_file

from experiments import memory_tournament as tournament
from experiments import memory_train as train
from experiments.memory_train import CopilotTurn, copilot_turns, turn_advantages
from learner import update as learner_update
from memory.testbeds.match import RoundResult
from memory.testbeds.play import GameRecord, Rewrite


def rollout(opponent: str, payoffs: list[float], episode_rounds: int = 2) -> GameRecord:
    g = GameRecord(testbed="rps", opponent=opponent, seed=0, method="memopilot")
    for i, p in enumerate(payoffs):
        g.rounds.append(RoundResult(index=i, payoff=p, won=p > 0, parsed=1, decisions=1, line=""))
        g.episode_of_round.append(i // episode_rounds)
    n_ep = -(-len(payoffs) // episode_rounds)
    for e in range(n_ep):  # a rewrite after every episode, the last one included (it must get no reward)
        g.rewrites.append(Rewrite(e, "", "m", "c", f"turn-{opponent}-{id(g)}-{e}", f"traj-{id(g)}-{e}", None))
    return g


def test_copilot_turn_rewards_are_the_next_episodes_payoff() -> None:
    g = rollout("copy", [1, -1, 1, 1, 0, -1])  # episodes: [1,-1] [1,1] [0,-1]
    turns = copilot_turns([g], ["r0"])
    assert [(t.turn_index, t.reward) for t in turns] == [(0, 1.0), (1, -0.5)]
    assert all(t.group_id == "rps:copy:0" and t.rollout_id == "r0" for t in turns)
    no_call = rollout("copy", [1, 1, 1, 1])
    no_call.rewrites[0] = Rewrite(0, "", "", None, None, None, None)  # a method without a model call: nothing to train
    assert [t.turn_index for t in copilot_turns([no_call], ["r1"])] == []


def test_per_turn_index_advantages_on_a_hand_table() -> None:
    def t(rollout_id: str, group: str, turn: int, reward: float) -> CopilotTurn:
        return CopilotTurn(rollout_id, group, turn, reward, f"{rollout_id}-{turn}", "x")

    turns = [
        # group A, three rollouts. turn 0 rewards 1, 0, -1: mean 0, sample std 1
        t("a1", "A", 0, 1.0),
        t("a2", "A", 0, 0.0),
        t("a3", "A", 0, -1.0),
        # turn 1 rewards 2, 4, 4: mean 10/3, sample std sqrt(4/3) -> (2-10/3)/1.1547 = -1.1547, +0.5774, +0.5774
        t("a1", "A", 1, 2.0),
        t("a2", "A", 1, 4.0),
        t("a3", "A", 1, 4.0),
        # group B: turn 0 all equal -> 0; turn 1 two rollouts 0.5, -0.5: std 0.7071 -> +-0.7071
        t("b1", "B", 0, 0.3),
        t("b2", "B", 0, 0.3),
        t("b1", "B", 1, 0.5),
        t("b2", "B", 1, -0.5),
    ]
    adv = turn_advantages(turns)
    eps = 1e-6
    expected = [
        1 / (1 + eps),
        0.0,
        -1 / (1 + eps),
        (2 - 10 / 3) / (math.sqrt(4 / 3) + eps),
        (4 - 10 / 3) / (math.sqrt(4 / 3) + eps),
        (4 - 10 / 3) / (math.sqrt(4 / 3) + eps),
        0.0,
        0.0,
        0.5 / (math.sqrt(0.5) + eps),
        -0.5 / (math.sqrt(0.5) + eps),
    ]
    assert adv == pytest.approx(expected, abs=1e-9)
    # context-independent: the same rewards at another turn index of the same rollouts are a separate group
    assert turn_advantages([t("a1", "A", 5, 9.0), t("a2", "A", 5, 9.0)]) == [0.0, 0.0]


def test_train_publishes_a_changed_memopilot_and_the_tournament_plays_it(start_server, tiny_model_path: Path, tmp_path: Path, monkeypatch) -> None:
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    server = start_server("--admin-key", "adm", "--adapter-root", str(adapters))  # in process (--threads would need a process)
    common = ["--url", server.base_url, "--admin-key", "adm", "--adapter-root", str(adapters), "--invalid", "random", "--copilot-max-tokens", "24"]
    out = tmp_path / "train.json"
    rc = train.main(
        [
            *common,
            *("--model", str(tiny_model_path), "--iterations", "1", "--group-size", "4", "--opponents", "copy"),
            *("--rounds", "6", "--episode-rounds", "2", "--player-max-tokens", "4", "--lr", "1e-3"),
            *("--player-temperature", "1.0", "--independent-player-seeds"),
            *("--checkpoint-dir", str(tmp_path / "ckpt"), "--json-out", str(out)),
        ]
    )
    assert rc == 0
    (it,) = json.loads(out.read_text())
    assert it["published"] == "memopilot@1" and it["copilot"] == "base"
    assert it["samples"] == 8  # 4 rollouts x 2 rewarded rewrites (3 episodes)
    assert it["optimizer_step"] is True and it["trained_samples"] > 0
    weights = load_file(str(adapters / "memopilot" / "v1" / "adapter_model.safetensors"))
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert lora_b and any(abs(v).max() > 0 for v in lora_b)  # LoRA B starts at zero: the update moved it
    listed = httpx.get(server.base_url + "/admin/adapters", headers={"Authorization": "Bearer adm"}).json()["data"]
    assert "memopilot@1" in {a["name"] for a in listed}

    # the same command with a later end resumes from the checkpoint: one more update, the history kept, the resume said
    # (before, --iterations counted from the resume and the history was written only at the end of a run)
    again = [*common, "--model", str(tiny_model_path), "--group-size", "4", "--opponents", "copy", "--rounds", "6", "--episode-rounds", "2"]
    again += ["--player-max-tokens", "4", "--lr", "1e-3", "--player-temperature", "1.0", "--independent-player-seeds"]
    again += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--json-out", str(out)]
    assert train.main([*again, "--iterations", "2"]) == 0
    first, second = json.loads(out.read_text())
    assert first == it and "resumed_at" not in first
    assert second["iteration"] == 1 and second["copilot"] == "memopilot@1" and second["published"] == "memopilot@2"
    assert second["resumed_at"]["iteration"] == 1

    # an iteration whose groups all tie makes no step: it publishes nothing (it tried to publish memopilot@2 again and
    # died) and still counts, so a resumed run neither repeats it nor loops on it
    def tied(trainer, samples):
        return SimpleNamespace(optimizer_step=False, trained_samples=0, frac_reward_zero_std=1.0, loss=0.0, grad_norm=0.0), None

    monkeypatch.setattr(learner_update, "update", tied)
    assert train.main([*again, "--iterations", "3"]) == 0
    third = json.loads(out.read_text())[2]
    assert third["iteration"] == 2 and third["published"] is None and third["copilot"] == "memopilot@2"
    assert train.main([*again, "--iterations", "3"]) == 0  # the run is complete: nothing more, nothing lost
    assert len(json.loads(out.read_text())) == 3 and not (adapters / "memopilot" / "v3").exists()

    report = tmp_path / "tournament.json"
    rc = tournament.main(
        [
            *common,
            *("--memopilot-version", "1", "--opponents", "copy", "--seeds", "1", "--rounds", "2", "--episode-rounds", "1"),
            *("--boot", "50", "--json-out", str(report)),
        ]
    )
    assert rc == 0
    data = json.loads(report.read_text())
    assert {r["method"] for r in data["summary"]["ratings"]} == {"none", "append-all", "reflection", "memopilot", "memopilot@1"}
    trained = [g for g in data["games"] if g["method"] == "memopilot@1"]
    assert trained and all(rw["adapter"] == "memopilot@1" for g in trained for rw in g["rewrites"])
    base = [g for g in data["games"] if g["method"] == "reflection"]
    assert all(rw["adapter"] is None and rw["turn_id"] for g in base for rw in g["rewrites"])
    assert all(len(g["player_turn_ids"]) == 2 for g in data["games"])  # every move is a recorded turn
