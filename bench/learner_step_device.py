"""One learner step's time on this machine's device, for a GPU-vs-CPU ratio with the same model shape and batch.

    .venv/bin/python bench/learner_step_device.py --device cpu --steps 3      # here (2 cores)
    python3 bench/learner_step_device.py --device cuda --steps 10             # on a GPU host

The model is SmolLM2-135M's shape (Llama: 30 layers, hidden 576, 9 heads / 3 KV heads, MLP 1536, vocab
49152) with random weights, so it needs no download and runs on a host that cannot reach a model hub; a
step's cost depends on the shape, not on the weights. The batch is ``--samples`` synthetic turns of
``--context`` prompt tokens and ``--output`` sampled tokens, half with advantage +1 and half −1, and
behaviour logprobs equal to the trainer's own (ratio 1), so every step is a full forward + backward +
AdamW of the LoRA (rank 8 on every linear layer, the learner's default). ``--dtype auto`` is the
learner's rule: bf16 on a CUDA device that supports it, fp32 elsewhere.

Prints one JSON line: the device and dtype, tokens per step, each step's wall time (the first is warm-up
and left out of the median), the median and tokens/s. Not measured here: learning (the weights are random).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SMOLLM2_135M = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    ap.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up step")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--output", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from learner.config import LoRAConfig, TrainerConfig
    from learner.samples import Sample
    from learner.trainer import LoRATrainer

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(tmp)
        cfg = TrainerConfig(device=args.device, dtype=args.dtype, threads=args.threads)
        trainer = LoRATrainer(Path(tmp), cfg, LoRAConfig())
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(args.samples):
        ctx = torch.randint(3, SMOLLM2_135M["vocab_size"], (args.context,), generator=g).tolist()
        out = torch.randint(3, SMOLLM2_135M["vocab_size"], (args.output,), generator=g).tolist()
        samples.append(
            Sample(
                turn_id=f"t{i}",
                trajectory_id=f"j{i}",
                group_id="g0",
                turn_index=0,
                context_ids=ctx,
                output_ids=out,
                logprobs=[],
                loss_mask=[1] * args.output,
                adapter=None,
                adapter_version=0,
                reward=None,
                trajectory_reward=float(i % 2),
                temperature=1.0,
                created_at=time.time(),
            )
        )
    # behaviour logprobs = the trainer's own, so the first step's ratio is 1 (a normal on-policy step)
    own = trainer.token_logprobs(samples)
    samples = [dataclasses.replace(s, logprobs=[float(x) for x in lp]) for s, lp in zip(samples, own, strict=True)]
    adv = [1.0 if i % 2 else -1.0 for i in range(args.samples)]
    times = []
    for _ in range(args.steps + 1):
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = trainer.step(samples, adv)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        assert m.optimizer_step, "the step must run the optimizer"
    timed = times[1:] or times
    tokens = args.samples * (args.context + args.output)
    med = statistics.median(timed)
    print(
        json.dumps(
            {
                "device": str(trainer.device),
                "device_name": torch.cuda.get_device_name(0) if trainer.device.type == "cuda" else platform.processor() or platform.machine(),
                "dtype": str(trainer.dtype),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "samples": args.samples,
                "tokens_per_step": tokens,
                "step_s": [round(t, 4) for t in times],
                "median_step_s": round(med, 4),
                "tokens_per_s": round(tokens / med, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
