"""The data-parallel learner (``learner/distributed.py``): two gloo ranks on CPU give the LoRA weights and the
metrics one process gives after the same update (micro-batches split across ranks, gradients summed)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from learner.trainer import LoRATrainer
from learner.update import update
from tests.learner.test_trainer import LORA, cfg, make_samples

ROOT = Path(__file__).resolve().parents[2]

# one rank of a process group: build the trainer, run the learner pipeline's update on the samples, rank 0 saves
RANK_SCRIPT = """
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from learner.distributed import init_from_env
from learner.trainer import LoRATrainer
from learner.update import update
from tests.learner.test_trainer import LORA, cfg, make_samples
rank, size = init_from_env()
kw = json.loads(sys.argv[3])
trainer = LoRATrainer(Path(sys.argv[1]), cfg(**kw), LORA)
samples = make_samples(1, n_groups=4, per_group=3)
metrics, _ = update(trainer, samples)
if rank == 0:
    save_file(trainer.lora_state(), sys.argv[2])
    Path(sys.argv[2] + ".json").write_text(json.dumps(metrics.as_dict()))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(n: int, model: Path, out: Path, kw: dict) -> None:
    port = str(_free_port())
    procs = []
    for rank in range(n):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK_SCRIPT, str(model), str(out), json.dumps(kw)], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
            )
        )
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]


def test_two_ranks_give_one_rank_update(tiny_model_path: Path, tmp_path: Path) -> None:
    kw = {"micro_batch_tokens": 64, "epochs": 2, "old_logprobs": "recompute"}  # ~5 micro-batches, and the old policy per micro-batch
    one = LoRATrainer(tiny_model_path, cfg(**kw), LORA)
    init = {k: v.clone() for k, v in one.lora_state().items()}
    samples = make_samples(1, n_groups=4, per_group=3)
    m1, _ = update(one, samples)
    ref = one.lora_state()
    out = tmp_path / "rank0.safetensors"
    _ranks(2, tiny_model_path, out, kw)
    two = load_file(out)
    m2 = json.loads(Path(str(out) + ".json").read_text())
    assert m1.optimizer_step and m2["optimizer_step"]
    assert set(two) == set(ref)
    moved = max(float((ref[k] - init[k]).abs().max()) for k in ref)
    diff = max(float((ref[k] - two[k]).abs().max()) for k in ref)
    assert moved > 1e-3  # the update really moved the LoRA
    assert diff <= 1e-5 * max(1.0, moved) + 1e-6, (diff, moved)  # summation order only
    assert m2["tokens"] == m1.tokens and m2["trained_samples"] == m1.trained_samples
    assert m2["loss"] == pytest.approx(m1.loss, rel=1e-4, abs=1e-6)
    assert m2["entropy"] == pytest.approx(m1.entropy, rel=1e-4)
    assert m2["grad_norm"] == pytest.approx(m1.grad_norm, rel=1e-4)
