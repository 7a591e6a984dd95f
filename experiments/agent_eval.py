"""``loopwise eval`` (or ``python -m experiments.agent_eval``): evaluate a served agent on a task, through a server's runs endpoint.

    loopwise eval --agent calc-agent --task calc_arith --n 200 [--adapter family@N] [--seed 0]
                  [--url http://127.0.0.1:8000 | --spawn default|tiny|PATH] [--concurrency 16] [--json]

Each problem ``i`` of the task (seeded) is one ``POST /v1/agents/{agent}/runs`` with ``{"task",
"problem_index": i, "seed"}``, so every run is recorded with its verifier's reward like live traffic.
``--adapter`` overrides the agent's model (a ``family@N`` version, an alias or the base name).
``--spawn MODEL`` starts a private ``serve.py`` on a free port for the evaluation (and stops it after);
otherwise the server at ``--url`` is used. ``--max-turns`` overrides the agent's turn cap, and
``--stop-policy``/``--tau`` evaluate a temporary copy of the agent with another stop policy (created
and deleted through the admin API, so ``--admin-key`` is needed).

Prints the success rate with a Wilson confidence interval, mean turns and tokens, the wrong-stop rate
(wrong answers among self-verified stops), and for self-verifying policies the calibration of the
stated confidence (Brier score, ECE). ``--json`` prints one JSON object instead.

Not here: the agent loop (it runs in the server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx

from agents.calibration import summarize

ROOT = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loopwise eval", description="Evaluate a served agent on a task (runs through a loopwise server).")
    p.add_argument("--agent", required=True, help="agent name (see GET /v1/models)")
    p.add_argument("--task", required=True, help="task name (e.g. calc_arith, basic_arithmetic, frozenlake)")
    p.add_argument("--n", type=int, default=200, help="number of problems (default 200)")
    p.add_argument("--seed", type=int, default=0, help="problem seed (default 0)")
    p.add_argument("--adapter", help="serve the agent on this model: family@N, an alias, or the base name")
    p.add_argument("--max-turns", type=int, help="override the agent's turn cap")
    p.add_argument("--stop-policy", choices=["answer", "fixed", "svr", "svr_r1"], help="evaluate a copy of the agent with this stop policy")
    p.add_argument("--stop-param", action="append", default=[], metavar="KEY=VALUE", help="stop policy parameter for --stop-policy (repeatable)")
    p.add_argument("--url", default=os.environ.get("LOOPWISE_URL", "http://127.0.0.1:8000"), help="loopwise server base URL")
    p.add_argument("--spawn", metavar="MODEL", help="start a private serve.py with this model (default|tiny|PATH) instead of using --url")
    p.add_argument("--api-key", default=os.environ.get("LOOPWISE_API_KEY"), help="API key of the server")
    p.add_argument("--admin-key", default=os.environ.get("LOOPWISE_ADMIN_KEY"), help="admin key (needed for --stop-policy)")
    p.add_argument("--concurrency", type=int, default=16, help="runs in flight at once (default 16)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default 600)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


@contextmanager
def spawned_server(
    model: str, admin_key: str, extra_args: Sequence[str] = (), learner: bool = False, data_dir: Path | None = None, root: Path = ROOT
) -> Iterator[str]:
    """A private ``serve.py`` on a free port; yields its base URL.

    ``extra_args`` go after the defaults (the user's flags win); ``learner`` keeps the learner process
    (default off). The server's stdout after the start line is copied to ``server.stdout`` by a thread, so
    a chatty server (``--demo``) never blocks on a full pipe. Its data folder is a temporary one, removed on
    exit, unless ``data_dir`` names one to keep. ``root`` is the checkout whose ``serve.py`` runs (another one's, for a
    side-by-side run against an older commit)."""
    with tempfile.TemporaryDirectory(prefix="loopwise-eval-") as tmp:
        data = Path(tmp) if data_dir is None else data_dir
        data.mkdir(parents=True, exist_ok=True)
        models = root / ".data" / "models"
        if model in ("default", "tiny") and models.exists() and not (data / "models").exists():
            (data / "models").symlink_to(models.resolve(), target_is_directory=True)  # reuse the converted model cache
        cmd = [
            sys.executable,
            str(root / "serve.py"),
            "--model",
            model,
            "--port",
            "0",
            "--data-dir",
            str(data),
            "--admin-key",
            admin_key,
            *([] if learner else ["--no-learner"]),
            *extra_args,
        ]
        log = open(data / "server.log", "w+")
        proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert proc.stdout is not None
            url = None
            deadline = time.monotonic() + 600
            while url is None and time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line and proc.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"error: the spawned server exited ({proc.returncode}):\n{log.read()[-3000:]}")
                m = re.search(r"on (http://[\d.]+:\d+)/v1", line or "")
                url = m.group(1) if m else None
            if url is None:
                raise SystemExit("error: the spawned server did not start in 600 s")
            out = open(data / "server.stdout", "w")  # the drain thread closes it at EOF
            threading.Thread(target=_drain, args=(proc.stdout, out), daemon=True).start()
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


def _drain(stream: IO[str], sink: IO[str]) -> None:
    with sink:
        for line in stream:
            sink.write(line)
            sink.flush()


async def run_all(args: argparse.Namespace, url: str, agent: str) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sem = asyncio.Semaphore(max(1, args.concurrency))
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout, limits=limits) as client:

        async def one(i: int) -> dict[str, Any]:
            body: dict[str, Any] = {"task": args.task, "problem_index": i, "seed": args.seed, "eval": True}
            if args.adapter:
                body["model"] = args.adapter
            if args.max_turns:
                body["max_turns"] = args.max_turns
            async with sem:
                r = await client.post(f"/v1/agents/{agent}/runs", json=body)
            if r.status_code != 200:
                raise SystemExit(f"error: run {i} failed with {r.status_code}: {r.text[:500]}")
            answer: dict[str, Any] = r.json()
            return answer

        return list(await asyncio.gather(*(one(i) for i in range(args.n))))


def report(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of a list of run results (``RunResult.to_dict()`` objects)."""
    summary: dict[str, Any] = summarize(
        [bool(r.get("correct")) for r in runs],
        confidences=[r.get("p_correct") for r in runs],
        turns=[int(r["turns"]) for r in runs],
        tokens=[int(r["completion_tokens"]) for r in runs],
        verified=[r.get("stop_reason") == "verified" for r in runs],
    ).as_dict()
    summary["mean_reward"] = sum(float(r.get("reward") or 0.0) for r in runs) / len(runs) if runs else None
    reasons: dict[str, int] = {}
    for r in runs:
        reasons[r["stop_reason"]] = reasons.get(r["stop_reason"], 0) + 1
    summary["stop_reasons"] = reasons
    summary["format_failures"] = sum(int(r.get("format_failures") or 0) for r in runs)
    summary["untrainable"] = sum(1 for r in runs if not r.get("trainable", True))
    return summary


def _stop_params(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


async def evaluate(args: argparse.Namespace, url: str) -> dict[str, Any]:
    agent = args.agent
    temp = None
    admin = {"Authorization": f"Bearer {args.admin_key}"} if args.admin_key else {}
    if args.stop_policy:
        async with httpx.AsyncClient(base_url=url, headers=admin, timeout=30) as c:
            r = await c.get("/admin/agents")
            if r.status_code != 200:
                raise SystemExit(f"error: --stop-policy needs the admin API ({r.status_code}: {r.text[:300]})")
            base = next((a for a in r.json()["data"] if a["name"] == agent), None)
            if base is None:
                raise SystemExit(f"error: no agent named {agent!r}")
            cfg = {k: v for k, v in base.items() if k in ("description", "tools", "model", "max_turns", "token_budget", "task", "t2po")}
            temp = f"{agent}.eval-{os.getpid()}"
            cfg.update(name=temp, stop_policy=args.stop_policy, stop_params=_stop_params(args.stop_param))
            r = await c.post("/admin/agents", json=cfg)
            if r.status_code != 201:
                raise SystemExit(f"error: could not create the evaluation agent: {r.text[:300]}")
        agent = temp
    t0 = time.perf_counter()
    try:
        runs = await run_all(args, url, agent)
    finally:
        if temp is not None:
            async with httpx.AsyncClient(base_url=url, headers=admin, timeout=30) as c:
                await c.delete(f"/admin/agents/{temp}")
    out = report(runs)
    out.update(
        agent=args.agent, task=args.task, adapter=args.adapter, stop_policy=args.stop_policy, seed=args.seed, elapsed_s=time.perf_counter() - t0
    )
    return out


def render(s: dict[str, Any]) -> str:
    def f(x: Any, spec: str = ".3f") -> str:
        return "n/a" if x is None else format(x, spec)

    lines = [
        f"agent {s['agent']} on {s['task']} (n={s['n']}, seed {s['seed']}{', adapter ' + s['adapter'] if s['adapter'] else ''}"
        f"{', stop ' + s['stop_policy'] if s['stop_policy'] else ''})",
        f"  success rate   {f(s['success_rate'])}  [{f(s['ci_low'])}, {f(s['ci_high'])}] ({1 - s['alpha']:.0%} Wilson)",
        f"  mean reward    {f(s['mean_reward'])}",
        f"  mean turns     {f(s['mean_turns'], '.2f')}",
        f"  mean tokens    {f(s['mean_tokens'], '.1f')}",
        f"  wrong stops    {f(s['wrong_stop_rate'])} of {s['verified_stops']} self-verified stops",
        f"  calibration    Brier {f(s['brier'])}  ECE {f(s['ece'])}  ({s['n_calibrated']} runs with a stated confidence)",
        f"  stop reasons   {', '.join(f'{k} {v}' for k, v in sorted(s['stop_reasons'].items()))}",
        f"  format fails   {s['format_failures']}   untrainable runs {s['untrainable']}   ({s['elapsed_s']:.1f} s)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.n < 1:
        raise SystemExit("error: --n must be at least 1")
    try:
        if args.spawn:
            args.admin_key = args.admin_key or f"eval-{os.getpid()}"
            with spawned_server(args.spawn, args.admin_key) as url:
                summary = asyncio.run(evaluate(args, url))
        else:
            summary = asyncio.run(evaluate(args, args.url))
    except httpx.ConnectError as exc:
        raise SystemExit(f"error: no loopwise server at {args.url} ({exc}); start one with `make serve` or pass --spawn default") from None
    print(json.dumps(summary) if args.json else render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
