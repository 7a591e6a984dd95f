"""Tool-call overhead, side by side in one run: calculator through the registry vs a direct call, and
sandbox start time vs plain interpreter starts.

    .venv/bin/python bench/tools.py                  # 2,000 calculator calls, 60 sandbox starts
    .venv/bin/python bench/tools.py --starts 200     # tighter sandbox percentiles

1. Calculator round trip: ``await registry.call("calculator", '{"expression": ...}')`` (JSON parse,
   schema validation, pydantic conversion, the worker-thread hop of a sync tool, result rendering) vs
   calling ``calculator(expression)`` directly; median and p95 in µs, and their ratio.
2. Sandbox start: ``Sandbox().run_python("print(1)")`` from call to result (fresh folder, the confinement
   exec chain, namespaces, rlimits, interpreter start, output capture, folder removal) vs
   ``subprocess.run([sys.executable, "-c", "print(1)"])`` and vs the sandbox's own interpreter started
   bare (``python -I -S -B -c print(1)``, the floor for the sandbox). The three alternate call by call so
   machine load hits them alike. Target: sandbox median ≤ 50 ms.

Results also go to bench/results/tools.json. Not here: timed assertions (never in tests), GPU tools.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools import Sandbox, ToolRegistry  # noqa: E402
from tools.calculator import calculator  # noqa: E402

TARGET_MS = 50.0
EXPRESSION = "(12345 * 6789 + 1/3) ** 2 - 0.1"


def _stats(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def bench_calculator(n: int) -> dict[str, float]:
    registry = ToolRegistry()
    registry.register(calculator)
    arguments = json.dumps({"expression": EXPRESSION})
    assert calculator(EXPRESSION).content == asyncio.run(registry.call("calculator", arguments)).content

    async def through_registry() -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            await registry.call("calculator", arguments)
            out.append((time.perf_counter() - t) * 1e6)
        return out

    direct = []
    for _ in range(n):
        t = time.perf_counter()
        calculator(EXPRESSION)
        direct.append((time.perf_counter() - t) * 1e6)
    via = asyncio.run(through_registry())
    (d_med, d_p95), (r_med, r_p95) = _stats(direct), _stats(via)
    return {"direct_median_us": d_med, "direct_p95_us": d_p95, "registry_median_us": r_med, "registry_p95_us": r_p95}


def bench_sandbox(n: int) -> dict[str, float | str]:
    sandbox = Sandbox()
    bare = [sandbox.isolation.python, "-I", "-S", "-B", "-c", "print(1)"]
    plain = [sys.executable, "-c", "print(1)"]
    for _ in range(3):  # warm caches
        sandbox.run_python("print(1)")
        subprocess.run(plain, capture_output=True, check=True)
    samples: dict[str, list[float]] = {"sandbox": [], "plain": [], "bare": []}
    for _ in range(n):
        t = time.perf_counter()
        result = sandbox.run_python("print(1)")
        samples["sandbox"].append((time.perf_counter() - t) * 1e3)
        assert result.ok and result.stdout == "1\n", result
        for name, argv in (("plain", plain), ("bare", bare)):
            t = time.perf_counter()
            subprocess.run(argv, capture_output=True, check=True)
            samples[name].append((time.perf_counter() - t) * 1e3)
    out: dict[str, float | str] = {"interpreter": sandbox.isolation.python, "network": sandbox.isolation.network}
    for name, values in samples.items():
        med, p95 = _stats(values)
        out[f"{name}_median_ms"], out[f"{name}_p95_ms"] = med, p95
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="calculator calls per variant")
    ap.add_argument("--starts", type=int, default=60, help="sandbox starts (each alternating with two baselines)")
    args = ap.parse_args()

    calc = bench_calculator(args.calls)
    print(f"calculator {EXPRESSION!r}, {args.calls} calls each")
    print(f"  direct call      median {calc['direct_median_us']:8.1f} µs   p95 {calc['direct_p95_us']:8.1f} µs")
    print(f"  registry.call    median {calc['registry_median_us']:8.1f} µs   p95 {calc['registry_p95_us']:8.1f} µs")
    print(f"  ratio registry/direct: median {calc['registry_median_us'] / calc['direct_median_us']:.1f}x")

    sbx = bench_sandbox(args.starts)
    s_med = float(sbx["sandbox_median_ms"])
    print(f"sandbox start, print(1), {args.starts} runs each, alternating (sandbox interpreter {sbx['interpreter']}, {sbx['network']})")
    print(f"  sandbox run_python          median {s_med:6.1f} ms   p95 {float(sbx['sandbox_p95_ms']):6.1f} ms")
    print(f"  subprocess.run(python -c)   median {float(sbx['plain_median_ms']):6.1f} ms   p95 {float(sbx['plain_p95_ms']):6.1f} ms")
    print(f"  bare python -I -S -B -c     median {float(sbx['bare_median_ms']):6.1f} ms   p95 {float(sbx['bare_p95_ms']):6.1f} ms")
    print(
        f"  ratio sandbox/plain {s_med / float(sbx['plain_median_ms']):.2f}   sandbox/bare {s_med / float(sbx['bare_median_ms']):.2f}   "
        f"vs target {TARGET_MS:.0f} ms: {'OK' if s_med <= TARGET_MS else 'ABOVE TARGET'}"
    )
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "tools.json").write_text(json.dumps({"calculator": calc, "sandbox": sbx, "target_ms": TARGET_MS}, indent=2))


if __name__ == "__main__":
    main()
