"""``python -m experiments.memory_train``: train the MemoPilot memory copilot with the learner, end to end through a server.

    python -m experiments.memory_train --testbed rps --spawn --model default --adapter-root DIR \\
        [--iterations 3] [--group-size 4] [--opponents copy,bias] [--seeds 1] [--rounds 15] [--episode-rounds 5]

One iteration (MemoPilot, arXiv 2606.08656; our reading, ``docs/methods.md``):

1. **Rollouts.** For every (opponent, seed) of the schedule, ``--group-size`` G rollouts of the same
   game (same opponent, same seed, same player request seeds) with the ``memopilot`` method; the copilot
   is ``memopilot@N`` (the base model before the first update) sampled at ``--temperature``, with a
   different request seed per rollout (``seed_salt``); the player's request seeds are the same in
   every rollout, so rollouts differ only through the memories.
2. **Turn rewards.** The copilot's rewrite after episode ``t`` is the action of turn ``t``; its reward is
   the player's mean payoff per round in episode ``t+1``, the rounds played with that memory. The
   rewrite after the last episode has no reward and is not made. Rewards are also stored on the
   recorded copilot turns (``POST /v1/feedback``, source ``memopilot:<testbed>``).
3. **Advantages.** ``turn_grpo`` with ``source="reward"``: normalised per (opponent, seed, turn index)
   across the G rollouts, whatever memory each rollout had (context-independent turn-level advantage).
4. **Update.** The exact recorded copilot turns (context ids, output ids, behaviour logprobs, loss
   mask and the JSON grammar they were decoded under, read back with ``GET /admin/trajectories/{id}``)
   go through the learner's one update pipeline (``learner.update``: advantages → ``LoRATrainer.step`` →
   checkpoint → publish ``memopilot@N+1`` → load into the server), so the next iteration samples from it.

``--spawn`` starts a private server with ``--adapter-root``; with ``--url`` the server must have been
started with that adapter root and ``--admin-key``, and ``--model`` must name its base model folder
(``default``/``tiny``/PATH), which the trainer loads. Checkpoints go to ``--checkpoint-dir`` (default
``<adapter-root>/../memopilot-checkpoints``). A run is resumable: ``--iterations`` is the run's number of
updates in all, so the same command after a cut continues from the last checkpoint to the same end; the
``--json-out`` history is written after every iteration, kept on resume, and the first iteration after a
resume says where it resumed (``resumed_at``).

Not here: the served copilot of live traffic (``memory/copilot.py``), evaluation (``experiments.memory_tournament``).
Torch and the learner's trainer are imported only when training starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog

from experiments.memory_tournament import add_server_args, base_model_name, load_memopilot, play_all, server_url
from memory.testbeds import TESTBEDS, opponents
from memory.testbeds.play import MEMOPILOT_FORMATS, PLAYER_CONTEXTS, GameRecord, PlayConfig

log = structlog.get_logger(__name__)

FAMILY = "memopilot"
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class CopilotTurn:
    """One rewarded copilot rewrite of one rollout."""

    rollout_id: str  # the training trajectory: one rollout (game) of the group
    group_id: str  # (testbed, opponent, seed): rollouts that are compared
    turn_index: int  # the episode after which the memory was rewritten
    reward: float  # mean payoff per round in the next episode
    turn_id: str  # the recorded copilot turn
    trajectory_id: str


def copilot_turns(games: Sequence[GameRecord], rollout_ids: Sequence[str]) -> list[CopilotTurn]:
    """The rewarded copilot turns of rollouts: rewrite after episode t → mean payoff per round of episode t+1."""
    out = []
    for game, rid in zip(games, rollout_ids, strict=True):
        n_episodes = max(game.episode_of_round) + 1 if game.rounds else 0
        for rw in game.rewrites:
            nxt = rw.episode + 1
            if nxt >= n_episodes or rw.turn_id is None or rw.trajectory_id is None:
                continue
            rounds = sum(1 for e in game.episode_of_round if e == nxt)
            out.append(
                CopilotTurn(
                    rollout_id=rid,
                    group_id=f"{game.testbed}:{game.opponent}:{game.seed}",
                    turn_index=rw.episode,
                    reward=game.episode_payoff(nxt) / rounds,
                    turn_id=rw.turn_id,
                    trajectory_id=rw.trajectory_id,
                )
            )
    return out


def turn_advantages(turns: Sequence[CopilotTurn]) -> list[float]:
    """The per-turn-index advantages the trainer will use (``turn_grpo``, ``source="reward"``), same order."""
    from learner.advantages import TurnSample, compute_advantages

    samples = [TurnSample(t.rollout_id, t.group_id, t.turn_index, t.reward, None) for t in turns]
    return list(compute_advantages("turn_grpo", samples, source="reward"))


def fetch_samples(client: httpx.Client, turns: Sequence[CopilotTurn], testbed: str) -> list[Any]:
    """``learner.samples.Sample`` for each copilot turn, read back from the server's store (exact tokens)."""
    from learner.samples import Sample, parse_adapter, recorded_grammar

    out = []
    for t in turns:
        r = client.get(f"/admin/trajectories/{t.trajectory_id}")
        if r.status_code != 200:
            raise SystemExit(f"error: reading copilot trajectory {t.trajectory_id} failed ({r.status_code}: {r.text[:300]})")
        turn = next((x for x in r.json()["turns"] if x["turn_id"] == t.turn_id), None)
        if turn is None:
            raise SystemExit(f"error: copilot turn {t.turn_id} is not in trajectory {t.trajectory_id}")
        fb = client.post("/v1/feedback", json={"turn_id": t.turn_id, "reward": t.reward, "source": f"memopilot:{testbed}"})
        if fb.status_code != 200:
            raise SystemExit(f"error: storing the reward of {t.turn_id} failed ({fb.status_code}: {fb.text[:300]})")
        temp = turn["sampling"].get("temperature")
        _, version = parse_adapter(turn["adapter"])
        out.append(
            Sample(
                turn_id=t.turn_id,
                trajectory_id=t.rollout_id,
                group_id=t.group_id,
                turn_index=t.turn_index,
                context_ids=list(turn["context_ids"]),
                output_ids=list(turn["output_ids"]),
                logprobs=list(turn["logprobs"]),
                loss_mask=list(turn["loss_mask"]),
                adapter=turn["adapter"],
                adapter_version=max(version, 0),
                reward=t.reward,
                trajectory_reward=None,
                temperature=float(temp) if isinstance(temp, int | float) and temp > 0 else 1.0,
                created_at=float(turn["created_at"]),
                meta={"testbed": testbed},
                grammar=recorded_grammar(turn["sampling"]),  # the JSON rewrite's schema: the trainer masks as the engine did
            )
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.memory_train", description="Train the memopilot copilot (turn-index GRPO, the learner pipeline)."
    )
    add_server_args(p)
    p.add_argument("--testbed", choices=TESTBEDS, default="rps")
    p.add_argument(
        "--iterations",
        type=int,
        default=3,
        help="updates (published versions) of the run in all (default 3); a run resumed from its checkpoint makes the rest",
    )
    p.add_argument("--group-size", type=int, default=4, help="G rollouts per (opponent, seed) (default 4)")
    p.add_argument("--opponents", default="all", help="comma-separated opponents (default all of the testbed)")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..S-1 per opponent (default 1)")
    p.add_argument("--seed-offset", type=int, default=100, help="first training seed (default 100: apart from the tournament's 0..)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--episode-rounds", type=int, default=5)
    p.add_argument("--memory-chars", type=int, default=600)
    p.add_argument("--temperature", type=float, default=1.0, help="copilot sampling temperature in rollouts (default 1.0)")
    p.add_argument("--copilot-max-tokens", type=int, default=160)
    p.add_argument("--player-max-tokens", type=int, default=8)
    p.add_argument(
        "--player-temperature",
        type=float,
        default=0.0,
        help="player sampling temperature (seeded per decision, the same in every rollout; default 0)",
    )
    p.add_argument("--independent-player-seeds", action="store_true", help="different player request seeds per rollout (default: the same)")
    p.add_argument("--free-player", action="store_true", help="no constrained decoding: the player's free text is parsed")
    p.add_argument(
        "--player-context",
        choices=PLAYER_CONTEXTS,
        default="state",
        help="state: a fresh request per decision with the episode's rounds so far (default); chat: one growing chat per episode",
    )
    p.add_argument(
        "--memory-in",
        choices=["user", "system"],
        default="user",
        help="state context: the memory goes in the player's user message (default) or its system prompt",
    )
    p.add_argument(
        "--memopilot-format",
        choices=MEMOPILOT_FORMATS,
        default="json",
        help='json: memopilot writes {"note", "next"} over the game\'s actions (default); text: free-text memory',
    )
    p.add_argument("--invalid", choices=["loss", "random"], default="loss")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (default 1)")
    p.add_argument("--train-seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", type=Path)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--json-out", type=Path, help="write the per-iteration metrics as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.adapter_root is None:
        raise SystemExit("error: --adapter-root is required (where memopilot versions are published)")
    if args.group_size < 2:
        raise SystemExit("error: --group-size must be at least 2 (advantages compare rollouts)")
    args.adapter_root = args.adapter_root.resolve()
    ckpt = (args.checkpoint_dir or args.adapter_root.parent / "memopilot-checkpoints").resolve()
    opps = opponents(args.testbed) if args.opponents == "all" else tuple(o.strip() for o in args.opponents.split(","))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with server_url(args) as url:
        if not args.admin_key:
            raise SystemExit("error: training needs the server's --admin-key (or --spawn)")
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            player = args.player_model or base_model_name(c)
        trainer = _trainer(args, ckpt)
        done = _done(trainer)
        resumed_at = done or None
        history = _history(args.json_out, done)
        if trainer.version > 0:
            load_memopilot(url, args.admin_key, args.adapter_root, trainer.version)
        if resumed_at:
            print(f"memory_train: resumed after {done} of {args.iterations} iterations, at {FAMILY}@{trainer.version}", flush=True)
        while _done(trainer) < args.iterations:
            record = _iteration(args, url, headers, player, opps, trainer, ckpt, _done(trainer))
            if resumed_at:
                record, resumed_at = {**record, "resumed_at": {"iteration": resumed_at, "version": record["copilot"], "checkpoint": str(ckpt)}}, None
            history.append(record)
            print(json.dumps(record), flush=True)
            if args.json_out:  # after every iteration: a cut run keeps what it measured
                args.json_out.parent.mkdir(parents=True, exist_ok=True)
                args.json_out.write_text(json.dumps(history, indent=1))
    return 0


ITERATIONS = "memory_train_iterations"  # in the trainer's checkpointed cursor: iterations made (with or without a step)


def _done(trainer: Any) -> int:
    """Iterations the run has made so far, as its checkpoint says (an iteration whose rewards were all equal makes no
    optimizer step and publishes nothing, so the version alone does not count them)."""
    return int(trainer.cursor.get(ITERATIONS, trainer.version))


def _history(path: Path | None, done: int) -> list[dict[str, Any]]:
    """The iterations a resumed run already recorded (those its checkpoint holds; none on a fresh start)."""
    if path is None or done == 0 or not path.exists():
        return []
    return [r for r in json.loads(path.read_text()) if int(r.get("iteration", done)) < done]


def _trainer(args: argparse.Namespace, ckpt: Path) -> Any:
    from learner.config import LoRAConfig, TrainerConfig
    from learner.publish import adapter_path
    from learner.trainer import LoRATrainer
    from runtime.model_store import resolve_model

    base = resolve_model(args.model, ROOT / ".data" / "models")
    cfg = TrainerConfig(
        lr=args.lr, estimator="turn_grpo", estimator_params={"source": "reward"}, threads=args.threads, seed=args.train_seed, progress=False
    )
    trainer = LoRATrainer(base, cfg, LoRAConfig(rank=args.rank, alpha=2.0 * args.rank))
    trainer.load_checkpoint(ckpt)
    if adapter_path(args.adapter_root, FAMILY, trainer.version + 1).exists():
        raise SystemExit(f"error: {FAMILY}@{trainer.version + 1} is already published but {ckpt} has no checkpoint of it: pass its --checkpoint-dir")
    return trainer


def _iteration(
    args: argparse.Namespace, url: str, headers: dict[str, str], player: str, opps: Sequence[str], trainer: Any, ckpt: Path, it: int
) -> dict[str, Any]:
    from learner.publish import RuntimeAdmin
    from learner.update import checkpoint_and_publish, update

    t0 = time.perf_counter()
    version = trainer.version
    copilot = f"{FAMILY}@{version}" if version > 0 else None
    jobs, rollout_ids = [], []
    for opp in opps:
        for seed in range(args.seed_offset, args.seed_offset + args.seeds):
            for g in range(args.group_size):
                cfg = PlayConfig(
                    player_model=player,
                    rounds=args.rounds,
                    episode_rounds=args.episode_rounds,
                    copilot_model=copilot,
                    copilot_temperature=args.temperature,
                    copilot_max_tokens=args.copilot_max_tokens,
                    player_max_tokens=args.player_max_tokens,
                    player_temperature=args.player_temperature,
                    constrain_player=not args.free_player,
                    player_context=args.player_context,
                    memopilot_format=args.memopilot_format,
                    memory_in=args.memory_in,
                    salt_player_seeds=args.independent_player_seeds,
                    seed_salt=f"v{version}-g{g}",
                    match_options={"invalid": args.invalid},
                )
                jobs.append((args.testbed, opp, seed, FAMILY, cfg, args.memory_chars))
                rollout_ids.append(f"v{version}:{opp}:{seed}:g{g}")
    games = asyncio.run(play_all(url, headers, jobs, args.concurrency))
    t_play = time.perf_counter() - t0
    turns = copilot_turns(games, rollout_ids)
    admin_headers = {**headers, "Authorization": f"Bearer {args.admin_key}"}
    with httpx.Client(base_url=url, headers=admin_headers, timeout=60) as c:
        samples = fetch_samples(c, turns, args.testbed)
    metrics, _ = update(trainer, samples)  # the learner's pipeline: turn_grpo advantages → loss → step
    trainer.cursor[ITERATIONS] = it + 1
    published = None
    if metrics.optimizer_step:
        with RuntimeAdmin(url, args.admin_key) as admin:  # checkpoint first, then publish + load (learner.update)
            meta = {"testbed": args.testbed, "samples": len(samples)}
            published = checkpoint_and_publish(trainer, ckpt, args.adapter_root, FAMILY, meta=meta, admin=admin).name
    else:  # all rewards equal within every group: nothing to learn, the same copilot plays the next iteration
        trainer.save_checkpoint(ckpt)
    rewards = [t.reward for t in turns]
    return {
        "iteration": it,
        "copilot": copilot or "base",
        "published": published,
        "rollouts": len(games),
        "samples": len(samples),
        "reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
        "payoff_per_round": sum(g.total_payoff for g in games) / sum(len(g.rounds) for g in games),
        "parse_rate": sum(g.parse_rate for g in games) / len(games),
        "optimizer_step": metrics.optimizer_step,
        "trained_samples": metrics.trained_samples,
        "frac_reward_zero_std": metrics.frac_reward_zero_std,
        "loss": metrics.loss,
        "grad_norm": metrics.grad_norm,
        "play_s": round(t_play, 1),
        "train_s": round(time.perf_counter() - t0 - t_play, 1),
    }


if __name__ == "__main__":
    sys.exit(main())
