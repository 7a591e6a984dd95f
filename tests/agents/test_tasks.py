"""Built-in tasks: registry, determinism, every verifier on right and wrong answers, FrozenLake episodes, HumanEval in the sandbox."""

from __future__ import annotations

import dataclasses

import pytest

from agents.tasks import Env, Problem, Task, UnknownTask, Verdict, get_task, register_task, task_names
from agents.tasks.calc_arith import calculator_expressions
from agents.tasks.frozenlake import FrozenLakeTextEnv, parse_action, parse_moves, shortest_path
from agents.tasks.humaneval import build_program, extract_code

RG_TASKS = ["basic_arithmetic", "chain_sum", "gsm_symbolic", "countdown"]


# ---- registry ------------------------------------------------------------------------------------


def test_registry_lists_the_builtin_tasks() -> None:
    assert set(task_names()) >= {*RG_TASKS, "calc_arith", "frozenlake", "humaneval"}


def test_unknown_task_names_the_known_ones() -> None:
    with pytest.raises(UnknownTask) as err:
        get_task("no_such_task")
    assert isinstance(err.value, KeyError)
    message = str(err.value)
    assert message.startswith("unknown task 'no_such_task'")
    assert "calc_arith" in message and "frozenlake" in message
    with pytest.raises(UnknownTask):
        get_task("rg:no_such_generator")


def test_bad_options_are_value_errors() -> None:
    with pytest.raises(ValueError, match="bogus"):
        get_task("basic_arithmetic", bogus=1)
    with pytest.raises(ValueError, match="seed"):
        get_task("chain_sum", seed=3)
    with pytest.raises(ValueError, match="n_ops"):
        get_task("calc_arith", n_ops=0)
    with pytest.raises(ValueError, match="map_name"):
        get_task("frozenlake", map_name="5x5")


def test_register_task_refuses_duplicates() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_task("calc_arith", lambda **kw: get_task("chain_sum"))


@pytest.mark.parametrize("name", [*RG_TASKS, "calc_arith", "frozenlake"])
def test_tasks_satisfy_the_protocol_and_are_deterministic(name: str) -> None:
    task = get_task(name)
    assert isinstance(task, Task)
    assert task.name == name and task.description
    first = task.problems(6, seed=0)
    assert len(first) == 6
    assert first == task.problems(6, seed=0)  # same (n, seed) → same problems
    assert task.problems(3, seed=0) == first[:3]  # a prefix for a smaller n
    other = task.problems(6, seed=1)
    assert [p.prompt for p in other] != [p.prompt for p in first]
    assert len({p.id for p in first + other}) == 12  # ids are unique across seeds
    for p in first:
        assert isinstance(p, Problem) and p.task == name
        assert "<answer>" in p.prompt or "<action>" in p.prompt  # the prompt states the answer format
        assert task.task_key(p) == f"{name}:{p.id}"
    assert task.problems(0) == []
    with pytest.raises(ValueError):
        task.problems(-1)


def test_other_reasoning_gym_generators_by_prefix() -> None:
    task = get_task("rg:maze")
    p = task.problems(1, seed=2)[0]
    assert p.task == "rg:maze" and p.id == "rg:maze/s2/0"
    assert task.verify(p, f"<answer>{p.answer}</answer>").correct
    assert task.verify(p, "<answer>not a number</answer>") == Verdict(0.0, False, f"expected {p.answer!r}, got 'not a number' (score 0.00)")


# ---- reasoning-gym verifiers ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["basic_arithmetic", "chain_sum", "gsm_symbolic"])
def test_numeric_generators_verify_right_and_wrong(name: str) -> None:
    task = get_task(name)
    for p in task.problems(5, seed=3):
        gold = str(p.answer)
        right = task.verify(p, f"Let me think. The result is <answer>{gold}</answer>")
        assert right == Verdict(1.0, True, f"correct: {gold}")
        assert task.verify(p, f"\\boxed{{{gold}}}").correct
        assert task.verify(p, f"Final answer: {gold}.").correct
        wrong = str(int(gold) + 1)
        verdict = task.verify(p, f"<answer>{wrong}</answer>")
        assert verdict == Verdict(0.0, False, f"expected {gold}, got {wrong}")
    p = task.problems(1)[0]
    huge = "<answer>" + "9" * 390 + "/7</answer>"  # a fraction too large for a float
    for garbage in ["", "   ", "I don't know", "<answer></answer>", "\x00\x01", "<answer>" * 50, huge]:
        verdict = task.verify(p, garbage)
        assert verdict.reward == 0.0 and not verdict.correct and verdict.detail


def test_numbers_are_normalized_before_scoring() -> None:
    task = get_task("basic_arithmetic", min_terms=2, max_terms=2, min_digits=3, max_digits=3, operators=("*",))
    p = next(q for q in task.problems(20) if int(q.answer) >= 1000)
    with_commas = f"{int(p.answer):,}.0"
    assert task.verify(p, f"<answer>{with_commas}</answer>").correct  # reasoning-gym alone compares strings


def test_partial_credit_is_off_by_default_and_can_be_enabled() -> None:
    strict, lenient = get_task("gsm_symbolic"), get_task("gsm_symbolic", partial_credit=True)
    p = strict.problems(1)[0]
    assert strict.verify(p, "<answer>1</answer>").reward == 0.0
    partial = lenient.verify(p, "<answer>1</answer>")
    assert 0.0 < partial.reward < 1.0 and not partial.correct  # reasoning-gym's 0.01 for a wrong number


def test_countdown_verifier() -> None:
    task = get_task("countdown")
    for p in task.problems(4, seed=0):
        src = p.metadata["source"]
        gold = p.answer  # a valid expression from the generator
        assert task.verify(p, f"<answer>{gold}</answer>").correct
        assert task.verify(p, f"{gold} = {src['target']}").correct  # a bare expression with "= target"
        numbers = src["numbers"]
        summed = " + ".join(map(str, numbers))
        if sum(numbers) != src["target"]:
            verdict = task.verify(p, f"<answer>{summed}</answer>")
            assert verdict == Verdict(0.0, False, f"{summed} evaluates to {sum(numbers)}, target {src['target']}")
        missing = " + ".join(map(str, numbers[:-1]))
        assert "must use each of" in task.verify(p, f"<answer>{missing}</answer>").detail
    p = task.problems(1)[0]
    hostile = task.verify(p, "<answer>__import__('os').system('touch /tmp/pwned')</answer>")
    assert hostile.reward == 0.0 and "not a plain" in hostile.detail
    assert task.verify(p, "<answer>2**999999999</answer>").reward == 0.0
    assert task.verify(p, "<answer>" + "1+" * 500 + "1</answer>").reward == 0.0


def test_countdown_accepts_a_hand_built_solution() -> None:
    task = get_task("countdown", min_numbers=3, max_numbers=3, min_target=10, max_target=50)
    p = task.problems(1, seed=5)[0]
    # an expression other than the stored string (bracketed, spaces removed) that is still a valid solution
    assert task.verify(p, f"<answer>({p.answer.replace(' ', '')})</answer>").correct
    # a problem of our own: reach 9 with 1, 2, 3
    source = {**p.metadata["source"], "numbers": [1, 2, 3], "target": 9, "expression": "(1 + 2) * 3"}
    own = dataclasses.replace(p, answer="(1 + 2) * 3", metadata={**p.metadata, "source": source})
    assert task.verify(own, "<answer>3 * (2 + 1)</answer>").correct
    assert task.verify(own, "<answer>3 * 3</answer>").detail == "uses [3, 3], must use each of [1, 2, 3] exactly once"
    assert task.verify(own, "<answer>1 + 2 + 3</answer>").detail == "1 + 2 + 3 evaluates to 6, target 9"


# ---- calc_arith ----------------------------------------------------------------------------------


def test_calc_arith_problems_and_verifier() -> None:
    task = get_task("calc_arith")
    assert task.tools == ("calculator",)
    problems = task.problems(20, seed=0)
    assert {len(p.metadata["steps"]) for p in problems} == {1, 2}  # the documented default: 1 or 2 operations per problem
    for p in problems:
        steps = p.metadata["steps"]
        assert p.answer == steps[-1]["value"] and p.answer >= 0
        assert "calculator" in p.prompt and "<answer>N</answer>" in p.prompt
        assert task.verify(p, f"<answer>{p.answer}</answer>") == Verdict(1.0, True, f"correct: {p.answer}")
        assert task.verify(p, f"{p.answer + 1}") == Verdict(0.0, False, f"expected {p.answer}, got {p.answer + 1}")
    assert task.verify(problems[0], "no idea") == Verdict(0.0, False, "no numeric answer found")
    assert {len(p.metadata["steps"]) for p in get_task("calc_arith", n_ops="2-3").problems(30)} == {2, 3}
    with pytest.raises(ValueError, match="n_ops"):
        get_task("calc_arith", n_ops="many")
    with pytest.raises(ValueError, match="n_ops"):
        get_task("calc_arith", n_ops=(3, 1))
    hard = get_task("calc_arith", n_ops=4, max_operand=99, ops="+-")
    q = hard.problems(1, seed=9)[0]
    assert len(q.metadata["steps"]) == 4 and "*" not in q.metadata["expression"]
    assert q.prompt.startswith("Compute (((")
    no_tools = get_task("calc_arith", use_tools=False)
    assert no_tools.tools == () and "calculator" not in no_tools.problems(1)[0].prompt


def test_calc_arith_expression_matches_its_steps() -> None:
    from agents.tasks.arith import evaluate

    task = get_task("calc_arith", n_ops=5, ops=("+", "-", "*"), allow_negative=True)
    for p in task.problems(30, seed=4):
        assert evaluate(p.metadata["expression"]) == p.answer
        for step in p.metadata["steps"]:
            assert evaluate(step["expression"]) == step["value"]


def test_calc_arith_process_score() -> None:
    task = get_task("calc_arith", n_ops=2)
    p = task.problems(1, seed=0)[0]
    first, second = p.metadata["steps"]
    good = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{first["expression"]}"}}}}</tool_call>'
    assert task.process_score(p, good) == 1.0
    assert task.process_score(p, f'calculator(expression="{second["expression"]}")') == 1.0
    openai_style = f'{{"name": "calculator", "arguments": "{{\\"expression\\": \\"{first["expression"]}\\"}}"}}'
    assert task.process_score(p, openai_style) == 1.0
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1000"}}</tool_call>'
    assert task.process_score(p, bad) == 0.0
    assert task.process_score(p, f"<answer>{p.answer}</answer>") == 1.0
    assert task.process_score(p, f"<answer>{p.answer + 1}</answer>") == 0.0
    assert task.process_score(p, "hmm") == 0.0
    # an untagged answer is read like the verifier reads it (the last number), so a one-turn run's process score is its outcome
    assert task.process_score(p, f"so it is {p.answer}") == 1.0 == task.verify(p, f"so it is {p.answer}").reward
    assert task.process_score(p, f"so it is {p.answer + 1}") == 0.0
    assert calculator_expressions("use the calculator: '12 * 3' and \"garbage\"") == ["12 * 3"]
    assert calculator_expressions('no tool here "3 + 4"') == []


# ---- FrozenLake ----------------------------------------------------------------------------------


def play(env: Env, actions: list[str]):
    steps = []
    for a in actions:
        step = env.step(a)
        steps.append(step)
        if step.done:
            break
    return steps


def test_frozenlake_winning_sequence_reaches_the_goal() -> None:
    task = get_task("frozenlake", map_name="4x4")
    p = task.problems(1)[0]
    assert p.answer == "RRDDDR" or len(p.answer) == 6  # gymnasium's 4x4 map: 6 moves is optimal
    env = task.make_env(p)
    first = env.reset()
    assert first in p.prompt and "Legend" in first and "row 0, column 0" in first
    words = {"R": "right", "D": "down", "L": "left", "U": "up"}
    steps = play(env, [f"I will go <action>{words[m]}</action>" for m in p.answer])
    assert [s.done for s in steps] == [False] * 5 + [True]
    assert [s.reward for s in steps] == [0.0] * 5 + [1.0]
    last = steps[-1]
    assert "reached the goal" in last.observation
    assert last.info["outcome"] == "goal" and last.info["episode_reward"] == 1.0 and last.info["moves"] == p.answer
    assert task.verify(p, last.info["moves"]) == Verdict(1.0, True, "reached the goal in 6 moves")
    assert env.step("right").done  # stepping after the end is harmless


def test_frozenlake_hole_ends_with_zero() -> None:
    task = get_task("frozenlake", map_name="4x4")  # S F F F / F H F H / ...: down-right... (1,1) is a hole
    p = task.problems(1)[0]
    env = task.make_env(p)
    env.reset()
    steps = play(env, ["right", "down"])
    assert steps[-1].done and steps[-1].reward == 0.0
    assert steps[-1].info["outcome"] == "hole" and "hole" in steps[-1].observation
    verdict = task.verify(p, "<answer>RD</answer>")
    assert verdict == Verdict(0.0, False, "fell into the hole at row 1, column 1 on move 2")


def test_frozenlake_unparsable_action_explains_the_format() -> None:
    task = get_task("frozenlake", max_format_errors=2)
    p = task.problems(1, seed=4)[0]
    env = task.make_env(p)
    env.reset()
    step = env.step("I am not sure what to do, maybe left or maybe right")
    assert not step.done and step.reward == 0.0 and step.info["format_error"]
    assert "<action>left</action>" in step.observation and step.info["steps"] == 0  # no move spent
    step = env.step("???")
    assert step.done and step.reward == 0.0 and step.info["outcome"] == "format_errors"


def test_frozenlake_truncates_after_max_steps() -> None:
    task = get_task("frozenlake", map_name="4x4", max_steps=3)
    p = task.problems(1)[0]
    env = task.make_env(p)
    env.reset()
    steps = play(env, ["left"] * 5)  # bump into the edge until the moves run out
    assert len(steps) == 3 and steps[-1].done and steps[-1].info["outcome"] == "out_of_moves"
    assert "hit the edge" in steps[0].observation
    assert task.verify(p, "LLL").detail.startswith("out of moves after 3")


def test_frozenlake_random_maps_are_solvable_and_replay_matches_the_env() -> None:
    task = get_task("frozenlake", size=5)
    for p in task.problems(5, seed=11):
        assert p.answer == shortest_path(p.metadata["desc"])
        assert task.verify(p, f"<answer>{', '.join(p.answer)}</answer>").correct
        env = task.make_env(p)
        env.reset()
        steps = play(env, list(p.answer))
        assert steps[-1].reward == 1.0 and steps[-1].info["distance_to_goal"] is None
    slippery = get_task("frozenlake", is_slippery=True, map_name="4x4")
    p = slippery.problems(1, seed=1)[0]
    assert p.answer is None
    env = slippery.make_env(p)
    env.reset()
    steps = play(env, ["down", "right"] * 10)
    # replaying the recorded moves on a fresh env (same seed) gives the same outcome
    assert slippery.verify(p, steps[-1].info["moves"]).reward == steps[-1].info["episode_reward"]


def test_frozenlake_plan_mode_has_no_env() -> None:
    task = get_task("frozenlake", mode="plan")
    p = task.problems(1)[0]
    assert task.make_env(p) is None and "<answer>RRDD</answer>" in p.prompt
    assert task.verify(p, f"My plan: <answer>{p.answer}</answer>").correct
    assert task.verify(p, "I'd walk around the lake") == Verdict(0.0, False, "no move sequence found (expected e.g. <answer>RRDD</answer>)")


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("<action>left</action>", 0),
        ("<action>D</action>", 1),
        ("<action>2</action>", 2),
        ("<action>↑</action>", 3),
        ("I go left... no: <action>right</action>", 2),
        ("<answer>down</answer>", 1),
        ("R", 2),
        ("up", 3),
        ("Action: down", 1),
        ("Not left, not right; I move down.", 1),
        ("The hole is on the left so I go right", 2),
        ("left or right?", None),
        ("<action>Right!</action>", 2),
        ("<action>move down</action>", 1),
        ("<action>jump</action>", None),
        ("<action>left then up</action>", None),
        ("", None),
    ],
)
def test_parse_action(text: str, action: int | None) -> None:
    assert parse_action(text) == action


def test_parse_moves() -> None:
    assert parse_moves("RRDD") == [2, 2, 1, 1]
    assert parse_moves("<answer>right, right, down</answer>") == [2, 2, 1]
    assert parse_moves("→ → ↓") == [2, 2, 1]
    assert parse_moves("I would go around the lake") is None
    assert parse_moves("") is None


def test_env_protocol() -> None:
    task = get_task("frozenlake")
    env = task.make_env(task.problems(1)[0])
    assert isinstance(env, Env) and isinstance(env, FrozenLakeTextEnv)
    assert get_task("calc_arith").make_env(get_task("calc_arith").problems(1)[0]) is None


# ---- HumanEval in the sandbox --------------------------------------------------------------------


@pytest.fixture(scope="module")
def humaneval() -> Task:
    return get_task("humaneval", wall_s=2.0, cpu_s=10.0)


def test_humaneval_problems(humaneval: Task) -> None:
    problems = humaneval.problems(3)
    assert [p.id for p in problems] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert "```python" in problems[0].prompt and problems[0].metadata["entry_point"] == "has_close_elements"
    shuffled = humaneval.problems(5, seed=7)
    assert shuffled == humaneval.problems(5, seed=7) and [p.id for p in shuffled] != [f"HumanEval/{i}" for i in range(5)]
    assert len(humaneval.problems(500)) == 164


def test_humaneval_canonical_solutions_pass(humaneval: Task) -> None:
    problems = humaneval.problems(164)
    for idx in (0, 10, 38, 162):  # 10 and 38 use helper functions from the prompt; 162 imports hashlib
        p = problems[idx]
        assert humaneval.verify(p, p.answer) == Verdict(1.0, True, "all tests passed")  # body only
        whole = p.metadata["prompt"] + p.answer
        assert humaneval.verify(p, f"Here is my solution:\n```python\n{whole}```\nIt works.").correct  # whole function, fenced


def test_humaneval_wrong_and_broken_answers(humaneval: Task) -> None:
    p = humaneval.problems(1)[0]
    wrong = humaneval.verify(p, "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```")
    assert wrong.reward == 0.0 and not wrong.correct and "assertion" in wrong.detail
    assert humaneval.verify(p, "return True").reward == 0.0  # an unindented body is indented, then fails the tests
    syntax = humaneval.verify(p, "```python\ndef has_close_elements(numbers, threshold):\n    return (\n```")
    assert syntax.reward == 0.0 and "SyntaxError" in syntax.detail
    assert humaneval.verify(p, "") == Verdict(0.0, False, "empty answer")


@pytest.mark.parametrize(("wall_s", "cpu_s", "limit"), [(2.0, 10.0, "no result within 2 s"), (10.0, 1.0, "CPU limit of 1 s exceeded")])
def test_humaneval_infinite_loop_times_out(wall_s: float, cpu_s: float, limit: str) -> None:
    task = get_task("humaneval", wall_s=wall_s, cpu_s=cpu_s)
    p = task.problems(1)[0]
    verdict = task.verify(p, "```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```")
    assert verdict == Verdict(0.0, False, f"timeout: {limit}")


def test_humaneval_code_extraction() -> None:
    assert extract_code("```py\nx = 1\n```\ntext\n```python\ndef f():\n    pass\n```", "f") == "def f():\n    pass\n"
    assert extract_code("```python\ndef f():\n    return 1\n```\n```python\nprint(f())\n```", "f") == "def f():\n    return 1\n"
    assert extract_code("<answer>return 1</answer>", "f") == "return 1"
    assert extract_code("```python\ndef f():\n    return 2", "f") == "def f():\n    return 2"  # unclosed fence
    p = Problem(
        "humaneval", "x", "", None, {"entry_point": "f", "prompt": 'def f():\n    """doc"""\n', "test": "def check(c):\n    assert c() == 1\n"}
    )
    assert build_program(p, "return 1") == 'def f():\n    """doc"""\n    return 1\n\ndef check(c):\n    assert c() == 1\n\n\ncheck(f)\n'
    assert "\ndef f():\n    return 1\n" in build_program(p, "    def f():\n        return 1\n")  # indented whole function is dedented
