"""Where a decode step's time goes: the embedded engine's runners side by side, and torch.profiler's top ops.

    .venv/bin/python bench/decode_profile.py                        # SmolLM2, batch 1 and 16, both runners
    .venv/bin/python bench/decode_profile.py --batch 64 --context 200 --threads 1 --top 15
    .venv/bin/python bench/decode_profile.py --prefill 2000 --chunk 512 2048 --runners llama   # one prompt's prefill

For each runner (``llama``: the lean forward; ``transformers``: the model's own forward) and batch
size it fills the KV cache with ``--context`` tokens per row, then times decode steps (one forward
plus greedy sampling, as the engine runs them) in rounds that alternate between the runners, so
load from other processes hits both alike. It reports wall and process CPU milliseconds per step
(the median over rounds; CPU time is what other processes cannot inflate, unless threads spin), the
ratio, and the profiler's top ops by self CPU time for one extra round of each.

``--prefill N`` times instead one prompt of N tokens fed in chunks of each ``--chunk`` size (as the
scheduler feeds a long prompt with ``--prefill-chunk``): wall milliseconds to its first logits, per
chunk size, and the top ops of one extra prefill.

Not here: HTTP, scheduling, text streaming (``bench/serving.py`` measures the server end to end).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(path: Path, runner: str, dtype: str, max_len: int):
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.engines.embedded import pick_dtype
    from runtime.engines.hf_runner import HFRunner
    from runtime.engines.llama_runner import LlamaRunner
    from runtime.engines.lora_batch import LoraBank

    model = AutoModelForCausalLM.from_pretrained(path, dtype=pick_dtype(dtype)).eval()
    if runner == "transformers":
        HFRunner.prepare(model)
        return HFRunner(model, LoraBank(model))
    with torch.inference_mode():
        return LlamaRunner(model, LoraBank(model), max_len)


def filled(runner, batch: int, context: int, vocab: int):
    """``batch`` rows with ``context`` prompt tokens each, prefilled; returns the decode rows."""
    import torch

    from runtime.engines.runner import Chunk, DecodeRow

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (context,), generator=g).tolist() for _ in range(batch)]
    with torch.inference_mode():
        for b in range(batch):
            runner.begin(b, context)
        runner.step([], [Chunk(b, ids, 0, None, True) for b, ids in enumerate(prompts)])
    return [DecodeRow(b, ids[-1], None) for b, ids in enumerate(prompts)]


def step(runner, rows):
    import torch

    logits = runner.step(rows, [])
    return torch.argmax(logits.float(), dim=-1).tolist()


def prefill(runner, ids: list[int], chunk: int):
    """One prompt through ``runner`` in chunks of ``chunk`` tokens, then released; returns the last logits."""
    from runtime.engines.runner import Chunk

    runner.begin("p", len(ids))
    try:
        out = None
        for start in range(0, len(ids), chunk):
            part = ids[start : start + chunk]
            out = runner.step([], [Chunk("p", part, start, None, start + len(part) == len(ids))])
        return out
    finally:
        runner.release("p")


def prefill_report(runners: dict, args, vocab: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(3, vocab, (args.prefill,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        for r in runners.values():
            prefill(r, ids, args.chunk[0])  # warm-up
        wall: dict[tuple[str, int], list[float]] = {(n, c): [] for n in runners for c in args.chunk}
        for _ in range(args.rounds):
            for name, r in runners.items():
                for c in args.chunk:
                    t0 = time.perf_counter()
                    prefill(r, ids, c)
                    wall[(name, c)].append((time.perf_counter() - t0) * 1e3)
    print(f"\nprefill of {args.prefill} tokens: ms to the first logits, median of {args.rounds} rounds (load {os.getloadavg()[0]:.1f})")
    for (name, c), w in wall.items():
        print(f"  {name:13s} chunk {c:5d}  wall {statistics.median(w):9.1f}  (min {min(w):9.1f})")
    for name, r in runners.items():
        for c in args.chunk:
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                prefill(r, ids, c)
            print_top_ops(prof, f"{name}, chunk {c}: top ops by self CPU time over one prefill", args.top)


def print_top_ops(prof: Any, title: str, top: int) -> None:
    print(f"\n  {title}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48)
    print("\n".join("    " + line for line in table.splitlines()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--steps", type=int, default=10, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--runners", nargs="+", default=["llama", "transformers"])
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--data-dir", default=str(ROOT / ".data"))
    ap.add_argument("--prefill", type=int, default=0, help="time one prompt of this many tokens instead of decode steps")
    ap.add_argument("--chunk", type=int, nargs="+", default=[512], help="prefill chunk sizes (with --prefill)")
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from runtime.model_store import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model, Path(args.data_dir) / "models")
    runners = {name: build(path, name, args.dtype, 4096) for name in args.runners}
    vocab = next(iter(runners.values())).vocab
    print(f"model {path.name}, threads {torch.get_num_threads()}, context {args.context}, load {os.getloadavg()[0]:.1f}", flush=True)
    if args.prefill:
        prefill_report(runners, args, vocab)
        return
    for batch in args.batch:
        rows = {name: filled(r, batch, args.context, vocab) for name, r in runners.items()}
        wall: dict[str, list[float]] = {n: [] for n in runners}
        cpu: dict[str, list[float]] = {n: [] for n in runners}
        with torch.inference_mode():
            for name, r in runners.items():
                step(r, rows[name])  # warm-up
            for _ in range(args.rounds):
                for name, r in runners.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(args.steps):
                        step(r, rows[name])
                    wall[name].append((time.perf_counter() - t0) / args.steps * 1e3)
                    cpu[name].append((time.process_time() - c0) / args.steps * 1e3)
        print(f"\nbatch {batch}: ms per decode step, median of {args.rounds} rounds (load {os.getloadavg()[0]:.1f})")
        base = args.runners[-1]
        for name in runners:
            w, c = statistics.median(wall[name]), statistics.median(cpu[name])
            ratio = statistics.median(wall[base]) / w
            print(f"  {name:13s} wall {w:8.2f}  cpu {c:8.2f}  tok/s {batch * 1e3 / w:8.1f}  speedup vs {base} {ratio:5.2f}×")
        for name, r in runners.items():
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    step(r, rows[name])
            print_top_ops(prof, f"{name}, batch {batch}: top ops by self CPU time over {args.steps} steps", args.top)
        with torch.inference_mode():
            for name, r in runners.items():
                for row in rows[name]:
                    r.release(row.key)


if __name__ == "__main__":
    main()
