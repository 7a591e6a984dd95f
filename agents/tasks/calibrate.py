"""Quick difficulty calibration of a single-answer task with a local chat model, no tools, plain transformers.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m agents.tasks.calibrate --model .data/models/SmolLM2-135M-Instruct \\
        --task calc_arith --n 50 --setting n_ops=1 --setting n_ops=2 --setting "" --temperature 0 --batch 10

(``--setting ""`` is the task's defaults. On a busy, shared CPU, ``OMP_NUM_THREADS=1`` was much faster here than
torch's default two threads, which stalled batched generation while other processes competed for the cores.)

Each ``--setting`` is a comma-separated list of task options (``n_ops=2,max_operand=20``); calc_arith
gets ``use_tools=False`` added so its prompt does not ask for a tool the model cannot call here. The
script prints the success rate per setting and temperature, and ``--json`` writes the figures as JSON.

What this script does not do: no tool calls and no multi-turn episodes (the agent loop's evaluation
CLI does that), no serving runtime; it imports torch and transformers only when run.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import structlog

from . import get_task

log = structlog.get_logger(__name__)


def _parse_setting(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, raw = part.partition("=")
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            try:
                value = int(raw)
            except ValueError:
                value = raw
        out[key.strip()] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a local Hugging Face model folder")
    ap.add_argument("--task", default="calc_arith")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--setting", action="append", default=None, help="task options, e.g. n_ops=2,max_operand=20 (repeatable)")
    ap.add_argument("--temperature", type=float, action="append", default=None, help="0 = greedy (repeatable)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch  # heavy imports only when the script runs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    results = []
    for setting_text in args.setting or [""]:
        options = _parse_setting(setting_text)
        if args.task == "calc_arith":
            options.setdefault("use_tools", False)
        task = get_task(args.task, **options)
        problems = task.problems(args.n, seed=args.seed)
        for temperature in args.temperature or [0.0]:
            t0 = time.monotonic()
            correct = 0
            for start in range(0, len(problems), args.batch):
                chunk = problems[start : start + args.batch]
                texts = [tok.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=False, add_generation_prompt=True) for p in chunk]
                enc = tok(texts, return_tensors="pt", padding=True)
                gen_kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "pad_token_id": tok.pad_token_id}
                gen_kwargs |= {"do_sample": True, "temperature": temperature, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
                with torch.no_grad():
                    out = model.generate(**enc, **gen_kwargs)
                for p, row in zip(chunk, out[:, enc["input_ids"].shape[1] :], strict=True):
                    reply = str(tok.decode(row, skip_special_tokens=True))
                    verdict = task.verify(p, reply)
                    correct += verdict.correct
                    log.debug("calibrate.reply", problem=p.id, correct=verdict.correct, detail=verdict.detail, reply=reply[-200:])
            rate = correct / max(1, len(problems))
            row_out = {"task": args.task, "options": options, "temperature": temperature, "n": len(problems), "correct": correct, "rate": rate}
            row_out["seconds"] = round(time.monotonic() - t0, 1)
            results.append(row_out)
            print(f"{args.task} {options} T={temperature}: {correct}/{len(problems)} = {rate:.0%} ({row_out['seconds']} s)", flush=True)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
