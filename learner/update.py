"""One learner update as data flowing through it: samples → advantages → loss and step → checkpoint → publish.

    adv = estimate(samples, "grpo")                                   # the estimator stage (learner.advantages)
    metrics = trainer.step(samples, adv, skipped=counts)              # the loss and the optimizer step (learner.trainer)
    published = checkpoint_and_publish(trainer, ckpt_root, adapter_root, family, admin=admin)   # checkpoint first, then publish + load

or, for the common case, ``metrics, adv = update(trainer, samples)`` (estimate + step with the trainer's
configured estimator). Every trainer of the project goes through these functions: the learner process
(``learner/service.py``, with RTPO's reverse sweep and TCPO's counterfactual step in
``learner/rollout_steps.py``, their re-rollouts planned in ``learner/rerollout.py``, its versions published by
``learner/release.py``) and the memory copilot's trainer (``experiments/memory_train.py``).
``checkpoint_and_publish`` is the one place a trainer's weights become ``family@version``; the learner's update
checkpoints every version it trains (published or held during an experiment), so its release passes
``ckpt_root=None`` for a version whose checkpoint is written already.

The order is a rule, not a convention: the checkpoint of version N is written before ``family@N`` is
published, so a learner killed in between resumes at N and never publishes a second, different N
(``learner/trainer.py``, checkpoints).

Not here: which samples (``learner.samples``), the estimator formulas (``learner.advantages``), the loss
(``learner.losses``), gates and A/B (``learner.service``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from learner.advantages import Advantages, compute_advantages
from learner.publish import PublishedAdapter, RuntimeAdmin, publish_adapter
from learner.samples import Sample

if TYPE_CHECKING:
    from learner.config import TrainerConfig
    from learner.trainer import StepMetrics

__all__ = ["Trainer", "checkpoint_and_publish", "estimate", "update"]


class Trainer(Protocol):
    """What the update, the publish path and the learner service use of a trainer: ``learner.trainer.LoRATrainer``, or
    ``learner.distributed.RankZeroTrainer`` (rank 0 of ``--nproc N``, which mirrors one on every worker)."""

    cfg: TrainerConfig
    version: int  # the version its weights are (advanced by every optimizer step)
    cursor: dict[str, Any]  # the data cursor and the learner's bookkeeping, saved in every checkpoint
    model: Any  # the peft model: what ``publish_adapter`` saves

    def step(self, samples: Sequence[Sample], advantages: Sequence[float], skipped: Mapping[str, int] | None = None) -> StepMetrics: ...

    def save_checkpoint(self, root: Path) -> Path: ...

    def load_checkpoint(self, root: Path) -> Path | None: ...

    def restart_from(self, lora_state: Mapping[str, Any] | None) -> None: ...


def estimate(samples: Sequence[Sample], estimator: str, params: Mapping[str, Any] | None = None) -> Advantages:
    """One advantage per sample (same order) from the registered ``estimator`` (``learner.advantages``); ``.stats`` rides along."""
    if not samples:
        return compute_advantages(estimator, [])
    return compute_advantages(estimator, [s.to_turn_sample() for s in samples], **dict(params or {}))


def update(
    trainer: Trainer, samples: Sequence[Sample], *, skipped: Mapping[str, int] | None = None, params: Mapping[str, Any] | None = None
) -> tuple[StepMetrics, Advantages]:
    """``estimate`` with the trainer's configured estimator (``params`` replaces its ``estimator_params``), then ``trainer.step``."""
    cfg = trainer.cfg
    adv = estimate(samples, cfg.estimator, cfg.estimator_params if params is None else params)
    return trainer.step(samples, adv, skipped=skipped), adv


def checkpoint_and_publish(
    trainer: Trainer,
    ckpt_root: Path | None,
    adapter_root: Path,
    family: str,
    *,
    meta: Mapping[str, Any] | None = None,
    admin: RuntimeAdmin | None = None,
    alias: bool = False,
) -> PublishedAdapter:
    """Checkpoint the trainer's version (into ``ckpt_root``; None: its checkpoint is written already), then publish it as
    ``family@version`` and (with ``admin``) load it into the runtime."""
    if ckpt_root is not None:
        trainer.save_checkpoint(ckpt_root)
    published = publish_adapter(trainer.model, adapter_root, family, trainer.version, meta=dict(meta or {}))
    if admin is not None:
        admin.load(published.path, family, trainer.version, sha256=published.manifest_sha256, alias=alias)
    return published
