"""How OpenMP's idle threads wait, for the served engine: spinning (libgomp's default) vs passive, side by side.

    .venv/bin/python bench/omp_wait.py                   # SmolLM2, alone and beside a torch co-runner
    .venv/bin/python bench/omp_wait.py --model tiny --rounds 1 --requests 4   # a quick smoke run

torch's CPU kernels run on libgomp's thread team. Between two parallel regions an idle thread spins
(``GOMP_SPINCOUNT``, 300,000 iterations by default) before it sleeps; ``OMP_WAIT_POLICY=PASSIVE`` makes
it sleep at once. Spinning saves a wake-up per region when the process has its cores to itself; when
another process wants the same cores (the learner ``serve.py`` starts, a second replica, anything) the
spinning threads burn the time slices the other process needed. ``serve.py`` picks the policy for
itself and the learner it starts; this measures the choice.

One ``serve.py --no-learner`` per variant (``--variants``: ``spin`` = libgomp's default, ``passive``,
``spincount=N``), all up together, each started with the variant's environment (``spin`` sets
``GOMP_SPINCOUNT=300000``, libgomp's own default, so that ``serve.py`` keeps its hands off the policy). Each round
runs, for every variant in rotating order: 1 client and ``--clients`` clients decoding ``--new-tokens``
each (temperature 0, ``ignore_eos``), first on the otherwise idle machine, then beside a co-runner: a
second torch process doing 256×256 matmuls on as many threads as the machine has cores (what the
learner's training step looks like to the OS), whose matmuls per second are reported too, since a
server that lets its neighbour work is half of the point. Decode tok/s are medians over rounds.

Results also go to bench/results/omp_wait.json. Not here: timed assertions (never in tests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.serving import OUT, Server, load, loopwise_url, prompts, run_load, start_process, stop_process  # noqa: E402

CO_RUNNER = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(256, 256)
n, t0 = 0, time.perf_counter()
while True:
    a = torch.tanh(a @ a)
    n += 1
    if n % 200 == 0:
        print(f"{n} {time.perf_counter() - t0:.4f}", flush=True)
"""


def libgomp_defaults() -> dict[str, str]:
    """This process's environment without the two variables that set how libgomp's idle threads wait."""
    return {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


def variant_env(name: str) -> dict[str, str]:
    env = libgomp_defaults()
    if name == "spin":
        env["GOMP_SPINCOUNT"] = "300000"  # libgomp's own default, said explicitly so serve.py leaves the policy alone
    elif name == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif name.startswith("spincount="):
        env["GOMP_SPINCOUNT"] = name.split("=", 1)[1]
    else:
        raise SystemExit(f"unknown variant {name!r}: spin, passive or spincount=N")
    return env


def start(name: str, model_path: Path, data_dir: Path) -> Server:
    cmd = [sys.executable, str(ROOT / "serve.py"), "--model", str(model_path), "--served-model-name", "m", "--port", "0", "--no-learner"]
    cmd += ["--data-dir", str(data_dir), "--log-level", "warning", "--no-record"]
    proc, url = start_process(cmd, loopwise_url, OUT / f"omp_wait-{name.replace('=', '')}.log", env=variant_env(name))
    return Server(name, url, "m", proc, ignore_eos=True)


class CoRunner:
    """A torch matmul loop in its own process; ``rate()`` is its matmuls per second since the last call."""

    def __init__(self, threads: int) -> None:
        cmd = [sys.executable, "-c", CO_RUNNER, str(threads)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=libgomp_defaults())
        assert self.proc.stdout is not None
        self._out = self.proc.stdout
        self._last = self._parse(self._out.readline())

    @staticmethod
    def _parse(line: str) -> tuple[int, float]:
        n, t = line.split()
        return int(n), float(t)

    def rate(self) -> float:
        # drain what it printed while we measured: the newest line is the one that counts (else wait for one)
        os.set_blocking(self._out.fileno(), False)
        lines = self._out.readlines()
        os.set_blocking(self._out.fileno(), True)
        n, t = self._parse(lines[-1] if lines else self._out.readline())
        r = (n - self._last[0]) / max(1e-9, t - self._last[1])
        self._last = (n, t)
        return r

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


async def phase(server: Server, clients: int, requests: int, new_tokens: int) -> float:
    return (await run_load(server, prompts(requests), clients, new_tokens))["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--variants", default="spin,passive", help="comma list of spin, passive, spincount=N")
    ap.add_argument("--clients", type=int, default=16, help="the batched phase's concurrent clients (default 16)")
    ap.add_argument("--requests", type=int, default=32, help="requests of the batched phase (the 1-client phase: a quarter)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data-dir", default=str(ROOT / ".data"))
    args = ap.parse_args()

    from runtime.model_store import resolve_model

    model_path = resolve_model(args.model, Path(args.data_dir) / "models")
    OUT.mkdir(parents=True, exist_ok=True)
    names = [v for v in args.variants.split(",") if v]
    cores = os.cpu_count() or 1
    print(f"model {model_path.name}, {cores} cores, variants {names}, load {load()}", flush=True)
    servers: list[Server] = []
    tmp = Path(tempfile.mkdtemp(prefix="loopwise-bench-omp-"))
    results: dict = {
        n: {"alone_1": [], f"alone_{args.clients}": [], "shared_1": [], f"shared_{args.clients}": [], "co_runner_mm_s": []} for n in names
    }
    co_alone: list[float] = []
    try:
        for i, n in enumerate(names):
            servers.append(start(n, model_path, tmp / f"d{i}"))
        for s in servers:  # warm-up: first requests pay one-off costs
            asyncio.run(phase(s, 2, 2, 8))
        for r in range(args.rounds):
            order = servers[r % len(servers) :] + servers[: r % len(servers)]
            for s in order:
                results[s.name]["alone_1"].append(asyncio.run(phase(s, 1, max(1, args.requests // 4), args.new_tokens)))
                results[s.name][f"alone_{args.clients}"].append(asyncio.run(phase(s, args.clients, args.requests, args.new_tokens)))
            co = CoRunner(cores)
            try:
                time.sleep(2)
                co.rate()
                time.sleep(5)
                co_alone.append(co.rate())
                for s in order:
                    co.rate()
                    results[s.name]["shared_1"].append(asyncio.run(phase(s, 1, max(1, args.requests // 4), args.new_tokens)))
                    results[s.name][f"shared_{args.clients}"].append(asyncio.run(phase(s, args.clients, args.requests, args.new_tokens)))
                    results[s.name]["co_runner_mm_s"].append(co.rate())
            finally:
                co.stop()
            print(f"round {r + 1}/{args.rounds} done, load {load()}", flush=True)
    finally:
        for s in servers:
            stop_process(s.proc)
    summary = {n: {k: round(statistics.median(v), 1) for k, v in m.items()} for n, m in results.items()}
    out = {"model": model_path.name, "cores": cores, "new_tokens": args.new_tokens, "rounds": args.rounds, "runs": results}
    out["median"] = summary
    out["co_runner_alone_mm_s"] = round(statistics.median(co_alone), 1)
    (OUT / "omp_wait.json").write_text(json.dumps(out, indent=2))
    base = names[0]
    print(f"\nco-runner alone: {out['co_runner_alone_mm_s']} matmuls/s")
    cols = list(next(iter(summary.values())).keys())
    print("variant".ljust(18) + "".join(c.rjust(16) for c in cols))
    for n in names:
        print(n.ljust(18) + "".join(f"{summary[n][c]:>16}" for c in cols))
    for n in names[1:]:
        ratios = "  ".join(f"{c} {summary[n][c] / max(1e-9, summary[base][c]):.2f}x" for c in cols)
        print(f"{n} / {base}: {ratios}")


if __name__ == "__main__":
    main()
