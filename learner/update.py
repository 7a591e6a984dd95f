"""One learner update as data flowing through it: samples → advantages → loss and step → checkpoint → publish.

    adv = estimate(samples, "grpo")                                   # the estimator stage (learner.advantages)
    metrics = trainer.step(samples, adv, skipped=counts)              # the loss and the optimizer step (learner.trainer)
    published = checkpoint_and_publish(trainer, ckpt_root, adapter_root, family, admin=admin)   # checkpoint first, then publish + load

or, for the common case, ``metrics, adv = update(trainer, samples)`` (estimate + step with the trainer's
configured estimator). Every trainer of the project goes through these functions: the learner process
(``learner/service.py``, with RTPO's reverse sweep and TCPO's counterfactual step in
``learner/rollout_steps.py``, their re-rollouts planned in ``learner/rerollout.py``) and the memory copilot's
trainer (``experiments/memory_train.py``).

The order is a rule, not a convention: the checkpoint of version N is written before ``family@N`` is
published, so a learner killed in between resumes at N and never publishes a second, different N
(``learner/trainer.py``, checkpoints).

Not here: which samples (``learner.samples``), the estimator formulas (``learner.advantages``), the loss
(``learner.losses``), gates and A/B (``learner.service``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from learner.advantages import Advantages, compute_advantages
from learner.publish import PublishedAdapter, RuntimeAdmin, publish_adapter
from learner.samples import Sample, to_turn_samples

if TYPE_CHECKING:
    from learner.trainer import LoRATrainer, StepMetrics

__all__ = ["checkpoint_and_publish", "estimate", "update"]


def estimate(samples: Sequence[Sample], estimator: str, params: Mapping[str, Any] | None = None) -> Advantages:
    """One advantage per sample (same order) from the registered ``estimator`` (``learner.advantages``); ``.stats`` rides along."""
    if not samples:
        return compute_advantages(estimator, [])
    return compute_advantages(estimator, to_turn_samples(samples), **dict(params or {}))


def update(
    trainer: LoRATrainer, samples: Sequence[Sample], *, skipped: Mapping[str, int] | None = None, params: Mapping[str, Any] | None = None
) -> tuple[StepMetrics, Advantages]:
    """``estimate`` with the trainer's configured estimator (``params`` replaces its ``estimator_params``), then ``trainer.step``."""
    cfg = trainer.cfg
    adv = estimate(samples, cfg.estimator, cfg.estimator_params if params is None else params)
    return trainer.step(samples, adv, skipped=skipped), adv


def checkpoint_and_publish(
    trainer: LoRATrainer,
    ckpt_root: Path,
    adapter_root: Path,
    family: str,
    *,
    meta: Mapping[str, Any] | None = None,
    admin: RuntimeAdmin | None = None,
    alias: bool = False,
) -> PublishedAdapter:
    """Checkpoint the trainer's version, then publish it as ``family@version`` and (with ``admin``) load it into the runtime."""
    trainer.save_checkpoint(ckpt_root)
    published = publish_adapter(trainer.model, adapter_root, family, trainer.version, meta=dict(meta or {}))
    if admin is not None:
        admin.load(published.path, family, trainer.version, sha256=published.manifest_sha256, alias=alias)
    return published
