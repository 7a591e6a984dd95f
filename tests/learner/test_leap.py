"""LEAP: DCP gating on hand-written probe tables, the budget arithmetic, the CLI, and rank rewards for kernel groups."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from learner.advantages import compute_advantages
from learner.leap import KernelEpisode, kernel_rank_advantages, kernel_rank_samples
from learner.leap_dcp import ProbeSample, classify_probe, explain_probe, load_probe, prune
from learner.samples import Sample

ROOT = Path(__file__).resolve().parents[2]


def ok(task: str = "t", speedup: float | None = 1.5, tokens: int = 100) -> ProbeSample:
    return ProbeSample(task, compiled=True, measured=True, correct=True, speedup=speedup, n_tokens=tokens)


def wrong(task: str = "t") -> ProbeSample:
    return ProbeSample(task, compiled=True, measured=True, correct=False)


def cerr(msg: str, line: int = 7, task: str = "t") -> ProbeSample:
    return ProbeSample(task, compiled=False, first_error=f"line {line}: error: {msg}")


def built(task: str = "t") -> ProbeSample:  # compiled on a machine without a GPU
    return ProbeSample(task, compiled=True, measured=False)


# ---- classification (GPU mode: correctness and speed measured) ---------------------------------------


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        ([ok(), ok(), ok(speedup=1.1), ok(speedup=3.0)], "simple"),  # all correct, median 1.5x
        ([ok(speedup=0.4), ok(speedup=0.5), ok(speedup=0.6), ok(speedup=2.0)], "useful"),  # correct but slow: room to speed up
        ([ok(), ok(), ok(), wrong()], "useful"),  # p = 0.75 < p_hi = 1
        # all compiled, ran and were wrong: not a compile/runtime wall; the checker's feedback is what refinement uses
        ([wrong(), wrong(), wrong(), wrong()], "useful"),
        ([cerr('identifier "foo" is undefined', line=n) for n in (3, 9, 12, 40)], "catastrophic"),  # one first error, lines differ
        ([cerr('identifier "foo" is undefined'), cerr('expected a ";"'), wrong(), wrong()], "useful"),
        ([cerr('identifier "foo" is undefined')] * 3 + [ok()], "useful"),  # one success is enough to learn from
        ([wrong(), wrong(), cerr("x"), cerr("x")], "useful"),  # two different failure classes
        ([ProbeSample("t", found_code=False)] * 4, "catastrophic"),  # never wrote code
        ([ProbeSample("t", compiled=False, compile_timed_out=True)] * 2, "catastrophic"),
        ([ProbeSample("t", compiled=True, measured=True, correct=None)] * 4, "catastrophic"),  # all crashed at run time
    ],
)
def test_classify_probe_measured(samples, expected):
    assert classify_probe(samples) == expected


def test_thresholds_move_the_simple_boundary():
    samples = [ok(speedup=1.2), ok(speedup=1.3), ok(speedup=0.9), wrong()]
    assert classify_probe(samples) == "useful"
    assert classify_probe(samples, p_hi=0.75) == "simple"  # 3/4 correct, median 1.2x
    assert classify_probe(samples, p_hi=0.75, s_hi=1.25) == "useful"
    with pytest.raises(ValueError):
        classify_probe([])
    with pytest.raises(ValueError):
        classify_probe(samples, p_hi=0.0)


# ---- classification without a GPU (compile outcomes only) ---------------------------------------------


@pytest.mark.parametrize(
    ("samples", "expected", "says"),
    [
        ([built(), built(), built(), built()], "simple", "compile-only"),
        ([built(), cerr("x"), built(), cerr("y")], "useful", "compile-only"),
        ([cerr('expected a ";"', line=n) for n in (4, 5, 6, 7)], "catastrophic", "same way"),
        ([cerr('expected a ";"'), cerr('identifier "n" is undefined'), cerr('expected a ";"'), cerr("x")], "useful", "compile-only"),
    ],
)
def test_classify_probe_compile_only(samples, expected, says):
    cls, reason = explain_probe(samples)
    assert cls == expected and says in reason


# ---- prune: fraction and budget -----------------------------------------------------------------------


def table() -> dict[str, list[ProbeSample]]:
    return {
        "easy": [ok("easy")] * 4,
        "wall": [cerr("no instance of overloaded function", task="wall")] * 4,
        "mixed": [ok("mixed"), wrong("mixed"), cerr("x", task="mixed"), ok("mixed")],
        "slow": [ok("slow", speedup=0.3)] * 4,
        "half": [ok("half")] * 2,  # G may differ per task
    }


def test_prune_keeps_useful_tasks_and_counts_the_budget():
    with capture_logs() as logs:
        report = prune(table(), max_turns=4)
    assert report.kept == ["mixed", "slow"]
    assert {t: c for t, (c, _) in report.pruned.items()} == {"easy": "simple", "wall": "catastrophic", "half": "simple"}
    assert report.fraction_pruned == pytest.approx(3 / 5)
    # unpruned expansion: G * (T - 1) per task = 4*3 * 4 + 2*3; saved: easy, wall (4*3 each) and half (2*3)
    assert report.compile_calls_unpruned == 4 * 12 + 6
    assert report.compile_calls_saved == 12 + 12 + 6
    assert report.counts == {"simple": 2, "catastrophic": 1, "useful": 2}
    assert not report.compile_only
    [event] = [e for e in logs if e["event"] == "leap.dcp"]
    assert event["fraction_pruned"] == pytest.approx(0.6) and event["compile_calls_saved"] == 30
    assert prune(table(), max_turns=1).compile_calls_saved == 0  # no expansion turns, nothing to save


def test_prune_reports_compile_only_mode():
    report = prune({"a": [built("a")] * 4, "b": [built("b"), cerr("x", task="b")]}, max_turns=3)
    assert report.compile_only and report.kept == ["b"] and report.compile_calls_saved == 8
    assert "compile-only" in report.format()


# ---- the recorded-probe CLI -----------------------------------------------------------------------------


def write_probe(path: Path) -> None:
    rows = [{"meta": {"how": "hand-written test table"}}]
    for i in range(4):
        rows.append({"task": "level1/relu", "turn": 0, "sample": i, "found_code": True, "compiled": True, "measured": False, "correct": None})
        rows.append({"task": "level2/softmax", "turn": 0, "sample": i, "compiled": False, "first_error": f'line {i + 3}: error: expected a ";"'})
        err = None if i % 2 == 0 else "line 9: error: x"
        rows.append({"task": "level3/matmul", "turn": 0, "sample": i, "compiled": i % 2 == 0, "first_error": err})
    rows.append({"task": "level3/matmul", "turn": 1, "sample": 0, "compiled": True})  # later turns are not probe samples
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_load_probe_groups_turn_zero_rows(tmp_path):
    p = tmp_path / "probe.jsonl"
    write_probe(p)
    probes = load_probe(p)
    assert list(probes) == ["level1/relu", "level2/softmax", "level3/matmul"]
    assert all(len(v) == 4 for v in probes.values())
    (tmp_path / "bad.jsonl").write_text('{"compiled": true}\n')
    with pytest.raises(ValueError, match="needs a 'task'"):
        load_probe(tmp_path / "bad.jsonl")


def test_cli_prints_the_report(tmp_path):
    p = tmp_path / "probe.jsonl"
    write_probe(p)
    run = subprocess.run([sys.executable, "-m", "learner.leap", "--probe", str(p), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["kept"] == ["level3/matmul"] and out["fraction_pruned"] == pytest.approx(2 / 3)
    assert out["compile_calls_saved"] == 2 * 4 * 3 and out["compile_only"] is True
    text = subprocess.run([sys.executable, "-m", "learner.leap", "--probe", str(p)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "pruned: 2/3" in text.stdout and "catastrophic" in text.stdout
    nope = str(tmp_path / "nope.jsonl")
    missing = subprocess.run([sys.executable, "-m", "learner.leap", "--probe", nope], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "error" in missing.stderr


# ---- rank rewards for kernel groups ---------------------------------------------------------------------


def test_rank_rewards_on_a_kernel_group():
    # group of 5: two correct (2.0x beats 1.2x), two incorrect (a tie: brevity of a failure earns nothing), one unmeasured (excluded)
    eps = [
        KernelEpisode("relu", "a", correct=True, speedup=2.0, n_tokens=300),
        KernelEpisode("relu", "b", correct=True, speedup=1.2, n_tokens=100),
        KernelEpisode("relu", "c", correct=False, n_tokens=200),
        KernelEpisode("relu", "d", correct=False, n_tokens=400),
        KernelEpisode("relu", "e", correct=None, n_tokens=50),
    ]
    adv = kernel_rank_advantages(eps)
    # wins among the 4 measured: a 3, b 2, c 0.5, d 0.5 -> r = wins / 3, A = r - 0.5
    assert adv == pytest.approx([0.5, 1 / 6, -1 / 3, -1 / 3, 0.0])
    assert adv.stats.n_excluded == 1
    samples = kernel_rank_samples(eps)
    assert [s.score for s in samples] == [2.0, 1.2, None, None, None]
    assert samples[0].trajectory_reward == pytest.approx(2.3) and samples[2].trajectory_reward == 0.0
    assert samples[4].trajectory_reward is None


def test_rank_rewards_tie_on_speed_falls_back_to_tokens_and_margin_applies():
    eps = [KernelEpisode("g", "x", True, 1.00, 500), KernelEpisode("g", "y", True, 1.04, 100)]
    assert kernel_rank_advantages(eps) == pytest.approx([-0.5, 0.5])  # y is faster
    eps = [KernelEpisode("g", "x", True, 1.04, 100), KernelEpisode("g", "y", True, 1.00, 500)]
    assert kernel_rank_advantages(eps, margin=0.05) == pytest.approx([0.5, -0.5])  # within 5%: the shorter one wins
    same = [KernelEpisode("g", str(i), True, 1.5, 100) for i in range(4)]
    assert kernel_rank_advantages(same) == [0.0] * 4  # full tie: no signal


def test_rank_multi_turn_uses_the_last_turn_and_summed_tokens():
    eps = [
        KernelEpisode("g", "p", correct=False, n_tokens=100, turn=0),
        KernelEpisode("g", "p", correct=True, speedup=1.5, n_tokens=100, turn=1),  # fixed on turn 1: 200 tokens in all
        KernelEpisode("g", "q", correct=True, speedup=1.5, n_tokens=150, turn=0),
    ]
    adv = compute_advantages("rank", kernel_rank_samples(eps))
    assert adv == pytest.approx([-0.5, -0.5, 0.5])  # same speed; q used fewer tokens over its trajectory
    assert kernel_rank_samples(eps)[0].trajectory_reward == pytest.approx(1.8)  # the trajectory's last turn


def _live(tid: str, turn: int, meta: dict) -> Sample:
    # one recorded turn (one trained token) of trajectory ``tid`` in group "g"; ``meta`` is the trajectory's meta
    return Sample(
        f"{tid}{turn}", tid, "g", turn, [1], [2], [-1.0], [1], None, 0, reward=None, trajectory_reward=1.0, temperature=1.0, created_at=0.0, meta=meta
    )


def test_rank_per_turn_ranks_each_turn_by_its_own_result():
    # issue 39: per="turn" used to rank every turn by its trajectory's final outcome (meta correct / score), copied
    # onto each turn by Sample.to_turn_sample. The final outcomes are a (correct, 2.0), b (correct, 1.0), c (incorrect);
    # the runs' own per-turn results (meta turn_correct / turn_scores, one entry per turn index) differ from them:
    #   turn 0: a0 incorrect, b0 correct 1.5, c0 correct 3.0   turn 1: a1 correct 2.0, b1 correct 1.0, c1 incorrect
    # round robin on turn 0: c0 beats b0 (faster) and a0 (correct) -> 2, b0 beats a0 -> 1, a0 -> 0; r = wins / 2
    # = [0, 1/2, 1] -> A = r - 1/2 = [-1/2, 0, 1/2]. Turn 1: a1 2 wins, b1 1, c1 0 -> [1/2, 0, -1/2].
    # (Ranked by the final outcome both turns would be a +1/2, b 0, c -1/2: [0.5, 0.5, 0, 0, -0.5, -0.5].)
    meta = {
        "a": {"correct": True, "score": 2.0, "turn_correct": [False, True], "turn_scores": [None, 2.0]},
        "b": {"correct": True, "score": 1.0, "turn_correct": [True, True], "turn_scores": [1.5, 1.0]},
        "c": {"correct": False, "score": 0.0, "turn_correct": [True, False], "turn_scores": [3.0, None]},
    }
    ts = [_live(t, k, meta[t]).to_turn_sample() for t in "abc" for k in (0, 1)]
    out = compute_advantages("rank", ts, per="turn")
    assert list(out) == pytest.approx([-0.5, 0.5, 0.0, 0.0, 0.5, -0.5])
    assert out.n_excluded == 0
    # per trajectory nothing changes: the final outcomes a > b (faster) > c (incorrect), every turn gets its run's
    assert list(compute_advantages("rank", ts)) == pytest.approx([0.5, 0.5, 0.0, 0.0, -0.5, -0.5])


def test_rank_per_turn_excludes_turns_without_their_own_result():
    # no per-turn results recorded: a turn is not given its trajectory's final outcome, it is left out (advantage 0);
    # b's turn 1 has its own result, but alone at its turn index it has nobody to play -> 0 as well
    meta = {
        "a": {"correct": True, "score": 2.0},
        "b": {"correct": True, "score": 1.0, "turn_correct": [None, True], "turn_scores": [None, 1.0]},
        "c": {"correct": False, "score": 0.0},
    }
    ts = [_live(t, k, meta[t]).to_turn_sample() for t in "abc" for k in (0, 1)]
    out = compute_advantages("rank", ts, per="turn")
    assert list(out) == [0.0] * 6
    assert out.n_excluded == 5
    assert list(compute_advantages("rank", ts)) == pytest.approx([0.5, 0.5, 0.0, 0.0, -0.5, -0.5])
