"""The learner's step in fp32 vs under bf16 autocast (fp32 master weights), same samples, side by side.

    .venv/bin/python bench/learner_step.py                  # SmolLM2, 8 turns of 96 new tokens, 3 rounds
    .venv/bin/python bench/learner_step.py --model tiny --rounds 1

The samples are real turns: the embedded engine (``--engine-dtype``, default its ``auto``) samples
``--turns`` completions at temperature 1 with logprobs, and each becomes one ``Sample`` (context = the
templated prompt, output = the completion, behaviour logprobs = the engine's). Two ``LoRATrainer`` s
with the same seed (so the same LoRA init) are built: ``autocast="off"`` and ``autocast="bfloat16"``.

Measured:
- parity before any step: per output token, |logprob under autocast − logprob in fp32| (mean, max),
  and each trainer's |logprob − the engine's recorded logprob|; and the first step's clip fraction
  (the share of tokens whose ratio to the behaviour logprob is outside the clip while the policy is
  still the one that sampled them, up to the engine's own rounding);
- speed: wall and process CPU seconds of one ``trainer.step`` (forward, backward, AdamW), rounds
  alternating between the two, so load from other processes hits both alike; the median per side
  and the ratio fp32 / autocast.

Not here: GPU (autocast there is the ``dtype`` setting's job), convergence over many steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOPICS = ["a lighthouse keeper", "a robot learning to paint", "the last train home", "a city under the sea"]


async def sample_turns(model_path: Path, n: int, new_tokens: int, dtype: str) -> tuple[list, str]:
    from learner.samples import Sample
    from runtime.engine import GenerateRequest, SamplingParams
    from runtime.engines.embedded import EmbeddedEngine

    eng = EmbeddedEngine(model_path, model_id="bench", dtype=dtype)
    await eng.start()
    try:
        tok = eng.tokenizer
        reqs = []
        for i in range(n):
            msgs = [{"role": "user", "content": f"Write a story about {TOPICS[i % len(TOPICS)]}, part {i}."}]
            ids = tuple(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)["input_ids"])
            sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=i, ignore_eos=True, logprobs=True)
            reqs.append(GenerateRequest(f"r{i}", ids, sp))
        results = await asyncio.gather(*(eng.generate(r) for r in reqs))
        engine_dtype = eng.info.dtype
    finally:
        await eng.close()
    samples = []
    for i, (req, res) in enumerate(zip(reqs, results, strict=True)):
        samples.append(
            Sample(
                turn_id=f"t{i}",
                trajectory_id=f"tr{i}",
                group_id=f"g{i // 2}",
                turn_index=0,
                context_ids=list(req.input_ids),
                output_ids=list(res.output_ids),
                logprobs=[lp.logprob for lp in res.logprobs],
                loss_mask=[1] * len(res.output_ids),
                adapter=None,
                adapter_version=0,
                reward=None,
                trajectory_reward=float(i % 2),
                temperature=1.0,
                created_at=0.0,
            )
        )
    return samples, engine_dtype


def diffs(a: list[list[float]], b: list[list[float]]) -> dict:
    d = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return {"mean": round(statistics.fmean(d), 4), "max": round(max(d), 4), "tokens": len(d)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training (the learner's default: 1)")
    ap.add_argument("--engine-dtype", default="auto")
    ap.add_argument("--data-dir", default=str(ROOT / ".data"))
    args = ap.parse_args()

    import torch

    from learner.config import LoRAConfig, TrainerConfig
    from learner.trainer import LoRATrainer
    from learner.update import estimate
    from runtime.model_store import resolve_model

    model_path = resolve_model(args.model, Path(args.data_dir) / "models")
    samples, engine_dtype = asyncio.run(sample_turns(model_path, args.turns, args.new_tokens, args.engine_dtype))
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]
    print(
        f"model {model_path.name}, {len(samples)} turns, engine {engine_dtype}, cpu bf16: {isa or 'none'}, load {os.getloadavg()[0]:.1f}", flush=True
    )

    lora = LoRAConfig(rank=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    base = dict(threads=args.threads, progress=False, lr=1e-5, seed=0, micro_batch_tokens=4096)
    trainers = {mode: LoRATrainer(model_path, TrainerConfig(**base, autocast=mode), lora) for mode in ("off", "bfloat16")}
    engine_lp = [s.logprobs for s in samples]
    lps = {mode: tr.token_logprobs(samples) for mode, tr in trainers.items()}
    parity = {
        "autocast_vs_fp32": diffs(lps["bfloat16"], lps["off"]),
        "fp32_vs_engine": diffs(lps["off"], engine_lp),
        "autocast_vs_engine": diffs(lps["bfloat16"], engine_lp),
    }
    for k, v in parity.items():
        print(f"|Δ logprob| {k:20s} mean {v['mean']:.4f}  max {v['max']:.4f}  over {v['tokens']} tokens", flush=True)

    adv = estimate(samples, "grpo")
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in trainers}
    clip: dict[str, list[float]] = {m: [] for m in trainers}
    for rnd in range(args.rounds):
        order = list(trainers) if rnd % 2 == 0 else list(reversed(trainers))
        for mode in order:
            w0, c0 = time.perf_counter(), time.process_time()
            m = trainers[mode].step(samples, adv)
            times[mode].append((time.perf_counter() - w0, time.process_time() - c0))
            clip[mode].append(m.clip_frac)
            print(
                f"round {rnd + 1} {mode:9s} step {times[mode][-1][0]:.2f}s wall {times[mode][-1][1]:.2f}s cpu  clip_frac {m.clip_frac:.4f}  load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    wall = {m: statistics.median(t[0] for t in ts) for m, ts in times.items()}
    cpu = {m: statistics.median(t[1] for t in ts) for m, ts in times.items()}
    print(
        f"\nstep (median of {args.rounds}): fp32 {wall['off']:.2f}s wall / {cpu['off']:.2f}s cpu, autocast bf16 {wall['bfloat16']:.2f}s / {cpu['bfloat16']:.2f}s"
    )
    print(
        f"fp32 ÷ autocast: wall {wall['off'] / wall['bfloat16']:.2f}×, cpu {cpu['off'] / cpu['bfloat16']:.2f}×;  first-step clip_frac fp32 {clip['off'][0]:.4f}, autocast {clip['bfloat16'][0]:.4f}"
    )
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "model": str(model_path),
        "engine_dtype": engine_dtype,
        "cpu_bf16": isa,
        "threads": args.threads,
        "parity": parity,
        "step_s": times,
        "clip_frac": clip,
        "torch": torch.__version__,
    }
    (out / "learner_step.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
