"""Kernel tasks through the CUDA tools: a GPU table (compile, correct, speedup) or compile latency on this machine.

    .venv/bin/python bench/kernels.py --gpu-table                  # on a GPU host: every task's known-good solution
    .venv/bin/python bench/kernels.py --compile-latency --sample 3 # CPU is fine: nvcc with torch's headers, per task
    .venv/bin/python bench/kernels.py --gpu-table --fixtures tests/tools/cuda_fixtures   # other tasks: X.py + X.cu

``--gpu-table`` runs ``cuda_check`` for every task in parallel (``--jobs``; this builds each extension once,
into the tools' build cache), then ``cuda_bench`` one task at a time (the build is reused, and timings are
not disturbed by other kernels), and prints one row per task and the summary: compile rate, correct rate,
geometric-mean speedup over the correct tasks, ``fast_1.0``/``fast_1.2`` (the share of all tasks that are
correct and faster than 1.0×/1.2× eager PyTorch, as in KernelBench). ``--budget-s`` stops starting new
work when the time is spent (those rows say so). Without a CUDA device it says so and exits 2.

``--compile-latency`` runs ``cuda_compile`` (nvcc ``-c`` for sm_90 with torch's extension headers, what
the agent's compile tool does) once per task, one at a time, and prints each latency and the median,
min and max. A full run of 31 tasks takes long on a 2-core machine; ``--sample N`` picks N tasks spread
over the levels. Results also go to ``bench/results/kernels_<mode>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.cuda import cuda_bench, cuda_check, cuda_compile, cuda_device_available  # noqa: E402

RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Task:
    name: str
    level: int
    module: str  # dotted path or .py file
    solution: str


def load_tasks(fixtures: str | None, level: int | None, only: str | None) -> list[Task]:
    if fixtures:
        folder = Path(fixtures)
        tasks = [
            Task(py.stem, 0, str(py.resolve()), py.with_suffix(".cu").read_text())
            for py in sorted(folder.glob("*.py"))
            if py.with_suffix(".cu").is_file()
        ]
    else:
        from agents.tasks.kernels import kernel_tasks

        tasks = [Task(t.name, t.level, t.module, t.solution) for t in kernel_tasks(level)]
    if only:
        wanted = {w.strip() for w in only.split(",") if w.strip()}
        tasks = [t for t in tasks if t.name in wanted or t.name.split("/")[-1] in wanted]
    if not tasks:
        raise SystemExit("no kernel tasks selected")
    return tasks


def spread_sample(tasks: list[Task], n: int) -> list[Task]:
    """``n`` tasks spread over the levels (round-robin over the levels, evenly spaced inside each level)."""
    if n >= len(tasks):
        return tasks
    levels = sorted({t.level for t in tasks})
    quota = {lv: n // len(levels) + (i < n % len(levels)) for i, lv in enumerate(levels)}
    out = []
    for lv in levels:
        group = [t for t in tasks if t.level == lv]
        k = min(quota[lv], len(group))
        out += [group[int((i + 0.5) * len(group) / k)] for i in range(k)] if k else []
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The table's summary over all tasks (rows with ``compiled``, ``correct``, ``speedup``)."""
    n = len(rows)
    correct_speedups = [r["speedup"] for r in rows if r.get("correct") and r.get("speedup")]
    return {
        "tasks": n,
        "compile_rate": sum(bool(r.get("compiled")) for r in rows) / n,
        "correct_rate": sum(bool(r.get("correct")) for r in rows) / n,
        "geomean_speedup": math.exp(statistics.fmean(math.log(s) for s in correct_speedups)) if correct_speedups else None,
        "fast_1.0": sum(1 for s in correct_speedups if s > 1.0) / n,
        "fast_1.2": sum(1 for s in correct_speedups if s > 1.2) / n,
        "timed": len(correct_speedups),
    }


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def gpu_table(tasks: list[Task], jobs: int, budget_s: float, timeout_s: float) -> dict[str, Any]:
    available, detail = cuda_device_available()
    if not available:
        print(f"no CUDA device ({detail}): nothing measured; run this on a GPU host", file=sys.stderr)
        raise SystemExit(2)
    print(f"device: {detail}; {len(tasks)} tasks; checks with {jobs} jobs, then benches one at a time", flush=True)
    started = time.monotonic()

    def check(task: Task) -> dict[str, Any]:
        if time.monotonic() - started > budget_s:
            return {"task": task.name, "skipped": "time budget spent before the check"}
        r = cuda_check(task.solution, task.module, timeout_s=timeout_s)
        print(f"  checked {task.name}: {r.summary().splitlines()[0]} ({r.elapsed_s:.0f} s)", flush=True)
        return {
            "task": task.name,
            "compiled": r.compiled,
            "correct": r.correct,
            "max_abs_err": r.max_abs_err,
            "check_s": r.elapsed_s,
            "reason": r.reason,
        }

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        rows = list(pool.map(check, tasks))
    print(f"checks done in {time.monotonic() - started:.0f} s", flush=True)
    for task, row in zip(tasks, rows, strict=True):
        if not row.get("compiled"):
            continue
        if time.monotonic() - started > budget_s:
            row["skipped"] = "time budget spent before the bench"
            continue
        b = cuda_bench(task.solution, task.module, timeout_s=timeout_s)
        row.update(kernel_ms=b.kernel_ms, eager_ms=b.eager_ms, speedup=b.speedup, bench_s=b.elapsed_s)
        if b.correct is False:
            row["correct"] = False
    print(f"\n{'task':<28} {'compiled':>8} {'correct':>7} {'max_err':>9} {'kernel_ms':>10} {'eager_ms':>9} {'speedup':>8}")
    for row in rows:
        print(
            f"{row['task']:<28} {row.get('compiled', '-')!s:>8} {row.get('correct', '-')!s:>7} {_fmt(row.get('max_abs_err'), '.1e'):>9} "
            f"{_fmt(row.get('kernel_ms'), '.4f'):>10} {_fmt(row.get('eager_ms'), '.4f'):>9} {_fmt(row.get('speedup'), '.2f'):>8}"
            + (f"  [{row['skipped']}]" if row.get("skipped") else "")
            + (f"  [{row['reason'][:80]}]" if row.get("compiled") is not None and not row.get("correct") else "")
        )
    summary = summarize(rows)
    summary["wall_s"] = time.monotonic() - started
    print(
        f"\ncompile rate {summary['compile_rate']:.0%}  correct {summary['correct_rate']:.0%}  geomean speedup {_fmt(summary['geomean_speedup'], '.2f')}x"
        f"  fast_1.0 {summary['fast_1.0']:.0%}  fast_1.2 {summary['fast_1.2']:.0%}  ({summary['tasks']} tasks, {summary['wall_s']:.0f} s)"
    )
    return {"device": detail, "summary": summary, "rows": rows}


def compile_latency(tasks: list[Task], timeout_s: float) -> dict[str, Any]:
    rows = []
    for task in tasks:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = cuda_compile(task.solution, timeout_s=timeout_s)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the compiler's processes, reaped up the chain
        cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        rows.append(
            {
                "task": task.name,
                "ok": r.ok,
                "timed_out": r.timed_out,
                "elapsed_s": r.elapsed_s,
                "cpu_s": cpu_s,
                "errors": [d.format() for d in r.diagnostics if d.severity == "error"][:3],
            }
        )
        print(
            f"  {task.name:<28} {'ok' if r.ok else 'TIMED OUT' if r.timed_out else 'FAILED'}  {r.elapsed_s:7.1f} s wall, {cpu_s:7.1f} s CPU",
            flush=True,
        )
    times = [r["elapsed_s"] for r in rows if r["ok"]]
    summary: dict[str, Any] = {"tasks": len(rows), "ok": len(times), "load_average": os.getloadavg()}
    if times:
        cpu = [r["cpu_s"] for r in rows if r["ok"]]
        summary.update(median_s=statistics.median(times), min_s=min(times), max_s=max(times), median_cpu_s=statistics.median(cpu))
        print(
            f"\ncompile latency over {len(times)} tasks: median {summary['median_s']:.1f} s, min {summary['min_s']:.1f} s, max {summary['max_s']:.1f} s"
            f" (median CPU time {summary['median_cpu_s']:.1f} s; load average {summary['load_average'][0]:.1f} on {os.cpu_count()} CPUs)"
        )
    return {"summary": summary, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--gpu-table", action="store_true", help="check and bench every task's solution on the GPU")
    mode.add_argument("--compile-latency", action="store_true", help="nvcc compile latency per task (CPU is fine)")
    parser.add_argument("--fixtures", help="a folder of reference modules X.py with solutions X.cu, instead of agents.tasks.kernels")
    parser.add_argument("--level", type=int, help="only this level")
    parser.add_argument("--only", help="comma-separated task names (level1/relu or relu)")
    parser.add_argument("--sample", type=int, help="only N tasks spread over the levels")
    parser.add_argument("--jobs", type=int, default=8, help="parallel checks (each builds one extension; about 3 GB of RAM each)")
    parser.add_argument("--budget-s", type=float, default=330.0, help="start no new check or bench after this many seconds")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per compile/check/bench")
    args = parser.parse_args()
    tasks = load_tasks(args.fixtures, args.level, args.only)
    if args.sample:
        tasks = spread_sample(tasks, args.sample)
    if args.gpu_table:
        out, name = gpu_table(tasks, max(1, args.jobs), args.budget_s, args.timeout_s), "kernels_gpu.json"
    else:
        out, name = compile_latency(tasks, args.timeout_s), "kernels_compile.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / name).write_text(json.dumps(out, indent=2, default=str))
    print(f"written to {RESULTS / name}")


if __name__ == "__main__":
    main()
