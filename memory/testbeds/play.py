"""Play a testbed match through a loopwise server with a memory method (every move is a recorded turn).

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        game = await play_game(client, "rps", "cycle", 0, get_method("reflection"), PlayConfig(player_model="base"))

A game is ``rounds`` rounds split into episodes of ``episode_rounds``; the frozen player
(``player_model``) gets the game's rules and the current memory, and each decision is one
``/v1/chat/completions`` call, so the runtime records every move as a turn. How the
player sees the game (``player_context``):

- ``"state"`` (default): every decision is a fresh two-message request: the rules as system prompt,
  and one user message with this episode's finished rounds (their result lines), the memory, and the
  decision prompt. One trajectory per decision. ``memory_in="system"`` puts the memory in the system
  prompt instead, as the served copilot does (``memory/copilot.py``).
- ``"chat"``: an episode is one growing chat with the memory in the system prompt: each decision a
  user message, each reply an assistant message (one trajectory per episode).

Why ``"state"`` with the memory in the user message: a 135M player barely reads anything else.
Probabilities of SmolLM2-135M's move after four rounds (full-sequence logprobs of the three replies,
renormalised): in ``"chat"``, the memory "Play paper every round." took P(paper) from 0.08 to 0.06
(the player repeats its own earlier replies); in ``"state"`` with the memory in the system prompt,
"Next move: paper" took it from 0.06 to 0.24; in the user message, to 0.55.

After an episode the memory
method updates the memory: ``method.prompt(memory, interaction)`` → one chat completion on
``copilot_model`` (``memopilot@N`` for a trained copilot, the base model otherwise; decoded under
``method.response_schema`` when the method has one) → ``method.apply``. The rewrite after the last episode is skipped unless ``update_after_last``.

With ``constrain_player`` (default) the player's reply is decoded under the match's ``reply_schema``
(a JSON string enum of the legal actions), so a small player always makes a legal move; without it
the reply is free text, parsed leniently. Player request seeds are derived from (testbed, opponent,
seed, decision number), the same for every method and rollout (common random numbers: with a sampling
player, two memories that leave its move distribution alike give the same move); copilot seeds also
from the episode and ``seed_salt``, so training rollouts differ through their memories only
(``salt_player_seeds`` salts the player's seeds too, for independent player noise). An HTTP error
from the server raises :class:`PlayError` (a tournament with silently missing moves would be wrong).

Not here: ratings (``experiments.memory_tournament``), training (``experiments.memory_train``), the served copilot of live
traffic (``memory/copilot.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from memory.methods import Interaction, MemoryMethod
from memory.testbeds import make_match
from memory.testbeds.match import RoundResult

MEMORY_HEADER = "Your memory from earlier rounds against this opponent:"
EPISODE_HEADER = "Rounds played so far:"
PLAYER_CONTEXTS = ("state", "chat")
MEMOPILOT_FORMATS = ("json", "text")


class PlayError(RuntimeError):
    """The server refused or failed a player or copilot call."""


@dataclass(frozen=True)
class PlayConfig:
    player_model: str  # the frozen player: the served base model's name
    rounds: int = 20
    episode_rounds: int = 5  # the memory is updated after every episode of this many rounds
    copilot_model: str | None = None  # model of the memory rewrite; None = player_model (the base model)
    player_temperature: float = 0.0
    player_max_tokens: int = 8
    constrain_player: bool = True  # decode the player's reply under the match's ``reply_schema`` (always a legal action)
    player_context: str = "state"  # "state": a fresh request per decision; "chat": one growing chat per episode
    memory_in: str = "user"  # "state" context: the memory goes in the user message ("user") or the system prompt ("system")
    memopilot_format: str = "json"  # "json": memopilot writes {"note", "next"} over the game's actions; "text": free text
    copilot_temperature: float = 0.7
    copilot_max_tokens: int = 128
    update_after_last: bool = False
    seed_salt: str = ""  # varies the copilot's request seeds (training rollouts), nothing else
    salt_player_seeds: bool = False  # also vary the player's request seeds with seed_salt (independent player noise)
    match_options: dict[str, Any] = field(default_factory=dict)  # e.g. {"invalid": "random"} for rps

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.episode_rounds < 1:
            raise ValueError("rounds and episode_rounds must be at least 1")
        if self.player_context not in PLAYER_CONTEXTS:
            raise ValueError(f"player_context must be one of {', '.join(PLAYER_CONTEXTS)}, got {self.player_context!r}")
        if self.memory_in not in ("user", "system"):
            raise ValueError(f"memory_in must be 'user' or 'system', got {self.memory_in!r}")
        if self.memopilot_format not in MEMOPILOT_FORMATS:
            raise ValueError(f"memopilot_format must be one of {', '.join(MEMOPILOT_FORMATS)}, got {self.memopilot_format!r}")


@dataclass(frozen=True)
class Rewrite:
    """One memory update after episode ``episode`` (the memory the next episode is played with)."""

    episode: int
    memory_before: str
    memory_after: str
    completion: str | None  # None when the method made no model call
    turn_id: str | None  # the copilot's recorded turn (None without a model call or without recording)
    trajectory_id: str | None
    adapter: str | None  # the adapter version that answered (None = base model)


@dataclass
class GameRecord:
    testbed: str
    opponent: str
    seed: int
    method: str  # the method's label in a tournament (e.g. "memopilot@3")
    rounds: list[RoundResult] = field(default_factory=list)
    rewrites: list[Rewrite] = field(default_factory=list)
    player_turn_ids: list[str] = field(default_factory=list)
    episode_of_round: list[int] = field(default_factory=list)

    @property
    def total_payoff(self) -> float:
        return sum(r.payoff for r in self.rounds)

    def episode_payoff(self, episode: int) -> float:
        """Sum of the payoffs of the rounds played in ``episode``."""
        return sum(r.payoff for r, e in zip(self.rounds, self.episode_of_round, strict=True) if e == episode)

    @property
    def parse_rate(self) -> float:
        decisions = sum(r.decisions for r in self.rounds)
        return sum(r.parsed for r in self.rounds) / decisions if decisions else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_payoff"] = self.total_payoff
        d["parse_rate"] = self.parse_rate
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GameRecord:
        """The inverse of :meth:`to_dict` (derived fields are recomputed)."""
        return cls(
            testbed=d["testbed"],
            opponent=d["opponent"],
            seed=int(d["seed"]),
            method=d["method"],
            rounds=[RoundResult(**r) for r in d["rounds"]],
            rewrites=[Rewrite(**r) for r in d["rewrites"]],
            player_turn_ids=list(d["player_turn_ids"]),
            episode_of_round=list(d["episode_of_round"]),
        )


def request_seed(*parts: object) -> int:
    """A stable 31-bit seed from ``parts``."""
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


async def chat(
    client: httpx.AsyncClient,
    model: str,
    messages: list[dict[str, str]],
    *,
    temperature: float,
    max_tokens: int,
    seed: int,
    user: str,
    schema: dict[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """One chat completion (under the JSON ``schema`` if given): (content, the response's ``loopwise`` ids or {})."""
    body: dict[str, Any] = {"model": model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens, "seed": seed, "user": user}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "action", "schema": schema}}
    try:
        r = await client.post("/v1/chat/completions", json=body)
    except httpx.TransportError as exc:
        raise PlayError(f"chat call on {model!r} failed: {exc}") from exc
    if r.status_code != 200:
        raise PlayError(f"chat call on {model!r} answered {r.status_code}: {r.text[:500]}")
    data = r.json()
    return data["choices"][0]["message"].get("content") or "", data.get("loopwise") or {}


def player_system(rules: str, memory: str) -> str:
    return f"{rules}\n\n{MEMORY_HEADER}\n{memory}" if memory.strip() else rules


def state_message(lines: list[str], decision: str, memory: str = "") -> str:
    """The user message of a ``"state"`` decision: the episode's finished rounds, the memory if given, the decision."""
    parts = [f"{EPISODE_HEADER}\n" + "\n".join(lines)] if lines else []
    if memory.strip():
        parts.append(f"{MEMORY_HEADER}\n{memory}")
    return "\n\n".join([*parts, decision])


async def play_game(
    client: httpx.AsyncClient, testbed: str, opponent: str, seed: int, method: MemoryMethod, cfg: PlayConfig, *, label: str | None = None
) -> GameRecord:
    """Play one game (see the module docstring); ``label`` names the method in the record (default its name)."""
    match = make_match(testbed, opponent, seed, **cfg.match_options)
    name = label or method.name
    game = GameRecord(testbed=testbed, opponent=opponent, seed=seed, method=name)
    user = f"memory-{testbed}-{name}-{opponent}-{seed}{'-' + cfg.seed_salt if cfg.seed_salt else ''}"
    memory = ""
    decisions = 0  # the player's decisions so far (its request seeds)
    n_episodes = -(-cfg.rounds // cfg.episode_rounds)
    for episode in range(n_episodes):
        in_user = cfg.player_context == "state" and cfg.memory_in == "user"
        system = {"role": "system", "content": match.rules if in_user else player_system(match.rules, memory)}
        chat_messages: list[dict[str, str]] = [system]
        lines: list[str] = []
        for _ in range(min(cfg.episode_rounds, cfg.rounds - episode * cfg.episode_rounds)):
            while (prompt := match.decision_prompt()) is not None:
                if cfg.player_context == "chat":
                    chat_messages.append({"role": "user", "content": prompt})
                    messages = chat_messages
                else:
                    messages = [system, {"role": "user", "content": state_message(lines, prompt, memory if in_user else "")}]
                step = decisions
                decisions += 1
                reply, ids = await chat(
                    client,
                    cfg.player_model,
                    messages,
                    temperature=cfg.player_temperature,
                    max_tokens=cfg.player_max_tokens,
                    seed=request_seed(testbed, opponent, seed, "player", step, cfg.seed_salt if cfg.salt_player_seeds else ""),
                    user=user,
                    schema=match.reply_schema if cfg.constrain_player else None,
                )
                if cfg.player_context == "chat":
                    chat_messages.append({"role": "assistant", "content": reply})
                if ids.get("turn_id"):
                    game.player_turn_ids.append(ids["turn_id"])
                match.act(reply)
            result = match.end_round()
            game.rounds.append(result)
            game.episode_of_round.append(episode)
            lines.append(result.line)
        if episode == n_episodes - 1 and not cfg.update_after_last:
            break
        interaction = Interaction(transcript="\n".join(lines), outcome=_outcome(game, episode))
        memory = await _update(client, method, memory, interaction, game, episode, cfg, user)
    return game


def _outcome(game: GameRecord, episode: int) -> str:
    rs = [r for r, e in zip(game.rounds, game.episode_of_round, strict=True) if e == episode]
    wins, losses = sum(r.payoff > 0 for r in rs), sum(r.payoff < 0 for r in rs)
    return f"{wins} won, {losses} lost, {len(rs) - wins - losses} drawn of {len(rs)} rounds (payoff {game.episode_payoff(episode):+g})"


async def _update(
    client: httpx.AsyncClient, method: MemoryMethod, memory: str, interaction: Interaction, game: GameRecord, episode: int, cfg: PlayConfig, user: str
) -> str:
    messages = method.prompt(memory, interaction)
    completion: str | None = None
    ids: dict[str, Any] = {}
    if messages is not None:
        model = cfg.copilot_model or cfg.player_model
        completion, ids = await chat(
            client,
            model,
            messages,
            temperature=cfg.copilot_temperature,
            max_tokens=cfg.copilot_max_tokens,
            seed=request_seed(game.testbed, game.opponent, game.seed, "copilot", episode, cfg.seed_salt),
            user=f"{user}-copilot",
            schema=method.response_schema,
        )
    new = method.apply(memory, interaction, completion)
    game.rewrites.append(
        Rewrite(
            episode=episode,
            memory_before=memory,
            memory_after=new,
            completion=completion,
            turn_id=ids.get("turn_id"),
            trajectory_id=ids.get("trajectory_id"),
            adapter=ids.get("adapter"),
        )
    )
    return new
