"""Client-library sweep: each library's default path against one ``serve.py``, every call recorded as pass or failure.

    .venv/bin/python bench/client_sweep.py --json-out docs/results/client_sweep.json   # SmolLM2 (make serve's model)
    .venv/bin/python bench/client_sweep.py --model tiny --only openai,anthropic          # a quick smoke of the harness
    .venv/bin/python bench/client_sweep.py --url http://127.0.0.1:8000 --api-key KEY     # an existing server (make serve)

The libraries: openai (Python and Node), openai-agents, langchain-openai, instructor, pydantic-ai, litellm, dspy,
smolagents, the AI SDK (npm ``ai`` + ``@ai-sdk/openai``) and Anthropic's Python SDK. Each has one small script in
``bench/client_sweep/`` (``*_calls.py`` or ``*.mjs``) making the calls a user of it makes first: plain chat, streaming,
a tool, structured output where the library is about that (instructor, pydantic-ai; also where it has a first-class
helper), embeddings where it has them, Anthropic messages, the Responses API with openai-agents.

1. **Environments**, built once and reused while their stamp matches the pins below: one virtualenv per group of
   libraries that can share one, under ``--sweep-dir`` (``~/.cache/loopwise/sweep``: ``openai/``, ``langchain/``,
   ``instructor/``, ``dspy/``, ``smolagents/``), pip from PyPI; the npm packages in ``<sweep-dir>/node``. Outside the
   checkout, like ``make clients``' virtualenv: their dependency trees stay out of ``constraints.txt``.
2. **Server**: ``serve.py --model <model>`` on a free port with an API key and an admin key, no learner process (the
   learner changes no API behaviour, and it would compete for the CPU), its data in ``--data-dir`` (its log there),
   or an existing server (``--url`` with ``--api-key``).
3. **Calls**: each script runs once, with its group's python (or node), from a folder outside the checkout (so
   openai-agents' ``agents`` is not loopwise's), without ``PYTHONPATH``, every host but this machine routed to a
   closed port (nothing may need the network). Each call prints a JSON record as it ends.
4. **Classification** (``bench/client_sweep/_common.py``, ``_common.mjs``): *server-side* when the server answered
   an HTTP status >= 400 during the call (read from its own ``/metrics``, before and after each call) or the error
   carries one, on a transport error, and on any error the library raised that is not one of rejecting what it parsed
   (a protocol error it could not parse); *model-side* when the library parsed the response but the model's output
   did not satisfy it (invalid JSON for a schema, no tool call where the call was about one, an agent step with no
   usable action). Every failure keeps its error text, so a classification can be checked by reading it.

Nothing is retried: a call runs once (the clients are built with ``max_retries=0`` where the library takes it), and a
failure is a failure. Results: a table on stdout (markdown) and ``--json-out``. Not here: timing figures (the calls'
seconds are recorded, not compared), and the learner.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "bench" / "client_sweep"

# The virtualenvs: one per group of libraries that resolve together. instructor caps openai below the version the
# others need; dspy and langchain-openai install litellm, held at the release `make clients` installs.
GROUPS: dict[str, tuple[str, ...]] = {
    "openai": ("openai==3.63.0", "openai-agents==0.24.0", "pydantic-ai-slim[openai]==2.68.0", "anthropic==2.16.0"),
    "langchain": ("langchain-openai==1.7.4", "litellm==1.82.6"),
    "instructor": ("instructor==1.17.0",),
    "dspy": ("dspy[numpy]==3.4.1", "litellm==1.82.6"),  # numpy: dspy.Embedder needs it (an extra)
    "smolagents": ("smolagents[openai]==1.26.0",),
}
NODE_PACKAGES = ("openai@7.55.0", "ai@7.0.173", "@ai-sdk/openai@4.0.118", "zod@4.6.7")


@dataclass(frozen=True)
class Library:
    name: str
    group: str  # a key of GROUPS, or "node"
    script: str  # in bench/client_sweep/


LIBRARIES = (
    Library("openai", "openai", "openai_calls.py"),
    Library("openai-node", "node", "openai_node_calls.mjs"),
    Library("openai-agents", "openai", "openai_agents_calls.py"),
    Library("langchain-openai", "langchain", "langchain_calls.py"),
    Library("instructor", "instructor", "instructor_calls.py"),
    Library("pydantic-ai", "openai", "pydantic_ai_calls.py"),
    Library("litellm", "langchain", "litellm_calls.py"),
    Library("dspy", "dspy", "dspy_calls.py"),
    Library("smolagents", "smolagents", "smolagents_calls.py"),
    Library("ai-sdk", "node", "ai_sdk_calls.mjs"),
    Library("anthropic", "openai", "anthropic_calls.py"),
)
STATUSES = ("pass", "server-fail", "model-fail")


def _stamp(pins: tuple[str, ...]) -> str:
    return ".installed-" + hashlib.sha1(" ".join(pins).encode()).hexdigest()[:10]


def ensure_env(group: str, sweep_dir: Path) -> Path:
    """The group's interpreter (``python`` of its virtualenv, or ``node`` with the packages in ``<sweep_dir>/node``),
    installed first where its stamp is missing."""
    if group == "node":
        where = sweep_dir / "node"
        stamp = where / _stamp(NODE_PACKAGES)
        if not stamp.exists():
            where.mkdir(parents=True, exist_ok=True)
            (where / "package.json").write_text(json.dumps({"name": "loopwise-client-sweep", "private": True, "type": "module"}) + "\n")
            print(f"installing {' '.join(NODE_PACKAGES)} into {where} ...", flush=True)
            subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent", "--save-exact", *NODE_PACKAGES], cwd=where, check=True)
            for old in where.glob(".installed-*"):
                old.unlink()
            stamp.touch()
        return Path(shutil.which("node") or "node")
    pins = GROUPS[group]
    venv = sweep_dir / group
    python = venv / "bin" / "python"
    stamp = venv / _stamp(pins)
    if not stamp.exists():
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        print(f"installing {' '.join(pins)} into {venv} ...", flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *pins], check=True)
        for old in venv.glob(".installed-*"):
            old.unlink()
        stamp.touch()
    return python


def script_env(url: str, key: str, model: str, home: Path) -> dict[str, str]:
    """The scripts' environment: the server in the variables the libraries read, nothing of ours (``PYTHONPATH``, keys,
    proxies), and every host but this machine routed to a closed port, so a call that reaches out fails at once."""
    drop = ("PYTHONPATH", "OPENAI_", "ANTHROPIC_", "ALL_PROXY", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "VIRTUAL_ENV", "NODE_OPTIONS")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(drop)}
    closed = "http://127.0.0.1:9"
    base = url.removesuffix("/v1")
    return env | {
        "SWEEP_URL": url,
        "SWEEP_API_KEY": key,
        "SWEEP_MODEL": model,
        "OPENAI_BASE_URL": url,
        "OPENAI_API_KEY": key,
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": key,
        "HTTP_PROXY": closed,
        "HTTPS_PROXY": closed,
        "NO_PROXY": "127.0.0.1,localhost",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "DSPY_CACHEDIR": str(home / "dspy-cache"),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "DO_NOT_TRACK": "1",
        "OTEL_SDK_DISABLED": "true",
        "PYTHONUNBUFFERED": "1",
    }


def run_library(lib: Library, interpreter: Path, env: dict[str, str], sweep_dir: Path, timeout: float) -> dict[str, Any]:
    """Run one library's script; its records as they came, plus what the harness saw (exit code, a timeout)."""
    if lib.group == "node":  # ESM resolves packages from the script's own folder: the scripts run from the packages' one
        cwd = sweep_dir / "node"
        for f in HERE.glob("*.mjs"):
            shutil.copyfile(f, cwd / f.name)
        cmd = [str(interpreter), str(cwd / lib.script)]
    else:
        cwd = Path(tempfile.mkdtemp(prefix=f"sweep-{lib.name}-"))
        cmd = [str(interpreter), str(HERE / lib.script)]
    t0 = time.perf_counter()
    out: dict[str, Any] = {"library": lib.name, "versions": {}, "calls": []}
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        timed_out = False
        try:
            with _deadline(proc, timeout) as expired:
                for line in proc.stdout:
                    record = _json_line(line)
                    if record is None:
                        continue
                    if "call" in record:
                        out["calls"].append(record)
                        _print_call(lib.name, record)
                    elif "library" in record:
                        out["versions"] = record.get("versions", {})
                        out["planned"] = record.get("calls", [])
                timed_out = expired()
        finally:
            proc.wait()
        err.seek(0)
        stderr = err.read()
    if lib.group != "node":
        shutil.rmtree(cwd, ignore_errors=True)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["exit_code"] = proc.returncode
    done = {c["call"] for c in out["calls"]}
    missing = [c for c in out.get("planned", []) if c not in done]
    if timed_out or proc.returncode != 0 or not out["calls"]:
        why = f"the script timed out after {timeout:.0f} s" if timed_out else f"the script exited {proc.returncode}"
        out["script_error"] = why + ": " + stderr[-1500:].strip()
        print(f"  {lib.name}: {why}\n{stderr[-1500:]}", flush=True)
        if missing:  # the call in flight when it stopped counts as failed (a hang), the ones after it as not run
            out["calls"].append({"call": missing[0], "status": "server-fail", "basis": "harness: " + why, "error": stderr[-600:].strip()})
            out["not_run"] = missing[1:]
    return out


@contextlib.contextmanager
def _deadline(proc: subprocess.Popen[str], timeout: float) -> Iterator[Any]:
    """Kill ``proc`` if it outlives ``timeout``; yields a function that says whether it did."""
    fired = threading.Event()

    def kill() -> None:
        fired.set()
        proc.kill()

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        yield fired.is_set
    finally:
        timer.cancel()


def _json_line(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _print_call(library: str, c: dict[str, Any]) -> None:
    what = c.get("detail", "") if c["status"] == "pass" else f"[{c.get('basis', '')}] {c.get('error', '')}"
    print(f"  {library:17} {c['call']:22} {c['status']:11} {c.get('seconds', 0):6.1f}s  {what[:200]}", flush=True)


def served_model_name(model: str) -> str:
    return {"default": "SmolLM2-135M-Instruct", "tiny": "tiny"}.get(model) or Path(model).name


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """``(url of /v1, api key)``: the one at ``--url``, or a ``serve.py`` started here (stopped on exit)."""
    if args.url:
        yield args.url.rstrip("/").removesuffix("/v1") + "/v1", args.api_key or "unused"
        return
    from experiments.agent_eval import spawned_server

    key = "sweep-" + secrets.token_hex(8)
    shutil.rmtree(args.data_dir, ignore_errors=True)
    extra = ["--api-key", key, *args.serve_args.split()]
    with spawned_server(args.model, secrets.token_hex(8), extra, data_dir=args.data_dir) as base:
        yield base + "/v1", key


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    rows = {r["library"]: Counter(c["status"] for c in r["calls"]) for r in results}
    total = sum(rows.values(), Counter())
    return {"by_library": {k: {s: v.get(s, 0) for s in STATUSES} for k, v in rows.items()}, "total": {s: total.get(s, 0) for s in STATUSES}}


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per library (counts, then each call's outcome: ✓ pass, S server-side, M model-side)."""
    mark = {"pass": "✓", "server-fail": "S", "model-fail": "M"}
    lines = ["| library | version | pass | server-fail | model-fail | calls |", "|---|---|---|---|---|---|"]
    for r in results:
        n = Counter(c["status"] for c in r["calls"])
        main = r["versions"].get(next(iter(r["versions"]), ""), "?") if r["versions"] else "?"
        calls = ", ".join(f"{c['call']} {mark.get(c['status'], '?')}" for c in r["calls"])
        if r.get("not_run"):
            calls += ", not run: " + ", ".join(r["not_run"])
        lines.append(f"| {r['library']} | {main} | {n['pass']} | {n['server-fail']} | {n['model-fail']} | {calls} |")
    t = summarize(results)["total"]
    lines.append(f"| **all** | | **{t['pass']}** | **{t['server-fail']}** | **{t['model-fail']}** | {sum(t.values())} calls |")
    return "\n".join(lines)


def _slim(call: dict[str, Any]) -> dict[str, Any]:
    """A call's record for the JSON file: the trace only for server-side failures, texts shortened."""
    keep = {k: v for k, v in call.items() if k != "trace" or call.get("status") == "server-fail"}
    for k, n in (("error", 400), ("cause", 400), ("detail", 120), ("trace", 600)):
        if isinstance(keep.get(k), str) and len(keep[k]) > n:
            keep[k] = keep[k][: n - 1] + "…"
    return keep


def merged(earlier: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """``now``'s libraries added to ``earlier``'s (a library run again replaces its earlier record); each part's command
    and wall time are kept in ``parts``."""
    if earlier.get("model") != now["model"]:
        raise SystemExit(f"--merge: {earlier.get('model')!r} results cannot take {now['model']!r} ones")
    ran = {r["library"] for r in now["libraries"]}
    order = [lib.name for lib in LIBRARIES]
    libraries = sorted([r for r in earlier["libraries"] if r["library"] not in ran] + now["libraries"], key=lambda r: order.index(r["library"]))
    parts = earlier.get("parts") or [{k: earlier[k] for k in ("command", "date", "wall_s", "loadavg_end") if k in earlier}]
    parts.append({k: now[k] for k in ("command", "date", "wall_s", "loadavg_end")})
    out = {**now, "command": f"{len(parts)} runs merged (--merge): their commands in parts", "parts": parts, "libraries": libraries}
    out["wall_s"] = round(sum(p.get("wall_s", 0) for p in parts), 1)
    by_lib = {r["library"]: {s: sum(c["status"] == s for c in r["calls"]) for s in STATUSES} for r in libraries}
    out["by_library"], out["total"] = by_lib, {s: sum(v[s] for v in by_lib.values()) for s in STATUSES}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="the served model: default (SmolLM2-135M-Instruct), tiny, or a local folder")
    p.add_argument("--only", default="", help="comma-separated library names (default: all): " + ",".join(lib.name for lib in LIBRARIES))
    p.add_argument("--sweep-dir", type=Path, default=Path(os.environ.get("LOOPWISE_SWEEP_DIR") or Path.home() / ".cache" / "loopwise" / "sweep"))
    p.add_argument("--install-only", action="store_true", help="build the environments and stop")
    p.add_argument("--url", help="an existing server (its root or /v1 URL) instead of starting one")
    p.add_argument("--api-key", help="with --url: its API key")
    p.add_argument("--serve-args", default="", help="extra serve.py flags (one string, split on spaces)")
    p.add_argument("--data-dir", type=Path, default=ROOT / "bench" / "results" / "client_sweep_data", help="the started server's data (emptied)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds one library's script may run")
    p.add_argument("--merge", action="store_true", help="add this run's libraries to those already in --json-out (a sweep run in parts)")
    p.add_argument("--json-out", type=Path, default=ROOT / "bench" / "results" / "client_sweep.json")
    p.add_argument("--table", type=Path, help="print the table of an earlier run's --json-out and stop")
    args = p.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())["libraries"]))
        return 0
    sys.path.insert(0, str(ROOT))
    chosen = [lib for lib in LIBRARIES if not args.only or lib.name in args.only.split(",")]
    if args.only and len(chosen) != len(set(args.only.split(","))):
        p.error(f"--only: unknown library among {args.only!r}")
    args.sweep_dir = args.sweep_dir.expanduser()
    t0 = time.perf_counter()
    interpreters = {g: ensure_env(g, args.sweep_dir) for g in dict.fromkeys(lib.group for lib in chosen)}
    install_s = time.perf_counter() - t0
    if args.install_only:
        print(f"environments ready in {args.sweep_dir} ({install_s:.0f} s)")
        return 0
    model = served_model_name(args.model)
    results: list[dict[str, Any]] = []
    t1 = time.perf_counter()
    with server(args) as (url, key), tempfile.TemporaryDirectory(prefix="client-sweep-") as home:
        httpx.get(url.removesuffix("/v1") + "/ready", timeout=30).raise_for_status()
        print(f"server {url} serving {model}; {len(chosen)} libraries", flush=True)
        env = script_env(url, key, model, Path(home))
        for lib in chosen:
            results.append(run_library(lib, interpreters[lib.group], env, args.sweep_dir, args.timeout))
    wall = time.perf_counter() - t1
    summary = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "served_model": model,
        "server": args.url or f"serve.py --model {args.model} --no-learner {args.serve_args}".strip(),
        "wall_s": round(wall, 1),
        "install_s": round(install_s, 1),
        "loadavg_end": os.getloadavg(),
        **summarize(results),
        "libraries": [{**{k: v for k, v in r.items() if k != "calls"}, "calls": [_slim(c) for c in r["calls"]]} for r in results],
    }
    if args.merge and args.json_out.exists():  # a sweep run in parts: the libraries of earlier parts, those re-run replaced
        summary = merged(json.loads(args.json_out.read_text()), summary)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    print()
    print(table(results))
    failures = [(r["library"], c) for r in results for c in r["calls"] if c["status"] != "pass"]
    if failures:
        print("\nfailures:")
        for name, c in failures:
            cause = f" [from {c['cause'][:200]}]" if c.get("cause") else ""
            print(f"- {name} {c['call']} ({c['status']}; {c.get('basis', '')}): {c.get('error', '')[:300]}{cause}")
    warned = [
        (r["library"], c)
        for r in results
        for c in r["calls"]
        if c["status"] == "pass" and any(int(k.rsplit(" ", 1)[1]) >= 400 for k in c.get("http", {}))
    ]
    for name, c in warned:
        print(f"note: {name} {c['call']} passed although the server answered {c['http']}")
    print(f"\n{sum(len(r['calls']) for r in results)} calls in {wall:.0f} s (+{install_s:.0f} s of installs); results: {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
