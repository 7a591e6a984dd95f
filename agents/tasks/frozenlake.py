"""``frozenlake``: gymnasium's FrozenLake as a multi-turn text environment (and a one-shot planning variant).

Problems: by default each problem is a random ``size``×``size`` map from gymnasium's
``generate_random_map(size, p, seed)`` with map seed ``seed * 1_000_003 + index`` (always solvable);
``map_name="4x4"`` or ``"8x8"`` uses gymnasium's fixed map instead. ``is_slippery=False`` by default
(moves are deterministic). The gold answer is a shortest move sequence such as ``"RRDDDR"`` (None on
slippery ice, where no fixed sequence is guaranteed to win).

Episode protocol (``mode="interactive"``, the default). ``problem.prompt`` holds the rules, the answer
format and the first observation (the same text ``env.reset()`` returns), so an agent loop sends the
prompt as the first user message, calls ``env.reset()``, and after every assistant turn sends
``env.step(reply).observation`` as the next user message until ``done``. Each step:

* the move is parsed from free text: the last ``<action>…</action>`` (or ``<answer>``) holding one of
  ``left/down/right/up``, ``L/D/R/U``, gymnasium's ``0/1/2/3`` or an arrow; otherwise "action: right" /
  "move right" phrases; otherwise the only direction word in the text. Anything else is a format error:
  the observation explains the format, reward 0, not done, no move spent; after ``max_format_errors``
  of them the episode ends with reward 0;
* reaching the goal gives reward 1 and ends the episode; falling into a hole ends it with reward 0; after
  ``max_steps`` moves without either it ends (truncated) with reward 0.

The final reward of an episode is the terminal ``EnvStep.reward`` (also ``info["episode_reward"]``);
there is no shaping. ``info["moves"]`` is the move string so far, and ``verify(problem, info["moves"])``
replays it on a fresh copy of the same environment (same map, same seed, so slippery replays match too)
and gives the same reward: the learner can re-verify a recorded episode from its moves alone.

``mode="plan"``: no environment; the prompt shows the map and asks for the whole path at once as
``<answer>RRDD…</answer>``, which ``verify`` replays.

Process scorer for PATR (``score_prefix``, never a reward): 1 at the goal; 0 in a hole, after the episode
ended otherwise, or when the goal is farther than the moves left (a dead end); else
``v * (1 + p) / 2`` with progress ``p = (d0 - d) / d0`` (``d``, ``d0``: shortest-path distances to the goal
from here and from the start, holes avoided) and validity ``v = 1 - format_errors / max_format_errors``.
``signature`` (RODS's variants): the map size and the shortest path's length.

What this module does not do: no partial credit in the reward for getting closer (``info["distance_to_goal"]``
is there for anyone who wants shaping), no per-turn process score, no rendering through gymnasium's ANSI renderer
(its colour codes waste tokens); it uses gymnasium only for the dynamics.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import Any

import structlog

from .answers import extract_tag, last_boxed
from .base import EnvStep, PrefixState, Problem, TaskBase, Verdict

__all__ = ["ACTIONS", "FrozenLakeConfig", "FrozenLakeTask", "FrozenLakeTextEnv", "parse_action", "parse_moves", "shortest_path"]

log = structlog.get_logger(__name__)

_SEED_STRIDE = 1_000_003
# gymnasium's encoding: 0 left, 1 down, 2 right, 3 up
ACTIONS = ("left", "down", "right", "up")
_LETTER = {"left": "L", "down": "D", "right": "R", "up": "U"}
_TOKEN_TO_ACTION = {
    "left": 0, "l": 0, "0": 0, "←": 0, "west": 0,
    "down": 1, "d": 1, "1": 1, "↓": 1, "south": 1,
    "right": 2, "r": 2, "2": 2, "→": 2, "east": 2,
    "up": 3, "u": 3, "3": 3, "↑": 3, "north": 3,
}  # fmt: skip
_WORD_RE = re.compile(r"\b(left|down|right|up)\b", re.IGNORECASE)
_PHRASE_RE = re.compile(
    r"\b(?:action|move|moving|go|going|step|choose|direction)\b\s*(?:is|:|=|to|to the)?\s*\**\s*(left|down|right|up)\b", re.IGNORECASE
)
_SEQ_TOKEN_RE = re.compile(r"left|down|right|up|[ldru←↓→↑]", re.IGNORECASE)
_SEQ_ONLY_RE = re.compile(r"^(?:[\s,;.\->→←↓↑\[\]\"'`]|left|down|right|up|[ldru])*$", re.IGNORECASE)
_MAX_SEQUENCE = 1000
_STRIP = "`'\".*[]()!?:; "
_FIXED_MAPS = ("4x4", "8x8")


@dataclass(frozen=True)
class FrozenLakeConfig:
    size: int = 4
    p: float = 0.8  # probability that a random cell is frozen (safe)
    map_name: str | None = None  # "4x4" / "8x8": gymnasium's fixed map instead of random ones
    is_slippery: bool = False
    max_steps: int | None = None  # moves per episode; default 4 * size (16 on 4x4)
    max_format_errors: int = 3
    mode: str = "interactive"  # or "plan"

    def __post_init__(self) -> None:
        if self.map_name is not None and self.map_name not in _FIXED_MAPS:
            raise ValueError(f"map_name must be one of {_FIXED_MAPS} or None, got {self.map_name!r}")
        if not 2 <= self.size <= 32:
            raise ValueError(f"size must be in [2, 32], got {self.size}")
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"p must be in (0, 1], got {self.p}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be positive, got {self.max_steps}")
        if self.max_format_errors < 1:
            raise ValueError(f"max_format_errors must be positive, got {self.max_format_errors}")
        if self.mode not in ("interactive", "plan"):
            raise ValueError(f"mode must be 'interactive' or 'plan', got {self.mode!r}")


def _normalize_desc(desc: list[str] | list[bytes] | Any) -> list[str]:
    return ["".join(c.decode() if isinstance(c, bytes) else str(c) for c in row) for row in desc]


def _move(desc: list[str], row: int, col: int, action: int) -> tuple[int, int]:
    dr, dc = ((0, -1), (1, 0), (0, 1), (-1, 0))[action]
    r, c = row + dr, col + dc
    return (r, c) if 0 <= r < len(desc) and 0 <= c < len(desc[0]) else (row, col)


def shortest_path(desc: list[str]) -> str | None:
    """A shortest move string (``"RRDD"``) from S to G on non-slippery ice, avoiding holes; None if G is unreachable."""
    start = next((r, row.index("S")) for r, row in enumerate(desc) if "S" in row)
    prev: dict[tuple[int, int], tuple[tuple[int, int], int] | None] = {start: None}
    queue = deque([start])
    while queue:
        pos = queue.popleft()
        if desc[pos[0]][pos[1]] == "G":
            letters = []
            while prev[pos] is not None:
                pos, action = prev[pos]  # type: ignore[misc]
                letters.append(_LETTER[ACTIONS[action]])
            return "".join(reversed(letters))
        if desc[pos[0]][pos[1]] == "H":
            continue
        for action in range(4):
            nxt = _move(desc, *pos, action)
            if nxt not in prev:
                prev[nxt] = (pos, action)
                queue.append(nxt)
    return None


def _distance_to_goal(desc: list[str], row: int, col: int) -> int | None:
    if desc[row][col] == "H":
        return None
    sub = [list(r) for r in desc]
    for r, line in enumerate(sub):
        for c, ch in enumerate(line):
            if ch == "S":
                sub[r][c] = "F"
    sub[row][col] = "S" if sub[row][col] != "G" else "G"
    if sub[row][col] == "G":
        return 0
    path = shortest_path(["".join(r) for r in sub])
    return None if path is None else len(path)


def parse_action(text: str) -> int | None:
    """gymnasium action (0 left, 1 down, 2 right, 3 up) named in free text, or None (see the module docstring for the rules)."""
    if not isinstance(text, str) or not text.strip():
        return None
    tagged = extract_tag(text, ("action",))
    if tagged is None:
        tagged = extract_tag(text, ("answer",))
    if tagged is not None:
        token = tagged.strip().strip(_STRIP).lower()
        if token in _TOKEN_TO_ACTION:
            return _TOKEN_TO_ACTION[token]
        words = {w.lower() for w in _WORD_RE.findall(tagged)}  # "<action>move right</action>"
        return _TOKEN_TO_ACTION[words.pop()] if len(words) == 1 else None
    bare = text.strip().strip(_STRIP).lower()
    if bare in _TOKEN_TO_ACTION:  # a reply that is just "R", "right", "2" or an arrow
        return _TOKEN_TO_ACTION[bare]
    phrases = _PHRASE_RE.findall(text)
    if phrases:
        return _TOKEN_TO_ACTION[phrases[-1].lower()]
    words = {w.lower() for w in _WORD_RE.findall(text)}
    if len(words) == 1:
        return _TOKEN_TO_ACTION[words.pop()]
    return None


def parse_moves(text: str) -> list[int] | None:
    """A move sequence ("RRDD", "right, right, down", "→ → ↓") from the answer tag, a ``\\boxed{}``, or the whole text; None if there is none."""
    if not isinstance(text, str):
        return None
    candidate = extract_tag(text) or extract_tag(text, ("action", "moves", "path")) or last_boxed(text) or text.strip()
    candidate = candidate.strip()
    if not candidate or len(candidate) > 10 * _MAX_SEQUENCE or not _SEQ_ONLY_RE.match(candidate):
        return None
    tokens = _SEQ_TOKEN_RE.findall(candidate)
    if not tokens or len(tokens) > _MAX_SEQUENCE:
        return None
    return [_TOKEN_TO_ACTION[t.lower()] for t in tokens]


class FrozenLakeTextEnv:
    """One FrozenLake episode as text; gymnasium runs the dynamics."""

    def __init__(self, problem: Problem) -> None:
        meta = problem.metadata
        self.desc: list[str] = list(meta["desc"])
        self.is_slippery: bool = bool(meta["is_slippery"])
        self.max_steps: int = int(meta["max_steps"])
        self.max_format_errors: int = int(meta["max_format_errors"])
        self.env_seed: int = int(meta["env_seed"])
        self.problem_id = problem.id
        self._env: Any = None
        self.moves = ""
        self.steps = 0
        self.format_errors = 0
        self.done = False
        self.episode_reward = 0.0
        self.outcome: str | None = None
        self.row, self.col = 0, 0

    # ---- rendering ---------------------------------------------------------------------------------

    def render(self) -> str:
        rows = []
        for r, line in enumerate(self.desc):
            rows.append(" ".join("P" if (r, c) == (self.row, self.col) and not self.done else ch for c, ch in enumerate(line)))
        grid = "\n".join(rows)
        legend = "Legend: P = you, S = start, F = frozen (safe), H = hole (falling in ends the game), G = goal."
        goal_row, goal_col = self._goal
        pos = f"You are at row {self.row}, column {self.col} (row 0 is the top, column 0 the left); the goal is at row {goal_row}, column {goal_col}."
        left = self.max_steps - self.steps
        return f"{grid}\n{legend}\n{pos}\nMoves left: {left}."

    @property
    def _goal(self) -> tuple[int, int]:
        return next((r, line.index("G")) for r, line in enumerate(self.desc) if "G" in line)

    _ASK = "Reply with exactly one move: <action>left</action>, <action>down</action>, <action>right</action> or <action>up</action>."

    # ---- protocol ----------------------------------------------------------------------------------

    def reset(self) -> str:
        import gymnasium as gym

        if self._env is None:
            self._env = gym.make("FrozenLake-v1", desc=self.desc, is_slippery=self.is_slippery, max_episode_steps=self.max_steps)
        state, _ = self._env.reset(seed=self.env_seed)
        ncol = len(self.desc[0])
        self.row, self.col = divmod(int(state), ncol)
        self.moves, self.steps, self.format_errors = "", 0, 0
        self.done, self.episode_reward, self.outcome = False, 0.0, None
        return f"{self.render()}\n{self._ASK}"

    def state_key(self) -> str | None:
        """GiGPO's anchor state: the cell the agent stands on (the map is the problem's; moves made so far are history)."""
        return None if self.done else f"cell:{self.row},{self.col}"

    def _info(self, **extra: Any) -> dict[str, Any]:
        return {
            "moves": self.moves,
            "steps": self.steps,
            "position": (self.row, self.col),
            "format_errors": self.format_errors,
            "episode_reward": self.episode_reward,
            "outcome": self.outcome,
            "distance_to_goal": None if self.done else _distance_to_goal(self.desc, self.row, self.col),
            **extra,
        }

    def step(self, action_text: str) -> EnvStep:
        if self._env is None:
            self.reset()
        if self.done:
            return EnvStep("The episode is over.", 0.0, True, self._info(format_error=False))
        action = parse_action(action_text)
        if action is None:
            self.format_errors += 1
            if self.format_errors >= self.max_format_errors:
                self.done, self.outcome = True, "format_errors"
                obs = f"Could not read a move {self.format_errors} times; the episode is over. Reward 0."
                return EnvStep(obs, 0.0, True, self._info(format_error=True))
            obs = f"I could not read a move from your reply. {self._ASK}\n{self.render()}"
            return EnvStep(obs, 0.0, False, self._info(format_error=True))
        before = (self.row, self.col)
        state, reward, terminated, truncated, _ = self._env.step(action)
        self.steps += 1
        self.moves += _LETTER[ACTIONS[action]]
        self.row, self.col = divmod(int(state), len(self.desc[0]))
        cell = self.desc[self.row][self.col]
        name = ACTIONS[action]
        if (self.row, self.col) == before:
            what = f"You tried to move {name} but hit the edge and stayed at row {self.row}, column {self.col}."
        elif self.is_slippery and (self.row, self.col) != _move(self.desc, *before, action):
            what = f"You tried to move {name}, slipped, and ended at row {self.row}, column {self.col}."
        else:
            what = f"You moved {name} to row {self.row}, column {self.col}."
        if terminated and cell == "G":
            self.done, self.outcome, self.episode_reward = True, "goal", 1.0
            return EnvStep(f"{what} You reached the goal! The episode is over. Reward 1.", 1.0, True, self._info(format_error=False))
        if terminated:
            self.done, self.outcome = True, "hole"
            return EnvStep(f"{what} You fell into a hole. The episode is over. Reward 0.", 0.0, True, self._info(format_error=False))
        if truncated or self.steps >= self.max_steps:
            self.done, self.outcome = True, "out_of_moves"
            return EnvStep(f"{what} You are out of moves. The episode is over. Reward 0.", 0.0, True, self._info(format_error=False))
        return EnvStep(f"{what}\n{self.render()}\n{self._ASK}", float(reward), False, self._info(format_error=False))

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None


class FrozenLakeTask(TaskBase):
    """FrozenLake maps as multi-turn episodes (or one-shot plans); see the module docstring."""

    def __init__(self, *, name: str = "frozenlake", **options: Any) -> None:
        try:
            self.config = FrozenLakeConfig(**options)
        except TypeError as exc:
            raise ValueError(f"{name}: {exc}") from exc
        self.name = name
        self.tools = ()
        shape = self.config.map_name or f"random {self.config.size}x{self.config.size}"
        ice = "slippery" if self.config.is_slippery else "non-slippery"
        self.description = f"FrozenLake ({shape} maps, {ice} ice): walk from S to G without falling into a hole."
        if self.config.mode == "plan":
            self.description += " One-shot: give the whole path."

    def _desc(self, map_seed: int) -> list[str]:
        if self.config.map_name is not None:
            from gymnasium.envs.toy_text.frozen_lake import MAPS

            return list(MAPS[self.config.map_name])
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        return _normalize_desc(generate_random_map(size=self.config.size, p=self.config.p, seed=map_seed))

    def problems(self, n: int, seed: int = 0) -> list[Problem]:
        self._check_n(n)
        out = []
        for i in range(n):
            map_seed = seed * _SEED_STRIDE + i
            desc = self._desc(map_seed)
            size = len(desc)
            max_steps = self.config.max_steps or 4 * size
            meta = {
                "seed": seed,
                "index": i,
                "desc": desc,
                "is_slippery": self.config.is_slippery,
                "max_steps": max_steps,
                "max_format_errors": self.config.max_format_errors,
                "env_seed": map_seed,
                "mode": self.config.mode,
            }
            gold = None if self.config.is_slippery else shortest_path(desc)
            pid = f"{self.name}/s{seed}/{i}"
            draft = Problem(self.name, pid, "", gold, meta)
            out.append(Problem(self.name, pid, self._prompt(draft), gold, meta))
        return out

    def _prompt(self, problem: Problem) -> str:
        meta = problem.metadata
        slip = (
            " The ice is slippery: a move can send you sideways instead."
            if meta["is_slippery"]
            else " The ice is not slippery: every move goes where you say unless the edge stops you."
        )
        rules = (
            "You are playing FrozenLake on a grid. Walk from the start S to the goal G, one square per move "
            "(left, down, right or up), without stepping on a hole H." + slip
        )
        env = FrozenLakeTextEnv(problem)
        start = next((r, line.index("S")) for r, line in enumerate(meta["desc"]) if "S" in line)
        env.row, env.col = start
        if meta["mode"] == "plan":
            board = env.render().rsplit("\n", 1)[0]  # no "moves left" line
            return (
                f"{rules}\n\n{board}\n\nGive the whole path at once, at most {meta['max_steps']} moves, as letters "
                "L (left), D (down), R (right), U (up) in answer tags, for example <answer>RRDD</answer>."
            )
        return f"{rules} You have at most {meta['max_steps']} moves.\n\n{env.render()}\n{env._ASK}"

    def score_prefix(self, problem: Problem, state: PrefixState) -> float | None:
        """PATR's process score of a partial episode (module docstring); None without an environment (plan mode)."""
        env = state.env
        if not isinstance(env, FrozenLakeTextEnv):
            return None
        if env.outcome == "goal":
            return 1.0
        if env.done:
            return 0.0
        d = _distance_to_goal(env.desc, env.row, env.col)
        if d is None or d > env.max_steps - env.steps:
            return 0.0
        start = next((r, line.index("S")) for r, line in enumerate(env.desc) if "S" in line)
        d0 = _distance_to_goal(env.desc, *start) or 0
        progress = min(1.0, max(0.0, (d0 - d) / d0)) if d0 > 0 else 1.0
        validity = 1.0 - env.format_errors / env.max_format_errors
        return validity * (1.0 + progress) / 2.0

    def signature(self, problem: Problem) -> str | None:
        """The map's size and the shortest path's length (None on slippery ice: no fixed path)."""
        gold = problem.answer
        return None if gold is None else f"{len(problem.metadata['desc'])}x{len(problem.metadata['desc'][0])}:path={len(gold)}"

    def make_env(self, problem: Problem) -> FrozenLakeTextEnv | None:
        if problem.metadata.get("mode", "interactive") == "plan":
            return None
        return FrozenLakeTextEnv(problem)

    def verify(self, problem: Problem, answer: str) -> Verdict:
        """Replay the move sequence in ``answer`` on a fresh copy of the problem's environment."""
        moves = parse_moves(answer) if isinstance(answer, str) else None
        if moves is None:
            return Verdict(0.0, False, "no move sequence found (expected e.g. <answer>RRDD</answer>)").shown()
        env = FrozenLakeTextEnv(problem)
        try:
            env.reset()
            for k, action in enumerate(moves, start=1):
                if env.done:
                    break
                env.step(f"<action>{ACTIONS[action]}</action>")
                if env.outcome == "hole":
                    return Verdict(0.0, False, f"fell into the hole at row {env.row}, column {env.col} on move {k}").shown()
                if env.outcome == "goal":
                    return Verdict(1.0, True, f"reached the goal in {k} moves").shown()
            if env.outcome == "out_of_moves":
                return Verdict(0.0, False, f"out of moves after {env.steps} (limit {env.max_steps}) at row {env.row}, column {env.col}").shown()
            return Verdict(0.0, False, f"stopped at row {env.row}, column {env.col} after {env.steps} moves, not at the goal").shown()
        finally:
            env.close()
