"""The tasks' hooks for PATR and RODS: process scores of partial runs (hand-computed) and verified variants.

A variant that fails its task's verifier must never reach the learner's pool: checked on the synthesis itself and
end to end through ``POST /admin/agents/{name}/variants`` into a ``learner.rods.ReplayPool``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.tasks import get_task, register_task
from agents.tasks.base import PrefixState, Verdict
from agents.tasks.calc_arith import CalcArithTask
from agents.tasks.variants import synthesize, variant_seed
from learner.rods import ItemRef, ReplayPool

FIXED = ["SFFF", "FHFH", "FFFH", "HFFG"]  # gymnasium's 4x4 map: 6 moves from S to G


def fl_state(task, problem, moves: str):
    env = task.make_env(problem)
    env.reset()
    for m in moves:
        env.step(m)
    return PrefixState(env, ())


def test_frozenlake_process_score_by_hand():
    task = get_task("frozenlake", map_name="4x4")
    p = task.problems(1)[0]
    assert task.score_prefix(p, fl_state(task, p, "")) == pytest.approx(0.5)  # at the start: (1 + 0) / 2
    assert task.score_prefix(p, fl_state(task, p, "D")) == pytest.approx(7 / 12)  # 5 of 6 moves left: (1 + 1/6) / 2
    assert task.score_prefix(p, fl_state(task, p, "DR")) == 0.0  # (1, 1) is a hole
    assert task.score_prefix(p, fl_state(task, p, "DDRRDR")) == 1.0  # the goal
    env = task.make_env(p)
    env.reset()
    env.step("D")
    env.step("no idea")  # one unreadable reply of 3 allowed: validity 2/3
    assert task.score_prefix(p, PrefixState(env, ())) == pytest.approx((2 / 3) * (7 / 12))
    tight = get_task("frozenlake", map_name="4x4", max_steps=6)
    q = tight.problems(1)[0]
    assert tight.score_prefix(q, fl_state(tight, q, "U")) == 0.0  # a wasted move: 5 left for 6 to go, a dead end
    assert tight.score_prefix(q, PrefixState(None, ())) is None


def test_calc_arith_process_score_is_the_share_of_intermediate_results_reached():
    task = get_task("calc_arith", n_ops=2)
    p = task.problems(1, seed=3)[0]
    (a, b) = p.metadata["steps"]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    assert task.score_prefix(p, PrefixState(None, ())) == 0.0
    assert task.score_prefix(p, PrefixState(None, (call % a["expression"],))) == 0.5
    assert task.score_prefix(p, PrefixState(None, (call % a["expression"], call % "1 + 1"))) == 0.5
    assert task.score_prefix(p, PrefixState(None, (call % a["expression"], call % b["expression"]))) == 1.0
    assert task.score_prefix(p, PrefixState(None, (f"It is <answer>{p.answer}</answer>",))) == 1.0


@pytest.mark.parametrize(("name", "options"), [("calc_arith", {}), ("frozenlake", {}), ("chain_sum", {}), ("countdown", {})])
def test_variants_share_the_structure_and_pass_the_verifier(name, options):
    task = get_task(name, **options)
    original = task.problems(3, seed=0)[2]
    synth = synthesize(task, original, k=3, seed=variant_seed(original.id))
    assert len(synth.variants) == 3
    problems = task.problems(max(v.problem_index for v in synth.variants) + 1, seed=synth.variants[0].seed)
    for v in synth.variants:
        p = problems[v.problem_index]
        assert p.id == v.problem_id != original.id
        assert task.signature(p) == task.signature(original) == v.signature
        assert task.verify(p, f"<answer>{p.answer}</answer>").correct
    assert synth.variants == synthesize(task, original, k=3, seed=variant_seed(original.id)).variants  # reproducible


class OddOnly(CalcArithTask):
    """calc_arith whose verifier refuses every problem with an even answer (a generator the verifier disagrees with)."""

    def verify(self, problem, answer):
        if int(problem.answer) % 2 == 0:
            return Verdict(0.0, False, "even answers are refused")
        return super().verify(problem, answer)


def test_a_variant_that_fails_its_verifier_is_not_returned():
    task = OddOnly(n_ops=1, ops=("+",))
    original = next(p for p in task.problems(20) if int(p.answer) % 2 == 1)
    synth = synthesize(task, original, k=6, seed=variant_seed(original.id))
    assert synth.rejected["verifier"] > 0  # candidates with even answers were seen
    problems = task.problems(256, seed=variant_seed(original.id))
    assert synth.variants and all(int(problems[v.problem_index].answer) % 2 == 1 for v in synth.variants)


@pytest.fixture
def odd_task():
    from agents.tasks import _REGISTRY

    register_task("odd-calc", lambda **o: OddOnly(name="odd-calc", **o))
    yield "odd-calc"
    _REGISTRY.pop("odd-calc", None)


def test_only_verified_variants_enter_the_pool_through_the_endpoint(tmp_path: Path, tiny_model_path: Path, odd_task):
    from transformers import AutoTokenizer

    from agents.host import Host
    from tests.agents._scripted import ScriptedEngine
    from tests.security._app import ADMIN, KEY1, auth, served
    from tools.builtins import default_registry

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    engine = ScriptedEngine(tok, ["unused"])
    engine.tokenizer = tok
    agents = Host([{"name": "odd", "task": odd_task, "task_options": {"n_ops": 1, "ops": ["+"]}}], default_registry(python=False, cuda=False))
    task = OddOnly(name=odd_task, n_ops=1, ops=("+",))
    seed_index = next(i for i, p in enumerate(task.problems(20)) if int(p.answer) % 2 == 1)
    pool = ReplayPool(capacity=50)
    pool.add_seeds([ItemRef(seed_index, 0)])
    with served(tmp_path, tiny_model_path, engine=engine, agents=agents) as app:
        body = {"problem_index": seed_index, "seed": 0, "k": 8, "variant_seed": 1_000_000_123}
        assert app.post("/admin/agents/odd/variants", json=body, headers=auth(KEY1)).status_code == 401
        r = app.post("/admin/agents/odd/variants", json=body, headers=auth(ADMIN))
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["rejected"]["verifier"] > 0 and data["problem"]["signature"] == "+"
        pool.add_variants([ItemRef(v["problem_index"], v["seed"]) for v in data["data"]], parent=ItemRef(seed_index, 0))
        bad = app.post("/admin/agents/odd/variants", json={**body, "k": 0}, headers=auth(ADMIN))
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_value"
    candidates = task.problems(256, seed=1_000_000_123)
    variants = [it.ref for it in pool.items.values() if not it.is_seed]
    assert len(variants) == len(data["data"]) > 0
    assert all(int(candidates[r.problem_index].answer) % 2 == 1 for r in variants)  # no failed variant entered the pool
