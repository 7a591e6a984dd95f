"""Serving speed of the embedded engine beside its CPU peers, side by side in one run, rounds interleaved.

    .venv/bin/python bench/serving.py                               # SmolLM2, loopwise vs transformers serve (+ vLLM if found)
    .venv/bin/python bench/serving.py --vllm /path/to/venv/bin/vllm # vLLM's CPU build (default: $LOOPWISE_VLLM_VENV/bin/vllm)
    .venv/bin/python bench/serving.py --peers none --model tiny     # a quick smoke run
    .venv/bin/python bench/serving.py --baseline /tmp/base          # + an older checkout's serve.py (before vs after)

Every server is started once, on the same model folder and dtype (``--dtype``, default: loopwise's
``auto``), with the same number of CPU threads when ``--threads`` is given (``OMP_NUM_THREADS`` for
the peers). They stay up together and take the load one at a time; each round runs every phase on
every server, the server order rotating per round, so load from other processes on the machine hits
them alike. The machine's 1-minute load average is printed with every figure.

Phases (completion tokens from ``usage`` / wall time; prompts ask for long stories, temperature 0,
``--new-tokens`` each, with ``ignore_eos`` where the server takes it, so every server decodes the same
number of tokens):
1. ``1``, ``16``, ``64`` concurrent clients (``--clients``): aggregate decode tok/s. Targets on a
   2-core machine: 1 client ≥ 50 tok/s in bf16; 16 and 64 clients ≥ 1.3× ``transformers serve``.
2. Long prompt under load: 16 streaming clients decode; once each has its first token, one request
   with a ~2,000-token prompt (``--long-prompt``) is sent: its time to first token, and the longest gap
   between two tokens of the 16 while it was prefilled (loopwise feeds prompts in ``--prefill-chunk``
   pieces mixed into the decode steps). The same prompt's TTFT on the idle server is printed beside it.
3. Adapters (loopwise only): 4 LoRA adapters (r=8 on q/k/v/o, ``bench/adapters.py``) loaded through the
   admin API; 16 clients all on one adapter vs the same requests spread over the 4 (every batch
   mixes them), alternating. Target mixed / single ≥ 0.9.
4. In process: batch-1 decode tok/s of ``EmbeddedEngine`` against the memory-bandwidth bound (read
   bandwidth from summing a 512 MiB tensor, over the bytes of weights read per token), and the HTTP
   overhead: p50 of non-streamed 16-token requests over HTTP vs ``engine.generate`` in process, the two
   alternating request by request.

Results also go to bench/results/serving.json; server logs to bench/results/<server>.log.
Not here: GPU runs and SGLang (their own benchmarks), timed assertions (never in tests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

OUT = ROOT / "bench" / "results"
ADMIN = "bench"
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


# ---- processes --------------------------------------------------------------------------------
def start_process(
    cmd: list[str], ready_url_of, log_path: Path, timeout: float = 600, env: dict | None = None, cwd: Path = ROOT
) -> tuple[subprocess.Popen, str]:
    """Start ``cmd``; its stdout lines go to ``ready_url_of`` until one returns the base URL."""
    log = open(log_path, "w")
    proc = spawn(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited early; see {log_path}")
        url = ready_url_of(line)
        if url:
            return proc, url
    raise TimeoutError(f"{cmd} did not start")


STARTED: list[subprocess.Popen] = []  # every server process, stopped in ``main``'s finally even if it never became ready


def spawn(cmd: list[str], **kw) -> subprocess.Popen:
    """A server in a session of its own, so stopping it reaches its workers (vLLM's engine core) too."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kw)
    STARTED.append(proc)
    return proc


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's whole session (workers it left behind included), SIGKILL after 20 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


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


@dataclass
class Server:
    name: str
    url: str
    model: str  # the request's "model"
    proc: subprocess.Popen
    ignore_eos: bool  # takes the SGLang/vLLM extra
    results: dict = field(default_factory=dict)

    def body(self, text: str, max_tokens: int, **extra) -> dict:
        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0, **extra}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


def thread_env(threads: int | None) -> dict:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def loopwise_url(line: str) -> str | None:
    """The base URL in ``serve.py``'s ready line (``... on http://HOST:PORT/v1``), else None."""
    m = re.search(r"on (http://[\d.]+:\d+)/v1", line)
    return m.group(1) if m else None


def start_loopwise(model_path: Path, args, data_dir: Path, adapter_root: Path, root: Path = ROOT, name: str = "loopwise") -> Server:
    """``serve.py`` of the checkout at ``root`` (this one, or ``--baseline``'s older tree) with this interpreter."""
    cmd = [sys.executable, str(root / "serve.py"), "--model", str(model_path), "--served-model-name", "m", "--port", "0", "--no-learner"]
    cmd += ["--data-dir", str(data_dir), "--admin-key", ADMIN, "--adapter-root", str(adapter_root), "--log-level", "info"]
    cmd += ["--dtype", args.dtype, "--max-batch-size", str(args.max_batch_size)]
    if root == ROOT:
        cmd += ["--prefill-chunk", str(args.prefill_chunk)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc, url = start_process(cmd, loopwise_url, OUT / f"{name}.log", cwd=root)
    return Server(name, url, "m", proc, ignore_eos=True)


def start_transformers(model_path: Path, args, dtype: str, port: int) -> Server:
    tf = str(Path(sys.executable).with_name("transformers"))
    cmd = [tf, "serve", "--continuous-batching", "--device", "cpu", "--dtype", dtype, "--port", str(port), str(model_path)]
    # its default sizes the paged KV cache from free memory (8.4 GB here, and the kernel's OOM killer):
    # 512 blocks of 32 tokens hold 64 clients' 100-token contexts, or 16 decoders plus the long prompt
    cmd += ["--cb-block-size", "32", "--cb-num-blocks", str(args.tf_blocks)]
    log = OUT / "transformers.log"
    proc = spawn(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=thread_env(args.threads))
    url = f"http://localhost:{port}"
    wait_healthy(url, proc, log)
    return Server("transformers", url, str(model_path), proc, ignore_eos=False)


def start_vllm(vllm: str, model_path: Path, args, dtype: str, port: int) -> Server:
    env = thread_env(args.threads)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache; its default (4) is a sixth of this machine
    cmd = [vllm, "serve", str(model_path), "--dtype", dtype, "--port", str(port), "--served-model-name", "m", "--max-model-len", "4096"]
    log = OUT / "vllm.log"
    proc = spawn(cmd, cwd=ROOT, stdout=open(OUT / "vllm.out", "w"), stderr=open(log, "w"), env=env)
    url = f"http://localhost:{port}"
    wait_healthy(url, proc, log, timeout=1800)
    return Server("vllm", url, "m", proc, ignore_eos=True)


def find_vllm(arg: str | None) -> str | None:
    """``--vllm``, else ``vllm`` in ``$LOOPWISE_VLLM_VENV`` (default ``~/.cache/loopwise/vllm-cpu``, where ``make vllm`` installs it), else on PATH."""
    if arg:
        return arg if arg != "none" else None
    venv = Path(os.environ.get("LOOPWISE_VLLM_VENV") or Path.home() / ".cache" / "loopwise" / "vllm-cpu").expanduser()
    exe = venv / "bin" / "vllm"
    return str(exe) if exe.exists() else shutil.which("vllm")


# ---- loads ------------------------------------------------------------------------------------
async def run_load(server: Server, texts: list[str], clients: int, max_tokens: int, models: list[str] | None = None) -> dict:
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
    return {
        "clients": clients,
        "requests": len(texts),
        "completion_tokens": tokens,
        "wall_s": round(wall, 2),
        "tok_s": round(tokens / wall, 1),
        "load": load(),
    }


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


async def long_prompt_under_load(server: Server, long_text: str, decoders: int, decode_tokens: int) -> dict:
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


def long_text(tokenizer, target: int) -> str:
    """A user message whose chat-templated prompt is about ``target`` tokens."""
    para = " ".join(f"Note {i}: the {TOPICS[i % len(TOPICS)]} appears again in chapter {i}." for i in range(40))
    text = "Summarise these notes in one sentence.\n"
    while len(tokenizer.encode(text, add_special_tokens=False)) < target - 40:
        text += para + "\n"
    ids = tokenizer.encode(text, add_special_tokens=False)[: target - 40]
    return tokenizer.decode(ids)


# ---- in process -------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def in_process(model_path: Path, n: int, decode_tokens: int, args, http_base: str | None = None) -> dict:
    """Batch-1 decode and latency in process; with ``http_base``, each in-process request alternates
    with the same request over HTTP to the (otherwise idle) server, so machine noise hits both alike."""
    import torch

    from runtime.engine import GenerateRequest, SamplingParams
    from runtime.engines.embedded import EmbeddedEngine

    eng = EmbeddedEngine(model_path, model_id="bench", dtype=args.dtype, threads=args.threads)
    await eng.start()
    tok = eng.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}], tokenize=False, add_generation_prompt=True)
    ids = tuple(tok.encode(text, add_special_tokens=False))
    req16 = GenerateRequest("lat", ids, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    await eng.generate(req16)
    lat, http_lat = [], []
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=http_base or "http://unused", timeout=120) as client:
        if http_base:
            (await client.post("/v1/chat/completions", json=body)).raise_for_status()  # warm-up
        for _ in range(n):
            t0 = time.perf_counter()
            await eng.generate(req16)
            lat.append(time.perf_counter() - t0)
            if http_base:
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
    dtype = eng.info.dtype
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
        "http_p50_s": statistics.median(http_lat) if http_lat else None,
        "http_p95_s": pct(http_lat, 0.95) if http_lat else None,
        "engine_p50_s": statistics.median(lat),
        "engine_p95_s": pct(lat, 0.95),
        "decode_tok_s": round(decode_tps, 1),
        "decode_tok_s_all": [round(d, 1) for d in decode],
        "bandwidth_GBps": round(bandwidth / 1e9, 1),
        "weights_MB": round(weight_bytes / 1e6),
        "dtype": dtype,
        "bound_tok_s": round(bound, 1),
        "fraction_of_bound": round(decode_tps / bound, 2),
        "load": load(),
    }


# ---- main -------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto", help="auto (loopwise's choice, given to the peers as what it resolved to), float32, bfloat16")
    ap.add_argument("--peers", default="transformers,vllm", help="comma list of transformers, vllm; or none")
    ap.add_argument(
        "--vllm",
        default=None,
        help="the vllm executable of vLLM's CPU build (default: $LOOPWISE_VLLM_VENV/bin/vllm, else `vllm` on PATH; none: skip)",
    )
    ap.add_argument(
        "--baseline",
        default=None,
        help="another loopwise checkout (e.g. `git archive main | tar -x -C /tmp/base`) served beside this one, same flags: before vs after",
    )
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--requests-per-client", type=int, default=2, help="requests per round = this × clients (at least 4)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for every server (default: each its own default)")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--long-prompt", type=int, default=2000, help="tokens of the long prompt (0: skip the phase)")
    ap.add_argument("--adapter-rounds", type=int, default=2, help="0: skip the adapters phase")
    ap.add_argument("--latency-samples", type=int, default=10)
    ap.add_argument("--tf-blocks", type=int, default=512, help="transformers serve's KV cache blocks (of 32 tokens)")
    ap.add_argument("--data-dir", default=str(ROOT / ".data"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from runtime.engines.embedded import pick_dtype
    from runtime.model_store import resolve_model

    model_path = resolve_model(args.model, Path(args.data_dir) / "models")
    dtype = str(pick_dtype(args.dtype)).removeprefix("torch.")
    OUT.mkdir(parents=True, exist_ok=True)
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    vllm = find_vllm(args.vllm) if "vllm" in peers else None
    if "vllm" in peers and vllm is None:
        print("vLLM: no `vllm` executable found (pass --vllm PATH); skipping it", flush=True)
        peers.remove("vllm")
    clients = [int(c) for c in args.clients.split(",")]
    results: dict = {"model": str(model_path), "dtype": dtype, "new_tokens": args.new_tokens, "threads": args.threads, "cores": os.cpu_count()}
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    print(f"model {model_path.name}, {dtype}, {os.cpu_count()} cores, threads {args.threads or 'default'}, load {load()}", flush=True)

    servers: list[Server] = []
    tmp = Path(tempfile.mkdtemp(prefix="loopwise-bench-serving-"))
    try:
        adapter_paths = []
        if args.adapter_rounds:
            from bench.adapters import build_adapters

            adapter_paths = build_adapters(model_path, tmp / "adapters", n=4)
        servers.append(start_loopwise(model_path, args, tmp / "data", tmp / "adapters"))
        if args.baseline:
            servers.append(start_loopwise(model_path, args, tmp / "data-baseline", tmp / "adapters", Path(args.baseline).resolve(), "baseline"))
        if "transformers" in peers:
            servers.append(start_transformers(model_path, args, dtype, 8911))
        if vllm:
            servers.append(start_vllm(vllm, model_path, args, dtype, 8912))
        for s in servers:  # warm-up (and first-use model loads)
            asyncio.run(run_load(s, prompts(2), 2, 8))
        print("servers up:", ", ".join(f"{s.name} {s.url}" for s in servers), flush=True)

        # 1: 1 / 16 / 64 clients, rounds interleaved
        for rnd in range(args.rounds):
            order = servers[rnd % len(servers) :] + servers[: rnd % len(servers)]
            for c in clients:
                texts = prompts(max(4, args.requests_per_client * c))
                for s in order:
                    r = asyncio.run(run_load(s, texts, c, args.new_tokens))
                    s.results.setdefault(f"clients_{c}", []).append(r)
                    print(
                        f"round {rnd + 1}  {c:3d} clients  {s.name:13s} {r['tok_s']:8.1f} tok/s  ({r['completion_tokens']} tokens, load {r['load']})",
                        flush=True,
                    )

        # 2: a long prompt while 16 decode
        if args.long_prompt:
            text = long_text(tokenizer, args.long_prompt)
            n_tok = len(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)["input_ids"])
            results["long_prompt_tokens"] = n_tok
            for s in servers:
                r = asyncio.run(long_prompt_under_load(s, text, 16, 4 * args.new_tokens))
                s.results["long_prompt"] = r
                print(f"long prompt ({n_tok} tokens) while 16 decode  {s.name:13s} {r}", flush=True)

        # 3: adapters (loopwise)
        lw = servers[0]
        if adapter_paths:
            names = []
            for i, p in enumerate(adapter_paths):
                r = httpx.post(
                    lw.url + "/admin/adapters",
                    json={"path": str(p), "family": f"bench{i}"},
                    headers={"Authorization": f"Bearer {ADMIN}"},
                    timeout=300,
                )
                r.raise_for_status()
                names.append(r.json()["name"])
            texts = prompts(32)
            for rnd in range(args.adapter_rounds):
                for kind, models in (("single", names[:1]), ("mixed", names)):
                    r = asyncio.run(run_load(lw, texts, 16, args.new_tokens, models=models))
                    lw.results.setdefault(f"adapters_{kind}", []).append(r)
                    print(f"round {rnd + 1}  16 clients  adapters {kind:6s} {r['tok_s']:8.1f} tok/s (load {r['load']})", flush=True)

        # 4: in process, alternating with HTTP to the idle loopwise server
        results["in_process"] = asyncio.run(in_process(model_path, args.latency_samples, args.new_tokens, args, http_base=lw.url))
        print("in process:", results["in_process"], flush=True)
    finally:
        for proc in STARTED:
            stop_process(proc)
        shutil.rmtree(tmp, ignore_errors=True)

    report(results, servers, clients)


def med(runs: list[dict]) -> float:
    return statistics.median(r["tok_s"] for r in runs)


def report(results: dict, servers: list[Server], clients: list[int]) -> None:
    results["servers"] = {s.name: s.results for s in servers}
    lw = servers[0]
    print(f"\nmodel {Path(results['model']).name}  {results['dtype']}  {results['cores']} cores  threads {results['threads'] or 'default'}")
    print(f"{'tok/s (median of rounds)':32s}" + "".join(f"{s.name:>14s}" for s in servers) + "".join(f"{'÷ ' + s.name:>16s}" for s in servers[1:]))
    for c in clients:
        key = f"clients_{c}"
        row = [med(s.results[key]) for s in servers]
        ratios = "".join(f"{row[0] / r:16.2f}" for r in row[1:])
        print(f"{f'{c} client(s)':32s}" + "".join(f"{v:14.1f}" for v in row) + ratios)
    if "long_prompt" in lw.results:
        n = results.get("long_prompt_tokens")
        print(f"{f'TTFT {n}-token prompt, 16 decoding':32s}" + "".join(f"{s.results['long_prompt']['ttft_s']:13.2f}s" for s in servers))
        print(f"{'  same prompt, idle server':32s}" + "".join(f"{s.results['long_prompt']['idle_ttft_s']:13.2f}s" for s in servers))
        print(f"{'  longest decode gap meanwhile':32s}" + "".join(f"{s.results['long_prompt']['max_decode_gap_s'] or 0:13.2f}s" for s in servers))
    if "adapters_single" in lw.results:
        single, mixed = med(lw.results["adapters_single"]), med(lw.results["adapters_mixed"])
        print(f"{'adapters: 16 clients, 4 mixed':32s}{mixed:14.1f}   single adapter {single:.1f}   mixed ÷ single {mixed / single:.2f}")
    ip = results["in_process"]
    print(f"{'batch-1 decode in process':32s}{ip['decode_tok_s']:14.1f}   bandwidth bound {ip['bound_tok_s']:.1f} ({ip['fraction_of_bound']:.2f})")
    print(f"   (read bandwidth {ip['bandwidth_GBps']} GB/s, {ip['weights_MB']} MB of weights read per token)")
    if ip["http_p50_s"]:
        print(
            f"{'HTTP p50 latency (16 tokens)':32s}{ip['http_p50_s'] * 1000:12.1f}ms   in process {ip['engine_p50_s'] * 1000:.1f}ms   ratio {ip['http_p50_s'] / ip['engine_p50_s']:.2f}"
        )
    (OUT / "serving.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
