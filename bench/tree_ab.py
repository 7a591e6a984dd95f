"""The embedded server of this tree against the same server of a baseline tree, side by side: decode tokens/s under load.

    git worktree add /tmp/base <commit> && ln -s "$PWD/.venv" /tmp/base/.venv && ln -s "$PWD/.data" /tmp/base/.data
    .venv/bin/python bench/tree_ab.py --base /tmp/base [--clients 1,16,64] [--seconds 20] [--rounds 2] [--out results.json]

One server at a time (``serve.py --no-learner``, the default model, its defaults, a fresh data folder), base then this
tree, ``--rounds`` times, so a drift of the machine's load hits both alike. For each client count, N clients post chat
completions of ``--new-tokens`` tokens (``ignore_eos``, temperature 0.7: the sampled path) one after the other for
``--seconds``; tokens/s is the tokens of the completed requests over the time until the last one ended (with many
clients the count is coarse: whole requests). Prints the mean per tree and the ratio this / base, and the 1-minute
load average before each block. For one change to the engine; ``bench/serving.py`` compares engines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PORT = 8765


async def _load(url: str, model: str, clients: int, seconds: float, new_tokens: int) -> float:
    done: list[int] = []

    async def client(i: int, http: httpx.AsyncClient, stop: float) -> None:
        while time.monotonic() < stop:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"Tell me a story about number {i}."}],
                "max_tokens": new_tokens,
                "ignore_eos": True,
                "temperature": 0.7,
            }
            r = await http.post(url + "/v1/chat/completions", json=body)
            r.raise_for_status()
            done.append(r.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient(timeout=300) as http:
        t0 = time.monotonic()
        await asyncio.gather(*(client(i, http, t0 + seconds) for i in range(clients)))
        return sum(done) / (time.monotonic() - t0)


def _serve(tree: Path) -> tuple[subprocess.Popen[bytes], Path]:
    data = Path(tempfile.mkdtemp(prefix="tree-ab-"))
    cmd = [str(tree / ".venv" / "bin" / "python"), "serve.py", "--no-learner", "--port", str(PORT), "--data-dir", str(data)]
    proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(180):
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2).status_code == 200:
                return proc, data
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server of {tree} exited ({proc.returncode})")
        time.sleep(1)
    raise SystemExit(f"the server of {tree} did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the baseline tree (a worktree with .venv and .data)")
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    trees = {"base": args.base.resolve(), "this": ROOT}
    url = f"http://127.0.0.1:{PORT}"
    runs = []
    for rnd in range(args.rounds):
        for name, tree in trees.items():
            proc, data = _serve(tree)
            try:
                model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
                asyncio.run(_load(url, model, 4, 5, args.new_tokens))  # warm-up
                for n in clients:
                    load = os.getloadavg()[0]
                    tps = asyncio.run(_load(url, model, n, args.seconds, args.new_tokens))
                    runs.append({"round": rnd, "tree": name, "clients": n, "tok_s": round(tps, 1), "load1": round(load, 2)})
                    print(f"round {rnd} {name:4} {n:3} clients: {tps:7.1f} tok/s (load {load:.2f})", flush=True)
            finally:
                os.killpg(proc.pid, 15)
                proc.wait(60)
                shutil.rmtree(data, ignore_errors=True)
    print("\n| clients | base tok/s | this tok/s | this / base |\n|---|---|---|---|")
    for n in clients:
        b = statistics.mean(r["tok_s"] for r in runs if r["tree"] == "base" and r["clients"] == n)
        t = statistics.mean(r["tok_s"] for r in runs if r["tree"] == "this" and r["clients"] == n)
        print(f"| {n} | {b:.1f} | {t:.1f} | {t / b:.2f}x |")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
