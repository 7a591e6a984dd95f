"""Record a LEAP probe: G first-turn kernel candidates per task, compiled for real, one JSON line per candidate.

    python bench/leap_probe.py --out bench/data/leap_probe.jsonl [--g 4] [--seed 0]
    python -m learner.leap --probe bench/data/leap_probe.jsonl          # DCP's report on it

How the candidates are made. The tiny test model writes no compilable CUDA, so candidates are seeded
mutations of each task's known-good solution, drawn independently per sample with a level-dependent error
rate (level 1: 0.25, level 2: 0.45, level 3: 0.65) and a per-task "favourite mistake" (an error sample uses
it with probability 0.7, else another mistake), which is how a policy's systematic errors look:

* ``ok``: the solution, with a one-line comment naming the sample (a distinct source);
* ``logic_bug``: the first ``blockIdx.x`` read as ``blockIdx.y`` (compiles; wrong on a GPU);
* ``undeclared``: the launched kernel's name misspelt (``foo_kernal<<<...>>>``: an undefined identifier);
* ``type_mismatch``: the launch's first ``.data_ptr<float>()`` dropped (a Tensor passed as a pointer);
* ``include_typo``: ``#include <torch/extention.h>`` (a missing header).

How they are compiled (all with ``tools.cuda.cuda_compile``, on this machine). A torch-extension compile
costs minutes here (``<torch/extension.h>`` dominates), so instead of one compile per candidate:
``include_typo`` candidates are compiled one by one (nvcc stops while preprocessing, in seconds); the
candidates expected to compile (``ok``, ``logic_bug``) go into one translation unit, each in its own
namespace (``agents.tasks.kernels.emulate.bundle``), compiled in full (device and host code); the front-end
error candidates (``undeclared``, ``type_mismatch``) into another, whose diagnostics are mapped back to
each candidate by line range (errors of these two kinds stay local to their function). A candidate's
``compile_s`` is its own compile time, or its bundle's time divided by the bundle's size (``compile_s_amortized``).

Without a GPU nothing is run: every row has ``measured: false`` and ``correct: null``, so DCP decides from
compile outcomes only. ``n_tokens`` counts the candidate's characters / 4 (a rough token estimate).

Not here: sampling a real policy, GPU checks (run the same candidates through ``cuda_check`` on a GPU
machine to get measured rows), or the DCP rule itself (``learner.leap``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agents.tasks.kernels import KernelTaskSpec, kernel_tasks  # noqa: E402
from agents.tasks.kernels.emulate import bundle  # noqa: E402

ERROR_RATE = {1: 0.25, 2: 0.45, 3: 0.65}
MISTAKES = ("undeclared", "type_mismatch", "include_typo")
_LAUNCH_RE = re.compile(r"(\w+)_kernel(\s*<<<)")
_LAUNCH_ARGS_RE = re.compile(r"(>>>\s*\()([^;]*?)(\w+)\.data_ptr<float>\(\)")


def mutate(source: str, kind: str, tag: str) -> str:
    """The candidate of ``kind`` made from a known-good ``source``; raises if the mutation does not apply."""
    if kind == "ok":
        out = f"// candidate {tag}\n{source}"
    elif kind == "logic_bug":
        out = source.replace("blockIdx.x", "blockIdx.y", 1)
    elif kind == "undeclared":
        out = _LAUNCH_RE.sub(r"\1_kernal\2", source, count=1)
    elif kind == "type_mismatch":
        out = _LAUNCH_ARGS_RE.sub(r"\1\2\3", source, count=1)
    elif kind == "include_typo":
        out = source.replace("#include <torch/extension.h>", "#include <torch/extention.h>")
    else:
        raise ValueError(f"unknown mutation {kind!r}")
    if out == source:
        raise ValueError(f"mutation {kind!r} did not apply")
    return out


def draw(specs: list[KernelTaskSpec], g: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for spec in specs:
        favourite = rng.choice(MISTAKES)
        for i in range(g):
            if rng.random() < ERROR_RATE[spec.level]:
                kind = favourite if rng.random() < 0.7 else rng.choice([m for m in MISTAKES if m != favourite])
            else:
                kind = "logic_bug" if rng.random() < 0.25 else "ok"
            src = mutate(spec.solution, kind, f"{spec.name}#{i}")
            rows.append({"task": spec.name, "turn": 0, "sample": i, "candidate": kind, "source": src})
    return rows


def _first_error(diags: list, lo: int | None = None, hi: int | None = None) -> tuple[str | None, int]:
    errs = [d for d in diags if d.severity == "error" and (lo is None or (d.line is not None and lo <= d.line <= hi))]
    if not errs:
        return None, 0
    d = errs[0]
    # the candidate's own line: its chunk starts with a comment line and the namespace line
    line = d.line - (lo + 1) if lo is not None and d.line is not None else d.line
    return f"line {line}: error: {d.message}", len(errs)


def compile_rows(rows: list[dict], timeout_s: float) -> dict:
    from tools.cuda import cuda_compile

    stats: dict = {"bundles": {}}
    for row in rows:
        row["ident"] = f"c_{row['task'].replace('/', '_')}_{row['sample']}"
    single = [r for r in rows if r["candidate"] == "include_typo"]
    for r in single:
        res = cuda_compile(r["source"], timeout_s=timeout_s)
        first, n = _first_error(res.diagnostics)
        r.update(compiled=res.ok, compile_timed_out=res.timed_out, first_error=first, n_errors=n, compile_s=round(res.elapsed_s, 2))
        print(f"{r['task']:34s} #{r['sample']} include_typo: {'ok' if res.ok else first} ({res.elapsed_s:.1f} s)", file=sys.stderr)
    for name, kinds in (("clean", ("ok", "logic_bug")), ("frontend_errors", ("undeclared", "type_mismatch"))):
        part = [r for r in rows if r["candidate"] in kinds]
        if not part:
            continue
        text, ranges = bundle([(r["ident"], r["source"]) for r in part], emulate_cuda=False)
        t0 = time.perf_counter()
        res = cuda_compile(text, timeout_s=timeout_s)
        wall = time.perf_counter() - t0
        stats["bundles"][name] = {"candidates": len(part), "ok": res.ok, "elapsed_s": round(res.elapsed_s, 1), "timed_out": res.timed_out}
        print(f"bundle {name}: {len(part)} candidates, ok={res.ok}, {wall:.0f} s", file=sys.stderr)
        unmapped = [d for d in res.diagnostics if d.severity == "error" and not any(lo <= (d.line or -1) <= hi for lo, hi in ranges.values())]
        if res.timed_out or unmapped:
            raise RuntimeError(f"bundle {name} failed outside any candidate: {res.summary()[:2000]}")
        for r in part:
            lo, hi = ranges[r["ident"]]
            first, n = _first_error(res.diagnostics, lo, hi)
            r.update(compiled=n == 0, compile_timed_out=False, first_error=first, n_errors=n, compile_s=None)
            r["compile_s_amortized"] = round(res.elapsed_s / len(part), 2)
        if name == "clean" and not res.ok:
            print("warning: a candidate expected to compile did not", file=sys.stderr)
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench/data/leap_probe.jsonl")
    p.add_argument("--g", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--level", type=int, default=None)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    args = p.parse_args(argv)
    specs = kernel_tasks(args.level)
    rows = draw(specs, args.g, args.seed)
    t0 = time.perf_counter()
    stats = compile_rows(rows, args.timeout_s)
    meta = {
        "how": "seeded mutations of the known-good solutions (see bench/leap_probe.py); compiled with tools.cuda.cuda_compile on a "
        "2-core CPU machine without a GPU: include typos one by one, the rest in two bundled translation units",
        "g": args.g,
        "seed": args.seed,
        "tasks": len(specs),
        "error_rate": ERROR_RATE,
        "measured": False,
        "wall_s": round(time.perf_counter() - t0, 1),
        **stats,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for r in rows:
            out = {k: v for k, v in r.items() if k not in ("source", "ident")}
            out.update(found_code=True, measured=False, correct=None, speedup=None, n_tokens=len(r["source"]) // 4)
            f.write(json.dumps(out) + "\n")
    print(f"wrote {len(rows)} candidates for {len(specs)} tasks to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
