"""Policy losses: PPO clip (both sides, dual clip), KL estimators, aggregation modes, gradient paths."""

from __future__ import annotations

import math

import pytest
import torch

from learner.losses import POLICY_LOSSES, LossConfig, aggregate, kl_penalty, policy_loss, register_policy_loss


def one_token(ratio: float, adv: float, cfg: LossConfig) -> tuple[float, dict[str, float], float]:
    """Loss, stats and d loss / d logp for a single token with the given ratio and advantage."""
    old = torch.tensor([[-1.0]])
    logp = (old + math.log(ratio)).clone().requires_grad_(True)
    loss, stats = policy_loss(logp, old, torch.tensor([adv]), torch.ones(1, 1), cfg)
    loss.backward()
    assert logp.grad is not None
    return float(loss.detach()), stats, float(logp.grad)


def test_ratio_one_gives_minus_mean_advantage() -> None:
    torch.manual_seed(0)
    logp = torch.randn(4, 6)
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    mask = torch.ones(4, 6)
    loss, stats = policy_loss(logp, logp.clone(), adv, mask, LossConfig())
    assert float(loss) == pytest.approx(-float(adv.mean()), abs=1e-6)
    assert stats["clip_frac"] == 0.0 and stats["dual_clip_frac"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)
    # token-mean with ragged masks weights each sequence by its token count: -(1*6 + -2*2 + 0.5*1 + 3*3) / 12
    mask = torch.tensor([[1.0] * 6, [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]])
    loss, _ = policy_loss(logp, logp.clone(), adv, mask, LossConfig())
    assert float(loss) == pytest.approx(-(6 - 4 + 0.5 + 9) / 12, abs=1e-6)
    # per-token advantages (B, T) are used as given
    adv_bt = torch.randn(4, 6)
    loss, _ = policy_loss(logp, logp.clone(), adv_bt, torch.ones(4, 6), LossConfig())
    assert float(loss) == pytest.approx(-float(adv_bt.mean()), abs=1e-6)


def test_clip_positive_advantage() -> None:
    cfg = LossConfig()
    # A > 0, ratio above 1 + 0.2: clipped to 1.2, no gradient
    loss, stats, grad = one_token(1.5, 1.0, cfg)
    assert loss == pytest.approx(-1.2) and stats["clip_frac"] == 1.0 and grad == 0.0
    # A > 0, ratio below 1 - 0.2: the unclipped term is the minimum, so it is kept and gets the gradient -A * ratio
    loss, stats, grad = one_token(0.5, 1.0, cfg)
    assert loss == pytest.approx(-0.5) and stats["clip_frac"] == 0.0 and grad == pytest.approx(-0.5)
    # asymmetric clip-higher (DAPO): the ceiling moves to 1.28
    loss, _, _ = one_token(1.5, 1.0, LossConfig(clip_high=0.28))
    assert loss == pytest.approx(-1.28)


def test_clip_negative_advantage_and_dual_clip() -> None:
    cfg = LossConfig()
    # A < 0, ratio below 1 - 0.2: clipped at 0.8 -> loss -A * 0.8, no gradient
    loss, stats, grad = one_token(0.5, -1.0, cfg)
    assert loss == pytest.approx(0.8) and stats["clip_frac"] == 1.0 and grad == 0.0
    # A < 0, ratio 1.5 (inside the dual clip): the unclipped term -A * 1.5 is the larger, kept with its gradient
    loss, stats, grad = one_token(1.5, -1.0, cfg)
    assert loss == pytest.approx(1.5) and stats["clip_frac"] == 0.0 and stats["dual_clip_frac"] == 0.0 and grad == pytest.approx(1.5)
    # A < 0, ratio 5 > c = 3: dual clip caps the loss at -A * c = 3, no gradient
    loss, stats, grad = one_token(5.0, -1.0, cfg)
    assert loss == pytest.approx(3.0) and stats["dual_clip_frac"] == 1.0 and grad == 0.0
    # without dual clip the loss grows with the ratio
    loss, stats, grad = one_token(5.0, -1.0, LossConfig(dual_clip_c=None))
    assert loss == pytest.approx(5.0) and stats["dual_clip_frac"] == 0.0 and grad == pytest.approx(5.0)
    # dual clip never touches positive advantages
    loss, stats, _ = one_token(5.0, 1.0, cfg)
    assert loss == pytest.approx(-1.2) and stats["dual_clip_frac"] == 0.0


def test_clip_fraction_counts_masked_tokens_only() -> None:
    old = torch.zeros(2, 3)
    # ratios: row 0 [1.5, 1.0, 1.5(masked)], row 1 [0.5, 1.0, 1.0(masked)]; A = [+1, -1]
    logp = torch.log(torch.tensor([[1.5, 1.0, 1.5], [0.5, 1.0, 1.0]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    _, stats = policy_loss(logp, old, torch.tensor([1.0, -1.0]), mask, LossConfig())
    # clipped: (0,0) ratio 1.5 with A>0 and (1,0) ratio 0.5 with A<0 -> 2 of 4 masked tokens
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 1.0 + 0.5 + 1.0) / 4)
    # pg per token: -1.2, -1, 0.8, 1 -> token-mean -0.1
    assert stats["pg_loss"] == pytest.approx((-1.2 - 1.0 + 0.8 + 1.0) / 4)


def test_kl_estimators_match_their_formulas() -> None:
    torch.manual_seed(1)
    logp, ref = torch.randn(3, 5), torch.randn(3, 5)
    d = logp - ref
    assert torch.allclose(kl_penalty(logp, ref, "k1"), d)
    assert torch.allclose(kl_penalty(logp, ref, "k2"), 0.5 * d * d)
    k3 = kl_penalty(logp, ref, "k3")
    assert torch.allclose(k3, torch.clamp(torch.exp(-d) + d - 1, max=10.0))  # verl clamps k3 at 10
    assert (k3 >= 0).all()
    assert (kl_penalty(logp, logp, "k3") == 0).all()
    # verl's clamps: log-ratio to [-20, 20], result to [-10, 10]
    assert float(kl_penalty(torch.tensor([[0.0]]), torch.tensor([[50.0]]), "k3")) == 10.0
    # hand values: logp - ref = 1 -> k1 1, k2 0.5, k3 e^-1 + 1 - 1
    one, zero = torch.tensor([[1.0]]), torch.tensor([[0.0]])
    assert float(kl_penalty(one, zero, "k2")) == 0.5
    assert float(kl_penalty(one, zero, "k3")) == pytest.approx(math.exp(-1))
    with pytest.raises(ValueError):
        kl_penalty(one, zero, "k4")


def test_kl_term_in_the_loss() -> None:
    torch.manual_seed(2)
    logp, ref = torch.randn(2, 4), torch.randn(2, 4)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    adv = torch.tensor([0.5, -0.5])
    for est in ("k1", "k2", "k3"):
        cfg = LossConfig(kl_coef=0.1, kl_estimator=est)  # type: ignore[arg-type]
        loss, stats = policy_loss(logp, logp.clone(), adv, mask, cfg, ref_logp=ref)
        kl = kl_penalty(logp, ref, est)
        expected_kl = float((kl * mask).sum() / mask.sum())
        assert stats["kl"] == pytest.approx(expected_kl, abs=1e-6)
        assert float(loss) == pytest.approx(stats["pg_loss"] + 0.1 * expected_kl, abs=1e-6)
    # the KL stat is reported even when it is not in the loss
    loss, stats = policy_loss(logp, logp.clone(), adv, mask, LossConfig(), ref_logp=ref)
    assert float(loss) == pytest.approx(stats["pg_loss"]) and stats["kl"] > 0
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp, adv, mask, LossConfig(kl_coef=0.1))


def test_aggregation_modes_on_a_hand_example() -> None:
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 fully masked
    # token-mean: (1 + 2 + 4) / 3 tokens
    assert float(aggregate(loss_mat, mask, "token-mean")) == pytest.approx(7 / 3)
    # seq-mean-token-sum: rows sum to 3 and 4; the empty row is skipped -> 3.5
    assert float(aggregate(loss_mat, mask, "seq-mean-token-sum")) == pytest.approx(3.5)
    # seq-mean-token-mean: row means 1.5 and 4 -> 2.75
    assert float(aggregate(loss_mat, mask, "seq-mean-token-mean")) == pytest.approx(2.75)
    # seq-mean-token-sum-norm: (3 + 4) / T = 7 / 3, or / max_tokens
    assert float(aggregate(loss_mat, mask, "seq-mean-token-sum-norm")) == pytest.approx(7 / 3)
    assert float(aggregate(loss_mat, mask, "seq-mean-token-sum-norm", max_tokens=10)) == pytest.approx(0.7)
    # an all-zero mask aggregates to 0, not NaN
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert float(aggregate(loss_mat, torch.zeros(3, 3), mode)) == 0.0
    with pytest.raises(ValueError):
        aggregate(loss_mat, mask, "sum")


def test_policy_loss_uses_the_configured_aggregation() -> None:
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, 2.0])
    # ratio 1: pg = -A per token -> rows [-1,-1,-1] and [-2]
    cases = {"token-mean": -5 / 4, "seq-mean-token-sum": (-3 - 2) / 2, "seq-mean-token-mean": (-1 - 2) / 2, "seq-mean-token-sum-norm": -5 / 3}
    for mode, expected in cases.items():
        loss, _ = policy_loss(old.clone(), old, adv, mask, LossConfig(agg=mode))  # type: ignore[arg-type]
        assert float(loss) == pytest.approx(expected), mode
    loss, _ = policy_loss(old.clone(), old, adv, mask, LossConfig(agg="seq-mean-token-sum-norm", max_tokens=5))
    assert float(loss) == pytest.approx(-1.0)


def test_gradients_flow_only_through_logp() -> None:
    torch.manual_seed(3)
    logp = torch.randn(3, 4, requires_grad=True)
    old = (logp.detach() + 0.1 * torch.randn(3, 4)).requires_grad_(True)
    ref = torch.randn(3, 4, requires_grad=True)
    adv = torch.randn(3, requires_grad=True)
    mask = torch.ones(3, 4)
    loss, _ = policy_loss(logp, old, adv, mask, LossConfig(kl_coef=0.05), ref_logp=ref)
    loss.backward()
    assert logp.grad is not None and logp.grad.abs().sum() > 0
    assert old.grad is None and ref.grad is None and adv.grad is None
    # masked tokens get no gradient
    logp2 = torch.randn(2, 3, requires_grad=True)
    loss, _ = policy_loss(logp2, logp2.detach(), torch.tensor([1.0, 1.0]), torch.tensor([[1.0, 0, 0], [1, 1, 0]]), LossConfig())
    loss.backward()
    assert logp2.grad is not None and logp2.grad[0, 1:].eq(0).all() and logp2.grad[1, 2] == 0 and logp2.grad[0, 0] != 0


def test_bf16_inputs_and_shape_errors() -> None:
    logp = torch.zeros(2, 3, dtype=torch.bfloat16)
    loss, _ = policy_loss(logp, logp, torch.tensor([1.0, -1.0]), torch.ones(2, 3), LossConfig())
    assert loss.dtype == torch.float32 and float(loss) == 0.0
    with pytest.raises(ValueError):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3), LossConfig())
    with pytest.raises(ValueError):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3), LossConfig())


def test_config_validation_and_registry() -> None:
    with pytest.raises(ValueError, match="dual_clip_c"):
        LossConfig(dual_clip_c=1.0)
    with pytest.raises(ValueError):
        LossConfig(agg="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LossConfig(kl_estimator="k4")  # type: ignore[arg-type]
    assert "ppo_clip" in POLICY_LOSSES
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("ppo_clip")(lambda ratio, adv, log_ratio, cfg: (ratio, ratio > 0, ratio > 0))
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), LossConfig(loss_type="nope"))


def test_token_weight_scales_the_policy_gradient_term() -> None:
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    old = logp.detach().clone()
    mask = torch.ones(2, 2)
    adv = torch.tensor([1.0, -2.0])
    weight = torch.tensor([[1.0, 2.0], [0.5, 0.0]])
    loss, _ = policy_loss(logp, old, adv, mask, LossConfig())
    wloss, _ = policy_loss(logp, old, adv, mask, LossConfig(), token_weight=weight)
    assert float(loss.detach()) == pytest.approx(-(1 + 1 - 2 - 2) / 4)  # ratio 1: -mean(A)
    assert float(wloss.detach()) == pytest.approx(-(1 * 1 + 2 * 1 + 0.5 * -2 + 0 * -2) / 4)
    with pytest.raises(ValueError, match="token_weight"):
        policy_loss(logp, old, adv, mask, LossConfig(), token_weight=torch.ones(2, 3))
