"""Memory update methods: how a memory document becomes the next one after an interaction.

A method is two pure functions over text. ``prompt(memory, interaction)`` gives the chat messages of the
model call that rewrites the memory (``None`` when the method makes no model call); ``apply(memory,
interaction, completion)`` turns the model's completion (or nothing) into the new memory, bounded to
``max_chars``. The methods:

- ``none``: memory stays empty (the frozen player alone).
- ``append-all``: the full history, each interaction's transcript and outcome appended; the oldest text
  is cut so the newest ``max_chars`` characters remain. No model call.
- ``reflection``: a hand-written update prompt: the model rewrites the memory into short lessons about
  the opponent or user (habits, preferences, what worked).
- ``memopilot``: the copilot prompt of MemoPilot (arXiv 2606.08656; ``docs/methods.md``): (previous memory, interaction log,
  outcome) → the rewritten memory. Served with the adapter family ``memopilot`` (untrained: the base
  model), trained online by the learner.

Both model methods ask for the memory inside ``<memory>…</memory>`` and parse the completion
leniently: a ``<think>`` span is dropped, the last complete ``<memory>`` block wins (an unclosed one
is taken to the end), a lone code fence is unwrapped; an empty result keeps the old memory.

``memopilot`` given the game's ``actions`` (``get_method(..., actions=...)``, what the testbeds use)
writes structured memory instead: its reply is decoded under ``response_schema``, a JSON object
``{"note": <at most note_chars characters>, "next": <one of the actions>}``, and the memory is the
note followed by ``Next move: <action>``. A small copilot writing free text rarely names an action
at all (SmolLM2-135M sampled at temperature 1 wrote none in 16 rewrites of RPS logs), and a small
player follows a named action far more than a lesson; the schema gives the learner an action it can
credit while the note stays free. A reply that is not such an object keeps the old memory.

Not here: where memory is stored (``memory/store.py``), when the copilot runs and how its call is
recorded (``memory/copilot.py``). No I/O, no model, no torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

METHODS: tuple[str, ...] = ("none", "append-all", "reflection", "memopilot")

DEFAULT_MAX_CHARS = 2000
DEFAULT_MAX_LOG_CHARS = 6000  # the interaction log in a prompt keeps its newest part; it can be long (hold'em)


@dataclass(frozen=True)
class Interaction:
    """One interaction as memory methods see it."""

    transcript: str  # the interaction log as text (what the player saw and did)
    outcome: str | None = None  # e.g. "won 3 of 5 rounds", None when unknown


class MemoryMethod(Protocol):
    @property
    def name(self) -> str:
        """``none``, ``append-all``, ``reflection`` or ``memopilot``."""
        ...

    @property
    def needs_model(self) -> bool: ...

    @property
    def response_schema(self) -> dict[str, Any] | None:
        """The JSON schema the model's reply is decoded under (None: free text)."""
        ...

    def prompt(self, memory: str, interaction: Interaction) -> list[dict[str, str]] | None:
        """Chat messages for the model call; None when the method makes no model call."""
        ...

    def apply(self, memory: str, interaction: Interaction, completion: str | None) -> str:
        """The new memory text, at most ``max_chars`` characters."""
        ...


def keep_newest(text: str, max_chars: int) -> str:
    """The last ``max_chars`` characters of ``text`` (the oldest side is cut)."""
    return text if len(text) <= max_chars else text[len(text) - max_chars :]


def keep_head(text: str, max_chars: int) -> str:
    """The first ``max_chars`` characters, cut at the last line break when one is in the second half."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    cut = head.rfind("\n")
    return head[:cut].rstrip() if cut >= max_chars // 2 else head


_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)
_MEMORY_BLOCK = re.compile(r"<memory>(.*?)</memory>", re.DOTALL | re.IGNORECASE)
_MEMORY_OPEN = re.compile(r"<memory>", re.IGNORECASE)
_FENCE = re.compile(r"^```[\w-]*\n(.*?)\n?```$", re.DOTALL)


def parse_memory(completion: str | None) -> str:
    """The memory text inside a model's completion ('' when there is none); see the module docstring."""
    if not completion:
        return ""
    text = _THINK.sub("", completion)
    blocks = _MEMORY_BLOCK.findall(text)
    if blocks:
        text = blocks[-1]
    else:
        opens = list(_MEMORY_OPEN.finditer(text))
        if opens:  # an unclosed wrapper (the completion ran out of tokens): take what follows it
            text = text[opens[-1].end() :]
        text = text.replace("</memory>", "")
    text = text.strip()
    if fenced := _FENCE.match(text):
        text = fenced.group(1).strip()
    return text


def _outcome_line(interaction: Interaction) -> str:
    return interaction.outcome if interaction.outcome else "unknown"


@dataclass(frozen=True)
class NoMemory:
    """``none``: no memory at all."""

    max_chars: int = DEFAULT_MAX_CHARS
    name: str = "none"
    needs_model: bool = False
    response_schema: None = None

    def prompt(self, memory: str, interaction: Interaction) -> list[dict[str, str]] | None:
        return None

    def apply(self, memory: str, interaction: Interaction, completion: str | None) -> str:
        return ""


@dataclass(frozen=True)
class AppendAll:
    """``append-all``: every transcript and outcome appended, truncated to the newest ``max_chars``."""

    max_chars: int = DEFAULT_MAX_CHARS
    name: str = "append-all"
    needs_model: bool = False
    response_schema: None = None

    def prompt(self, memory: str, interaction: Interaction) -> list[dict[str, str]] | None:
        return None

    def apply(self, memory: str, interaction: Interaction, completion: str | None) -> str:
        entry = interaction.transcript.strip()
        if interaction.outcome:
            entry += f"\nOutcome: {interaction.outcome}"
        joined = f"{memory.rstrip()}\n\n{entry}" if memory.strip() else entry
        return keep_newest(joined, self.max_chars)


REFLECTION_SYSTEM = (
    "You keep a short memory for a player who meets the same opponent or user again. "
    "After each interaction you rewrite the memory as a few concise lessons: the other side's habits, "
    "patterns and preferences, what worked and what failed, and what to do next time. "
    "Keep lessons that still hold, fix ones the new interaction contradicts, drop anything not useful. "
    "Write at most {max_chars} characters. Reply with the new memory only, inside <memory></memory>."
)
REFLECTION_USER = (
    "Current memory:\n{memory}\n\n"
    "What happened in the last interaction:\n{transcript}\n\n"
    "Result: {outcome}\n\n"
    "Reflect on what this shows about the opponent or user, then write the updated lessons inside <memory></memory>."
)

MEMOPILOT_SYSTEM = (
    "You are a memory copilot. A player model that cannot learn plays repeated interactions with the same "
    "counterpart; its only way to improve is the memory you write, which it reads before its next interaction. "
    "Given the previous memory, the log of the interaction just played and its outcome, rewrite the memory so "
    "that the player does better next time. Write at most {max_chars} characters. "
    "Answer with the rewritten memory inside <memory></memory> and nothing else."
)
MEMOPILOT_USER = "<previous_memory>\n{memory}\n</previous_memory>\n<interaction_log>\n{transcript}\n</interaction_log>\n<outcome>{outcome}</outcome>"


@dataclass(frozen=True)
class RewriteMethod:
    """A model rewrites the whole memory from (memory, interaction log, outcome): ``reflection`` or ``memopilot``."""

    name: str
    system: str
    user: str
    max_chars: int = DEFAULT_MAX_CHARS
    max_log_chars: int = DEFAULT_MAX_LOG_CHARS
    empty_memory: str = "(empty)"
    needs_model: bool = True
    response_schema: None = None

    def prompt(self, memory: str, interaction: Interaction) -> list[dict[str, str]] | None:
        values = {
            "memory": memory.strip() or self.empty_memory,
            "transcript": keep_newest(interaction.transcript.strip(), self.max_log_chars),
            "outcome": _outcome_line(interaction),
            "max_chars": str(self.max_chars),
        }
        return [
            {"role": "system", "content": self.system.format_map(values)},
            {"role": "user", "content": self.user.format_map(values)},
        ]

    def apply(self, memory: str, interaction: Interaction, completion: str | None) -> str:
        new = parse_memory(completion)
        if not new:
            return keep_head(memory, self.max_chars)
        return keep_head(new, self.max_chars)


MEMOPILOT_JSON_SYSTEM = (
    "You are a memory copilot. A player model that cannot learn plays repeated games against the same "
    "counterpart; its only way to improve is the memory you write, which it reads before its next game. "
    "Given the previous memory, the log of the game just played and its outcome, rewrite the memory as a JSON object: "
    '"note", what the player should remember about the counterpart (at most {note_chars} characters), and '
    '"next", the move the player should make next time, one of: {actions}.'
)
NEXT_MOVE = "Next move: "
DEFAULT_NOTE_CHARS = 80


@dataclass(frozen=True)
class StructuredRewrite:
    """``memopilot`` over a game's actions: the reply is ``{"note", "next"}`` JSON (see the module docstring)."""

    actions: tuple[str, ...]
    max_chars: int = DEFAULT_MAX_CHARS
    max_log_chars: int = DEFAULT_MAX_LOG_CHARS
    note_chars: int = DEFAULT_NOTE_CHARS
    name: str = "memopilot"
    needs_model: bool = True

    def __post_init__(self) -> None:
        if not self.actions:
            raise ValueError("a structured memopilot needs at least one action")

    @property
    def response_schema(self) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"note": {"type": "string", "maxLength": self.note_chars}, "next": {"type": "string", "enum": list(self.actions)}},
            "required": ["note", "next"],
            "additionalProperties": False,
        }

    def prompt(self, memory: str, interaction: Interaction) -> list[dict[str, str]] | None:
        system = MEMOPILOT_JSON_SYSTEM.format(note_chars=self.note_chars, actions=", ".join(self.actions))
        user = MEMOPILOT_USER.format(
            memory=memory.strip() or "(empty)",
            transcript=keep_newest(interaction.transcript.strip(), self.max_log_chars),
            outcome=_outcome_line(interaction),
        )
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def apply(self, memory: str, interaction: Interaction, completion: str | None) -> str:
        try:
            reply = json.loads(completion or "")
        except json.JSONDecodeError:
            return keep_head(memory, self.max_chars)
        if not isinstance(reply, dict) or reply.get("next") not in self.actions:
            return keep_head(memory, self.max_chars)
        note = str(reply.get("note") or "").strip()[: self.note_chars]
        move = f"{NEXT_MOVE}{reply['next']}"
        return keep_newest(f"{note}\n{move}" if note else move, self.max_chars)


def get_method(
    name: str, *, max_chars: int = DEFAULT_MAX_CHARS, max_log_chars: int = DEFAULT_MAX_LOG_CHARS, actions: Sequence[str] | None = None
) -> MemoryMethod:
    """The memory method called ``name``; ``ValueError`` naming the known ones otherwise.

    ``actions`` (a game's moves) makes ``memopilot`` structured (:class:`StructuredRewrite`); the other
    methods ignore it.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be at least 1, got {max_chars}")
    if name == "memopilot" and actions is not None:
        return StructuredRewrite(tuple(actions), max_chars=max_chars, max_log_chars=max_log_chars)
    if name == "none":
        return NoMemory(max_chars=max_chars)
    if name == "append-all":
        return AppendAll(max_chars=max_chars)
    if name == "reflection":
        return RewriteMethod("reflection", REFLECTION_SYSTEM, REFLECTION_USER, max_chars=max_chars, max_log_chars=max_log_chars)
    if name == "memopilot":
        return RewriteMethod("memopilot", MEMOPILOT_SYSTEM, MEMOPILOT_USER, max_chars=max_chars, max_log_chars=max_log_chars)
    raise ValueError(f"unknown memory method {name!r}; known: {', '.join(METHODS)}")
