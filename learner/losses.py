"""Policy losses (torch): PPO clip with asymmetric and dual clip, KL estimators, loss aggregation modes.

What it does
    Pure functions over token matrices, following verl's ``core_algos.py`` conventions (section numbers are
    ``docs/methods.md``)::

        cfg = LossConfig(clip_high=0.28, kl_coef=0.01)
        loss, stats = policy_loss(logp, old_logp, advantages, mask, cfg, ref_logp=ref_logp)   # (B, T) tensors
        loss.backward()

    * :func:`kl_penalty` — k1/k2/k3 per token (1.2).
    * :func:`aggregate` — ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``,
      ``seq-mean-token-sum-norm`` (1.3).
    * :func:`policy_loss` — the clipped surrogate (1.1) plus ``kl_coef * aggregate(KL)``; the per-token
      surrogate is looked up by ``cfg.loss_type`` in :data:`POLICY_LOSSES` (verl ``register_policy_loss``).

    Gradients flow only through ``logp``: ``old_logp``, ``ref_logp`` and ``advantages`` are detached. The
    KL reference is the base model (the adapter disabled), computed by the trainer; here it is just a tensor.

What it does not do
    No entropy bonus (the trainer reports entropy), no KL-in-reward placement, no advantage computation
    (``learner/advantages.py``), no distributed batch bookkeeping (verl's ``dp_size``/``global_batch_size``).
    Empty masks aggregate to 0 instead of dividing by verl's ``+1e-8``, so ``ratio == 1`` gives exactly
    ``-mean(adv)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "AGG_MODES",
    "POLICY_LOSSES",
    "LossConfig",
    "aggregate",
    "kl_penalty",
    "policy_loss",
    "ppo_clip_token_loss",
    "register_policy_loss",
]

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


@dataclass(frozen=True)
class LossConfig:
    """Policy-loss knobs (PPO clip, KL, aggregation; verl ``actor`` defaults: clip 0.2/0.2, dual clip 3.0, token-mean)."""

    clip_low: float = 0.2  # ratio floor is 1 - clip_low
    clip_high: float = 0.2  # ratio ceiling is 1 + clip_high (DAPO clip-higher: 0.28)
    dual_clip_c: float | None = 3.0  # dual clip for A < 0 (Ye et al. 2019, arXiv 1912.09729); must be > 1; None = off
    kl_coef: float = 0.0  # beta; the KL term needs ref_logp when > 0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    agg: AggMode = "token-mean"
    max_tokens: int | None = None  # the constant L of seq-mean-token-sum-norm; None = mask.shape[-1] (verl)
    loss_type: str = "ppo_clip"  # key into POLICY_LOSSES

    def __post_init__(self) -> None:
        if not (0.0 <= self.clip_low < 1.0) or self.clip_high < 0.0:
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (verl asserts the same), got {self.dual_clip_c}; use None to disable")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.agg not in AGG_MODES:
            raise ValueError(f"agg must be one of {AGG_MODES}, got {self.agg!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimate of ``pi_theta || pi_ref`` (Schulman, "Approximating KL divergence", 2020).

    k1 ``logp - ref``; k2 ``0.5 (logp - ref)^2``; k3 ``exp(ref - logp) - (ref - logp) - 1`` with the log-ratio
    clamped to [-20, 20] and the result to [-10, 10] (verl ``low_var_kl``); k3 >= 0. Shape (B, T) -> (B, T).
    """
    diff = logp - ref_logp  # (B, T)
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        kl = torch.clamp(-diff, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(kl) - kl - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")


def aggregate(loss_mat: Tensor, mask: Tensor, mode: str, max_tokens: int | None = None) -> Tensor:
    """Reduce a (B, T) token loss to a scalar (verl ``agg_loss``); ``mask`` 1 = counted token.

    * ``token-mean``: ``sum_ij L m / sum_ij m`` (DAPO).
    * ``seq-mean-token-mean``: mean over sequences of ``sum_j L m / sum_j m`` (original GRPO).
    * ``seq-mean-token-sum``: mean over sequences of ``sum_j L m``.
    * ``seq-mean-token-sum-norm``: ``sum_i sum_j L m / L_const`` with ``L_const = max_tokens`` or ``T``
      (Dr.GRPO; not divided by the number of sequences, as verl).

    The seq-mean modes skip fully masked rows (as verl); an all-zero mask gives 0.
    """
    m = mask.to(loss_mat.dtype)  # (B, T)
    masked = loss_mat * m
    if mode == "token-mean":
        return masked.sum() / m.sum().clamp_min(1.0)
    tok = m.sum(dim=-1)  # (B,)
    seq_sum = masked.sum(dim=-1)  # (B,)
    if mode == "seq-mean-token-sum-norm":
        return seq_sum.sum() / float(max_tokens if max_tokens is not None else loss_mat.shape[-1])
    rows = (tok > 0).to(loss_mat.dtype)  # (B,) sequences with at least one token
    if mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sum / tok.clamp_min(1.0)
    else:
        raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {AGG_MODES}")
    return (per_seq * rows).sum() / rows.sum().clamp_min(1.0)


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, LossConfig], tuple[Tensor, Tensor, Tensor]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a per-token surrogate ``(ratio, adv, log_ratio, cfg) -> (loss (B,T), clipped (B,T), dual (B,T))``."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES and POLICY_LOSSES[name] is not fn:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


@register_policy_loss("ppo_clip")
def ppo_clip_token_loss(ratio: Tensor, adv: Tensor, log_ratio: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clipped surrogate, negated (Schulman et al. 2017, arXiv 1707.06347; verl ``compute_policy_loss_vanilla``).

    ``pg = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high))``; for ``A < 0`` the dual clip caps it:
    ``pg = min(pg, -A c)``. Returns (loss (B, T), clipped (B, T) bool, dual-clipped (B, T) bool).
    """
    del log_ratio  # part of the registry signature for losses that need it (e.g. sequence-level ratios)
    pg1 = -adv * ratio  # (B, T)
    pg2 = -adv * torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if cfg.dual_clip_c is None:
        return pg, clipped, torch.zeros_like(clipped)
    pg3 = -adv * cfg.dual_clip_c
    neg = adv < 0
    dual = (pg > pg3) & neg
    return torch.where(neg, torch.minimum(pg, pg3), pg), clipped, dual


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    ref_logp: Tensor | None = None,
    token_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """``loss = agg(w * pg) + kl_coef * agg(KL(logp, ref_logp))``.

    ``token_weight`` (B, T), detached, default 1: a per-token weight on the policy-gradient term (AReaL's
    decoupled PPO: ``min(pi_old / pi_behaviour, cap)`` when ``old_logp`` is a recomputed proximal policy).

    Shapes: ``logp``, ``old_logp``, ``ref_logp``, ``mask`` (B, T) with mask 1 = trained token;
    ``advantages`` (B,) per sequence (broadcast over T) or (B, T). ``rho = exp(clamp(logp - old_logp, -20, 20))``.
    Stats: ``loss``, ``pg_loss``, ``kl`` (token mean of the KL estimate when ``ref_logp`` is given, else 0),
    ``kl_loss`` (aggregated, before the coefficient), ``clip_frac`` and ``dual_clip_frac`` (fractions of
    masked tokens), ``ratio_mean`` (masked token mean), ``ppo_kl`` (masked mean of ``old_logp - logp``).
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape or logp.dim() != 2:
        raise ValueError(f"logp, old_logp and mask must share one (B, T) shape, got {logp.shape}, {old_logp.shape}, {mask.shape}")
    if advantages.dim() == 1 and advantages.shape[0] == logp.shape[0]:
        adv = advantages.detach().to(torch.float32).unsqueeze(-1).expand_as(logp)  # (B,) -> (B, T)
    elif advantages.shape == logp.shape:
        adv = advantages.detach().to(torch.float32)
    else:
        raise ValueError(f"advantages must be (B,) or (B, T) for logp {tuple(logp.shape)}, got {tuple(advantages.shape)}")
    if cfg.loss_type not in POLICY_LOSSES:
        raise ValueError(f"unknown loss_type {cfg.loss_type!r}; registered: {sorted(POLICY_LOSSES)}")
    lp = logp.to(torch.float32)  # (B, T); float32 even when the model runs in bf16
    log_ratio = torch.clamp(lp - old_logp.detach().to(torch.float32), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)  # (B, T)
    pg, clipped, dual = POLICY_LOSSES[cfg.loss_type](ratio, adv, log_ratio, cfg)
    if token_weight is not None:
        if token_weight.shape != logp.shape:
            raise ValueError(f"token_weight must have shape {tuple(logp.shape)}, got {tuple(token_weight.shape)}")
        pg = pg * token_weight.detach().to(torch.float32)
    pg_loss = aggregate(pg, mask, cfg.agg, cfg.max_tokens)
    m = mask.to(torch.float32)
    n_tok = m.sum().clamp_min(1.0)

    def tmean(x: Tensor) -> float:
        return float((x.detach().to(torch.float32) * m).sum() / n_tok)

    loss = pg_loss
    kl_mean = 0.0
    kl_loss_value = 0.0
    if ref_logp is not None:
        if ref_logp.shape != logp.shape:
            raise ValueError(f"ref_logp must have shape {tuple(logp.shape)}, got {tuple(ref_logp.shape)}")
        kl = kl_penalty(lp, ref_logp.detach().to(torch.float32), cfg.kl_estimator)  # (B, T)
        kl_loss = aggregate(kl, mask, cfg.agg, cfg.max_tokens)
        kl_mean, kl_loss_value = tmean(kl), float(kl_loss.detach())
        if cfg.kl_coef > 0:
            loss = pg_loss + cfg.kl_coef * kl_loss
    elif cfg.kl_coef > 0:
        raise ValueError("kl_coef > 0 needs ref_logp (the base model's log-probs, adapter disabled)")
    stats = {
        "loss": float(loss.detach()),
        "pg_loss": float(pg_loss.detach()),
        "kl": kl_mean,
        "kl_loss": kl_loss_value,
        "clip_frac": tmean(clipped.to(torch.float32)),
        "dual_clip_frac": tmean(dual.to(torch.float32)),
        "ratio_mean": tmean(ratio),
        "ppo_kl": tmean(-log_ratio),
    }
    return loss, stats
