"""loopwise's learner vs TRL's ``GRPOTrainer``: same model, LoRA, task, group size and steps, side by side.

    .venv/bin/pip install trl==1.16.0            # not a project dependency: only this benchmark needs it
    .venv/bin/python bench/trl_compare.py --steps 6 --prompts 4 --group 4 --n-eval 100

The task is ``calc_arith`` without the calculator, one operation on operands up to 12 by default
(``--n-ops``, ``--max-operand``: harder settings give SmolLM2 no correct samples, so neither side gets
a learning signal), single turn (TRL's trainer has no agent loop), so
both sides see exactly the same chat prompt (the agent's system prompt + the problem) and the same
reward (the task's verifier on the answer). Per step both sample ``group`` completions (temperature
1.0, at most ``--max-tokens`` tokens) for the same ``prompts`` training problems and take one
optimizer step: LoRA r=8, alpha 16 on all linear layers, AdamW lr ``--lr``, PPO clip 0.2, no KL,
token-mean loss (TRL ``loss_type="dapo"``), group-normalised advantages, fp32 on the CPU, seed 0.

- loopwise: a spawned ``serve.py`` serves SmolLM2 and the agent; rollouts are agent runs (recorded);
  each update is ``LearnerService.update`` (collect → grpo → step → publish → load), and the new
  version serves the next step's rollouts.
- TRL: ``GRPOTrainer`` in this process (``model.generate`` for rollouts), same hyper-parameters.

Measured: wall time of the training loop on each side (rollouts + updates; model loading and server
start excluded and reported apart), and held-out success of base, loopwise's final adapter and TRL's
final adapter, all three evaluated the same way: greedy runs of the same agent on ``--n-eval``
held-out problems through the same server (TRL's adapter is published into the adapter root and
loaded like any version). The two sides run one after the other on this machine, loopwise first.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agents.config import AgentConfig  # noqa: E402
from agents.policies import make_policy  # noqa: E402
from agents.tasks import get_task  # noqa: E402
from bench._rl_harness import add_agent, admin, bench_server, bootstrap_ci, heldout, rollouts, service, write_json  # noqa: E402

TASK = "calc_arith"
OPTIONS: dict = {"use_tools": False}  # plus --n-ops / --max-operand
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def agent_config(name: str, temperature: float, max_tokens: int, family: str | None) -> dict:
    return {
        "name": name,
        "system_prompt": "You are a careful assistant.",
        "temperature": temperature,
        "max_turns": 1,
        "max_tokens_per_turn": max_tokens,
        "task": TASK,
        "task_options": OPTIONS,
        **({"adapter_family": family} if family else {}),
    }


def system_prompt(cfg: dict) -> str:
    c = AgentConfig.model_validate(cfg)
    return f"{c.system_prompt}\n\n{make_policy(c.stop_policy, **c.stop_params).instructions}".strip()


def run_trl(args: argparse.Namespace, model_path: Path, out: Path) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    task = get_task(TASK, **OPTIONS)
    n_train = args.steps * args.prompts
    problems = task.problems(n_train, seed=0)
    system = system_prompt(agent_config("x", 1.0, args.max_tokens, None))
    data = Dataset.from_list(
        [{"prompt": [{"role": "system", "content": system}, {"role": "user", "content": p.prompt}], "idx": i} for i, p in enumerate(problems)]
    )

    def reward(completions: list, idx: list, **_: object) -> list[float]:
        return [task.verify(problems[i], c[0]["content"]).reward for c, i in zip(completions, idx, strict=True)]

    cfg = GRPOConfig(
        output_dir=str(out / "trl-run"),
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        max_steps=args.steps,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
        gradient_checkpointing=False,  # loopwise does not recompute activations either
    )
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=str(model_path),
        reward_funcs=reward,
        args=cfg,
        train_dataset=data,
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"),
    )
    setup_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t1
    adapter = out / "trl-adapter"
    shutil.rmtree(adapter, ignore_errors=True)
    trainer.model.save_pretrained(str(adapter), safe_serialization=True)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"setup_s": setup_s, "train_s": train_s, "train_reward_per_step": rewards, "adapter": adapter}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=4, help="training problems per step")
    p.add_argument("--group", type=int, default=4, help="samples per problem (GRPO group size)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--n-eval", type=int, default=100)
    p.add_argument("--n-ops", type=int, default=1, help="calc_arith operations per problem (1: 'a op b', where SmolLM2 is right sometimes)")
    p.add_argument("--max-operand", type=int, default=12)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "trl_compare")
    args = p.parse_args()
    OPTIONS.update(n_ops=args.n_ops, max_operand=args.max_operand)

    out = args.out
    settings = {
        "family": "lw",
        "lora": {"rank": 8, "alpha": 16.0, "target_modules": TARGETS},
        "trainer": {"lr": args.lr, "estimator": "grpo", "clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.0, "agg": "token-mean"},
        "samples": {"settle_s": 0.0, "max_staleness": 1},
    }
    settings["trainer"].update(threads=None, progress=False, seed=0)
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    with bench_server(args.model, out, max_adapters=4) as (url, key, data, model_path, base):
        add_agent(url, key, agent_config("lw-train", 1.0, args.max_tokens, "lw"))
        add_agent(url, key, agent_config("lw-eval", 0.0, args.max_tokens, None))

        # ---- loopwise
        t0 = time.perf_counter()
        svc = service(url, key, data, model_path, "lw-train", settings)
        svc.state.get_trainer()
        lw_setup = time.perf_counter() - t0
        t1 = time.perf_counter()
        lw_rewards, lw_tokens = [], 0
        for step in range(args.steps):
            runs = rollouts(url, "lw-train", TASK, list(range(step * args.prompts, (step + 1) * args.prompts)), args.group, seed=0)
            lw_rewards.append(sum(r.get("reward") or 0.0 for r in runs) / len(runs))
            lw_tokens += sum(r["completion_tokens"] for r in runs)
            rec = svc.update()
            print(f"loopwise step {step + 1}/{args.steps}: reward {lw_rewards[-1]:.3f}, {rec['gate'].get('new') or rec['gate']}", flush=True)
        lw_train = time.perf_counter() - t1
        lw_final = svc.status.champion
        del svc

        # ---- TRL
        trl = run_trl(args, model_path, out)
        print(f"TRL: {args.steps} steps in {trl['train_s']:.0f} s; rewards {trl['train_reward_per_step']}", flush=True)
        from learner.publish import publish_files

        pub = publish_files(lambda d: shutil.copytree(trl["adapter"], d, dirs_exist_ok=True), data / "adapters", "trl", 1)
        admin(url, key, "POST", "/admin/adapters", json={"path": str(pub.path), "family": "trl", "version": 1, "sha256": pub.manifest_sha256})

        # ---- held-out, all three through the same server and agent (greedy)
        arms = {"base": base, "loopwise": lw_final or base, "trl": "trl@1"}
        success = {name: heldout(url, "lw-eval", TASK, args.n_eval, model) for name, model in arms.items()}
    result.update(
        base=base,
        loopwise={"setup_s": lw_setup, "train_s": lw_train, "train_reward_per_step": lw_rewards, "sampled_tokens": lw_tokens, "final": lw_final},
        trl={k: v for k, v in trl.items() if k != "adapter"},
        heldout_success=success,
        n_eval=args.n_eval,
    )
    write_json(out / "trl_compare.json", result)
    print("\n| side | train wall (s) | setup (s) | held-out success |\n|---|---|---|---|")
    print(f"| base model | - | - | {success['base']:.3f} |")
    print(f"| loopwise | {lw_train:.0f} | {lw_setup:.0f} | {success['loopwise']:.3f} |")
    print(f"| TRL GRPOTrainer | {trl['train_s']:.0f} | {trl['setup_s']:.0f} | {success['trl']:.3f} |")
    print(f"wall ratio loopwise/TRL: {lw_train / trl['train_s']:.2f}; held-out n={args.n_eval}")
    lo, hi = bootstrap_ci([1.0] * round(success["loopwise"] * args.n_eval) + [0.0] * (args.n_eval - round(success["loopwise"] * args.n_eval)))
    print(f"loopwise held-out 95% CI [{lo:.3f}, {hi:.3f}]; results {out / 'trl_compare.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
