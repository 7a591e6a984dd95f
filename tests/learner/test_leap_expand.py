"""LEAP expansion: probe-run -> ProbeSample conversion (hand-written runs and the kernel Env's real reports over a fake
toolset), problem parsing, and probe -> prune -> (no) expansion against a real tiny-model server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from learner.leap_dcp import ProbeClass, classify_probe, explain_probe, load_probe
from learner.leap_expand import ProbeParseError, RunFailed, compile_calls, expand, parse_problems, probe_sample, problem_ref

ROOT = Path(__file__).resolve().parents[2]


def run_of(
    outcome: dict[str, Any] | None, *, correct: bool = False, tokens: int = 50, pid: str = "kernels/level1/relu", n_steps: int = 1
) -> dict[str, Any]:
    """A run answer as the runs endpoint gives it: each step's ``info`` is the kernel Env's structured report."""
    info = None if outcome is None else {"outcome": outcome, "correct": outcome.get("correct")}
    steps = [{"index": j, "text": "```cuda\n...\n```", "output_tokens": tokens, "info": info} for j in range(n_steps)]
    return {"run_id": "run-x", "problem_id": pid, "problem_index": 7, "task": "kernels", "correct": correct, "reward": 0.0, "steps": steps}


def compile_err(line: int) -> dict[str, Any]:
    return {"found_code": True, "compiled": False, "first_error": f'line {line}: error: identifier "blockDimx" is undefined', "n_errors": 2}


UNMEASURED = {"found_code": True, "compiled": True, "measured": False, "correct": None, "not_measured_reason": "no GPU"}
FAST = {"found_code": True, "compiled": True, "measured": True, "correct": True, "speedup": 2.03, "kernel_ms": 0.0123, "eager_ms": 0.025}
NO_CODE = {"found_code": False}


def test_hand_written_probe_runs_become_probe_samples():
    err = probe_sample(run_of(compile_err(12), tokens=77))
    assert err.task == "kernels/level1/relu" and err.found_code and not err.compiled and not err.measured and err.n_tokens == 77
    assert err.first_error == 'line 12: error: identifier "blockDimx" is undefined'
    assert err.failure_class == "compile_error"
    other_line = probe_sample(run_of(compile_err(19)))
    assert other_line.failure_key == err.failure_key  # "failed the same way": the line number does not count
    assert classify_probe([err, other_line]) is ProbeClass.CATASTROPHIC

    built = probe_sample(run_of(UNMEASURED))
    assert built.compiled and not built.measured and built.correct is None and built.failure_class == "unmeasured"
    cls, why = explain_probe([built, err])
    assert cls is ProbeClass.USEFUL and "compile-only" in why  # one compiled, one did not: worth refining

    fast = probe_sample(run_of(FAST, correct=True))
    assert fast.compiled and fast.measured and fast.correct is True and fast.speedup == pytest.approx(2.03) and fast.failure_class is None
    assert classify_probe([fast, fast]) is ProbeClass.SIMPLE

    fmt = probe_sample(run_of(NO_CODE))
    assert not fmt.found_code and fmt.failure_class == "format"

    assert [compile_calls(run_of(o)) for o in (compile_err(1), UNMEASURED, FAST, NO_CODE)] == [1, 1, 1, 0]
    assert compile_calls(run_of(compile_err(1), n_steps=3)) == 3


def test_runs_without_a_kernel_outcome_or_with_a_contradicting_one_raise():
    with pytest.raises(ProbeParseError, match="no kernel outcome"):
        probe_sample(run_of(None))  # a tool call, or another task's run
    with pytest.raises(ProbeParseError, match="no kernel outcome"):
        probe_sample(run_of({}))
    with pytest.raises(ProbeParseError, match="run says correct=False"):
        probe_sample(run_of(FAST, correct=False))  # the server's verdict disagrees with the outcome
    with pytest.raises(ProbeParseError, match="run says correct=True"):
        probe_sample(run_of(UNMEASURED, correct=True))
    with pytest.raises(ProbeParseError, match="no steps"):
        probe_sample({"run_id": "r", "steps": []})


def fake_toolset(*, compiled: bool, measured: bool = False, correct: bool | None = None, speedup: float | None = None, timed_out: bool = False):
    from agents.tasks.kernels.task import KernelToolset

    diag = SimpleNamespace(file="k.cu", line=9, column=3, severity="error", message='identifier "tid" is undefined')
    comp = SimpleNamespace(ok=compiled, timed_out=timed_out, elapsed_s=1.5, diagnostics=[] if compiled else [diag], log="")
    chk = SimpleNamespace(
        measured=measured, correct=correct, max_abs_err=2e-7 if correct else 0.5, reason="no GPU" if not measured else "illegal address"
    )
    bench = SimpleNamespace(measured=speedup is not None, speedup=speedup, kernel_ms=0.01, eager_ms=0.02 if speedup else None, reason=None)
    return KernelToolset(
        compile=lambda *a, **k: comp, check=lambda *a, **k: chk, bench=lambda *a, **k: bench, device=lambda: (measured, "" if measured else "no GPU")
    )


@pytest.mark.parametrize(
    ("tools", "expected"),
    [
        (dict(compiled=False), dict(compiled=False, failure_class="compile_error", first_error='line 9: error: identifier "tid" is undefined')),
        (dict(compiled=False, timed_out=True), dict(compiled=False, failure_class="compile_timeout")),
        (dict(compiled=True), dict(compiled=True, measured=False, failure_class="unmeasured")),
        (dict(compiled=True, measured=True, correct=None), dict(measured=True, failure_class="runtime_error")),
        (dict(compiled=True, measured=True, correct=False), dict(measured=True, correct=False, failure_class="incorrect")),
        (dict(compiled=True, measured=True, correct=True, speedup=2.5), dict(correct=True, speedup=2.5, failure_class=None)),
        (dict(compiled=True, measured=True, correct=True, speedup=None), dict(correct=True, speedup=None, failure_class=None)),
    ],
)
@pytest.mark.parametrize("env_turns", [1, 4])  # a terminal step and a non-terminal one
def test_the_kernel_envs_own_reports_become_probe_samples(tools, expected, env_turns):
    """The kernel Env's info, as the runs endpoint serves it (agents.loop.json_safe), gives the Env's own failure class."""
    from agents.loop import json_safe
    from agents.tasks.kernels.task import KernelTask

    task = KernelTask(level=1, max_turns=env_turns, toolset=fake_toolset(**tools))
    problem = task.problems(1)[0]
    env = task.make_env(problem)
    env.reset()
    step = env.step("```cuda\n#include <torch/extension.h>\n__global__ void k() {}\n```")
    run = run_of(None, correct=step.info["correct"] is True, pid=problem.id)
    run["steps"][0]["info"] = json_safe(step.info)
    sample = probe_sample(run)
    assert sample.task == problem.id
    assert {k: getattr(sample, k) for k in expected} == expected
    assert sample.failure_class == step.info["outcome"]["failure_class"]
    assert compile_calls(run) == 1


def test_parse_problems_and_their_run_reference():
    assert parse_problems("0-3") == [0, 1, 2, 3]
    assert parse_problems("5, 1-2,level1/relu") == [5, 1, 2, "level1/relu"]
    with pytest.raises(ValueError):
        parse_problems("4-2")
    with pytest.raises(ValueError):
        parse_problems(" , ")
    # a name goes to the server as a problem id (the runs endpoint resolves it); nothing here reads the task registry
    assert problem_ref(3) == {"problem_index": 3}
    assert problem_ref("level1/relu") == problem_ref("kernels/level1/relu") == {"problem_id": "kernels/level1/relu"}


def test_useful_problems_are_expanded_and_compile_calls_counted():
    """The driver's request protocol over a scripted server: probe with max_turns 1, expand only the useful problem
    with fresh sampling seeds and the agent's turn cap, and count compile calls from the observations."""
    import httpx

    probes = {0: [compile_err(3), UNMEASURED], 1: [NO_CODE] * 2}  # 0 useful, 1 catastrophic
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/agents/kernel-agent/runs" and request.headers["authorization"] == "Bearer k"
        body = json.loads(request.content)
        bodies.append(body)
        i, k = body["problem_index"], body["sample_seed"]
        if body["max_turns"] == 1:
            run = run_of(probes[i][k - 10], pid=f"kernels/p{i}")
        else:  # an episode: two compile errors, then a kernel that compiles (no GPU)
            run = run_of(compile_err(k), pid=f"kernels/p{i}", n_steps=3)
            run["steps"][-1]["info"] = {"outcome": UNMEASURED}
            run["turns"] = 3
        run["problem_index"] = i
        run["run_id"] = f"run-{i}-{k}-{body['max_turns']}"
        return httpx.Response(200, json=run)

    with capture_logs() as logs:
        report = expand("http://leap.test", "k", "kernel-agent", [0, 1], G=2, max_turns=4, sample_seed=10, transport=httpx.MockTransport(handler))
    probe_bodies = [b for b in bodies if b["max_turns"] == 1]
    episode_bodies = [b for b in bodies if b["max_turns"] != 1]
    assert sorted((b["problem_index"], b["sample_seed"]) for b in probe_bodies) == [(0, 10), (0, 11), (1, 10), (1, 11)]
    assert all(b["task"] == "kernels" and b["seed"] == 0 and "eval" not in b for b in bodies)  # recorded as ordinary, trainable runs
    assert sorted((b["problem_index"], b["sample_seed"], b["max_turns"]) for b in episode_bodies) == [(0, 12, 4), (0, 13, 4)]
    assert report.problems == {"kernels/p0": 0, "kernels/p1": 1}
    assert report.dcp.kept == ["kernels/p0"] and list(report.dcp.pruned) == ["kernels/p1"] and report.dcp.fraction_pruned == 0.5
    assert report.expanded == ["kernels/p0"] and [e["run_id"] for e in report.episodes["kernels/p0"]] == ["run-0-12-4", "run-0-13-4"]
    assert all(e["turns"] == 3 and e["compile_calls"] == 3 and e["correct"] is False for e in report.episodes["kernels/p0"])
    assert (report.compile_calls_probe, report.compile_calls_expansion, report.compile_calls_unpruned_bound) == (2, 6, 16)
    d = report.to_dict()
    assert (
        d["compile_calls"] == {"probe": 2, "expansion": 6, "spent": 8, "unpruned_bound": 16}
        and d["dcp"]["pruned"]["kernels/p1"]["class"] == "catastrophic"
    )
    assert "pruned 1/2 = 50.0%" in report.format() and "kernels/p0: wrong" in report.format()
    assert [e["fraction_pruned"] for e in logs if e["event"] == "leap.dcp"] == [0.5]

    def failing(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "problem_index: too big"}})

    with pytest.raises(RunFailed, match="failed with 400"):
        expand("http://leap.test", None, "kernel-agent", [0], G=1, max_turns=4, transport=httpx.MockTransport(failing))
    with pytest.raises(ValueError, match="given twice"):
        expand("http://leap.test", None, "kernel-agent", [0, 0], G=1, max_turns=4, transport=httpx.MockTransport(failing))


def test_tiny_model_probes_are_catastrophic_so_nothing_is_expanded(start_server, tmp_path):
    """The tiny model writes no code block: every probe sample is a format failure, so DCP prunes every problem."""
    server = start_server()
    with capture_logs() as logs:
        report = expand(server.base_url, None, "kernel-agent", [0, "level1/relu"], G=2, max_turns=4)
    assert len(report.problems) == 2 and report.problems[next(iter(report.problems))] == 0
    assert "kernels/level1/relu" in report.problems
    assert report.dcp.fraction_pruned == 1.0 and report.dcp.kept == [] and report.expanded == [] and report.episodes == {}
    assert {c for c, _ in report.dcp.pruned.values()} == {"catastrophic"}
    assert all("failed the same way: format" in why for _, why in report.dcp.pruned.values())
    assert [len(v) for v in report.probe_runs.values()] == [2, 2] and len({r for v in report.probe_runs.values() for r in v}) == 4
    assert report.compile_calls_spent == 0 and report.compile_calls_unpruned_bound == 2 * 2 * 4
    [dcp] = [e for e in logs if e["event"] == "leap.dcp"]
    assert dcp["fraction_pruned"] == 1.0 and dcp["catastrophic"] == 2
    assert any(e["event"] == "leap.expand" and e["expanded"] == 0 for e in logs)

    saved = tmp_path / "probe.jsonl"
    args = ["--expand", "--url", server.base_url, "--problems", "1", "--group", "2", "--json", "--save-probe", str(saved)]
    cli = subprocess.run([sys.executable, "-m", "learner.leap", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    out = json.loads(cli.stdout)
    assert out["n_probed"] == 1 and out["fraction_pruned"] == 1.0 and out["expanded"] == []
    assert out["compile_calls"] == {"probe": 0, "expansion": 0, "spent": 0, "unpruned_bound": 8}
    assert "leap.dcp" in cli.stderr  # the structlog event, on stderr
    [(pid, rows)] = load_probe(saved).items()
    assert pid in out["problems"] and len(rows) == 2 and all(r.failure_class == "format" for r in rows)

    args = ["--expand", "--url", server.base_url, "--agent", "no-such-agent", "--problems", "0", "--group", "1"]
    bad = subprocess.run([sys.executable, "-m", "learner.leap", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "failed with 404" in bad.stderr
