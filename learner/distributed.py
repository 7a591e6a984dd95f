"""Data-parallel learner: ``python -m learner run --nproc N`` (torch.distributed: gloo on CPU, nccl on GPU).

An update's micro-batches are split across the ranks (rank ``r`` takes micro-batches ``r, r + N, ...``);
each rank accumulates the gradients of its share, with the weights ``LoRATrainer`` gives every micro-batch
relative to the *whole* batch, so one all-reduce (sum) of the LoRA gradients leaves every rank with the
gradient one process would have computed; every rank then clips and steps identically. The loss sums
and token counts of the metrics are all-reduced the same way. One rank is exactly today's learner.
The collectives the trainer's step calls (``world``, ``allreduce_grads``, ``allreduce_sums``) are
``learner/collectives.py``; this module joins the process group, starts the ranks and mirrors rank 0's trainer.

Rank 0 is the learner (it reads the store, estimates advantages, checkpoints, publishes, gates and runs
experiments); ranks 1..N-1 are workers that only train. Rank 0's trainer is a :class:`RankZeroTrainer`:
building or resuming it, and each ``step``, is first broadcast to the workers (the samples and their
advantages travel as one pickled object), so every rank runs the same step on the same data.

``launch`` starts the N processes when ``--nproc N`` is given (torchrun's environment: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); a process started by ``torchrun`` itself
is recognised by that environment. Each rank takes ``cpu_count // N`` torch threads on CPU.

Not here: tensor or pipeline parallelism (the LoRA's base model is replicated on every rank), several hosts
(the same environment variables would do, with a reachable ``MASTER_ADDR``; untested here).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from learner.collectives import world

if TYPE_CHECKING:
    from learner.trainer import LoRATrainer

log = structlog.get_logger(__name__)

WAIT_FOREVER = datetime.timedelta(days=365)  # workers wait in a broadcast while rank 0 polls the store for data


def init_from_env() -> tuple[int, int]:
    """Join the process group torchrun's environment describes (when ``WORLD_SIZE`` > 1); (rank, world size)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return 0, 1
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=WAIT_FOREVER)
    log.info("joined the learner's process group", rank=rank, world_size=size, backend=backend)
    return rank, size


def _broadcast(obj: Any = None) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_params(params: Sequence[Any]) -> None:
    """Every rank takes rank 0's values of ``params`` (the LoRA weights after building or resuming)."""
    import torch.distributed as dist

    for p in params:
        dist.broadcast(p.data, src=0)


class RankZeroTrainer:
    """Rank 0's trainer: a ``LoRATrainer`` whose building, resuming and steps are mirrored on every worker."""

    _inner: LoRATrainer  # set in __init__ past this class's __setattr__, which forwards to it

    def __init__(self, base_model: Path, trainer_cfg: Any, lora_cfg: Any) -> None:
        from learner.trainer import LoRATrainer

        _broadcast(("build", str(base_model)))
        object.__setattr__(self, "_inner", LoRATrainer(base_model, trainer_cfg, lora_cfg))

    def load_checkpoint(self, root: Path) -> Path | None:
        _broadcast(("load", str(root)))
        loaded = self._inner.load_checkpoint(root)
        broadcast_params(self._inner.params)
        return loaded

    def step(self, samples: Sequence[Any], advantages: Sequence[float], skipped: Any = None) -> Any:
        stats = getattr(advantages, "stats", None)
        _broadcast(("step", list(samples), list(advantages), stats, dict(skipped or {})))
        return self._inner.step(samples, advantages, skipped=skipped)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


def stop_workers() -> None:
    """Tell the workers to exit (rank 0, once, at its end)."""
    if world()[1] > 1:
        _broadcast(("stop",))


def serve_worker(base_model: Path, trainer_cfg: Any, lora_cfg: Any) -> int:
    """A worker rank (1..N-1): follow rank 0's commands until it says stop (or goes away)."""
    from learner.advantages import Advantages
    from learner.trainer import LoRATrainer

    trainer: LoRATrainer | None = None
    while True:
        try:
            cmd = _broadcast()
        except Exception as exc:  # rank 0 exited or crashed: nothing left to train for
            log.warning("rank 0 is gone; worker exits", error=str(exc))
            return 1
        op = cmd[0]
        if op == "build":
            trainer = LoRATrainer(Path(cmd[1]), trainer_cfg, lora_cfg)
        elif op == "load":
            assert trainer is not None
            trainer.load_checkpoint(Path(cmd[1]))
            broadcast_params(trainer.params)
        elif op == "step":
            assert trainer is not None
            _, samples, values, stats, skipped = cmd
            trainer.step(samples, Advantages(values, stats) if stats is not None else values, skipped=skipped)
        elif op == "stop":
            return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]  # typeshed types the address as Any
        return port


def launch(nproc: int, argv: Sequence[str]) -> int:
    """Run ``python -m learner <argv>`` as ``nproc`` ranks on this host; rank 0's exit status (a failing rank stops the rest)."""
    port = str(_free_port())
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, "-m", "learner", *argv], env=env))

    def forward(sig: int, _frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    old = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            codes = [p.poll() for p in procs]
            if codes[0] is not None or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.2)
        if codes[0] is not None and codes[0] == 0:
            for p in procs[1:]:  # rank 0 finished cleanly and told the workers to stop
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    finally:
        signal.signal(signal.SIGTERM, old)
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (0, None)]
    if failed and procs[0].returncode == 0:
        log.error("learner ranks failed", ranks=failed)
        return 1
    return int(procs[0].returncode or 0)
