"""RODS's synthesis: new problems with the structure of a boundary problem, from the task's own generator.

    synth = synthesize(task, problem, k=4, seed=variant_seed(problem.id))
    synth.variants        # [Variant(problem_index, seed, problem_id, signature)]: what the runs endpoint reproduces

A *variant* of a problem is another problem of the same task (same options) whose ``signature`` equals
the original's: the generator's own structure parameters, drawn with a fresh seed (calc_arith: the same
chain of operations, i.e. the same calculator-call graph with new operands; reasoning-gym: the item's
term and digit counts; FrozenLake: the map size and shortest-path length). A task without a signature
takes any problem of the seed. The search scans problems ``0, 1, ...`` of ``seed`` (in blocks, at most
``max_candidates``) and keeps a candidate only if

- it is not the original nor in ``exclude`` (problem ids already in the learner's pool), and not a repeat
  of a prompt already kept;
- its signature matches;
- the task's **verifier accepts the problem's own gold answer** (``gold_text``): a problem the verifier
  cannot pass (no gold, a broken generator item, an unsolvable map) never becomes a variant.

Variant seeds come from :func:`variant_seed` (a range above ``VARIANT_SEED_BASE``, far from the seeds
training traffic, held-out evaluations and the gate use), so a variant is addressed like any task
problem: ``(problem_index, seed)`` under the agent's task options.

Not here: which problems are at the boundary, the replay pool (``learner/rods.py``), HTTP (``agents/host.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from .base import Problem, Task

__all__ = ["VARIANT_SEED_BASE", "Synthesis", "Variant", "gold_text", "signature", "synthesize", "variant_seed"]

VARIANT_SEED_BASE = 1_000_000_000
_BLOCK = 32


@dataclass(frozen=True)
class Variant:
    problem_index: int
    seed: int
    problem_id: str
    signature: str | None


@dataclass
class Synthesis:
    variants: list[Variant] = field(default_factory=list)
    candidates: int = 0  # problems looked at
    rejected: dict[str, int] = field(default_factory=lambda: {"duplicate": 0, "signature": 0, "verifier": 0})

    def to_dict(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [v.__dict__ for v in self.variants],
            "candidates": self.candidates,
            "rejected": dict(self.rejected),
        }


def variant_seed(problem_id: str, round_: int = 0) -> int:
    """A problem seed for the variants of ``problem_id`` (round ``round_``): ``VARIANT_SEED_BASE + hash mod 1e9``."""
    h = hashlib.sha256(f"{problem_id}:{round_}".encode()).digest()
    return VARIANT_SEED_BASE + int.from_bytes(h[:8], "big") % 1_000_000_000


def signature(task: Task, problem: Problem) -> str | None:
    fn = getattr(task, "signature", None)
    sig = fn(problem) if callable(fn) else None
    return sig if isinstance(sig, str) else None


def gold_text(problem: Problem) -> str | None:
    """The problem's gold answer as an answer message the verifier reads (``<answer>…</answer>``); None without one."""
    if problem.answer is None:
        return None
    return f"<answer>{problem.answer}</answer>"


def _verifies(task: Task, problem: Problem) -> bool:
    text = gold_text(problem)
    if text is None:
        return False
    try:
        return bool(task.verify(problem, text).correct)
    except Exception:  # a generator item the verifier chokes on is not a valid variant
        return False


def synthesize(task: Task, problem: Problem, *, k: int, seed: int, max_candidates: int = 256, exclude: frozenset[str] = frozenset()) -> Synthesis:
    """Up to ``k`` validated variants of ``problem`` from problems ``0..max_candidates-1`` of ``seed`` (module docstring)."""
    if not 1 <= k <= 64:
        raise ValueError(f"k must be in [1, 64], got {k}")
    if not 1 <= max_candidates <= 4096:
        raise ValueError(f"max_candidates must be in [1, 4096], got {max_candidates}")
    want = signature(task, problem)
    out = Synthesis()
    prompts = {problem.prompt}
    n, start = min(_BLOCK, max_candidates), 0
    while len(out.variants) < k and start < max_candidates:
        block = task.problems(n, seed=seed)  # prefix-stable: problems(n)[i] == problems(m)[i]
        for i in range(start, len(block)):
            if len(out.variants) >= k:
                break
            cand = block[i]
            out.candidates += 1
            if cand.id == problem.id or cand.id in exclude or cand.prompt in prompts:
                out.rejected["duplicate"] += 1
                continue
            if want is not None and signature(task, cand) != want:
                out.rejected["signature"] += 1
                continue
            if not _verifies(task, cand):
                out.rejected["verifier"] += 1
                continue
            prompts.add(cand.prompt)
            out.variants.append(Variant(i, seed, cand.id, want))
        if len(block) < n:
            break  # a finite generator ran out
        start, n = len(block), min(2 * n, max_candidates)
    return out
