"""LoRATrainer on the tiny model: which parameters one step moves, logprobs against generation, the
zero-variance rule, micro-batch equivalence, the KL path, checkpoints, and a learner killed mid-update
(a real subprocess, SIGKILL) that resumes exactly and never uses a half-written checkpoint or adapter."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from learner.config import LoRAConfig, TrainerConfig
from learner.samples import Sample
from learner.trainer import LORA_FILE, LoRATrainer, iter_lora_parameters, list_checkpoints, plan_micro_batches, read_checkpoint_meta
from learner.update import update

ROOT = Path(__file__).resolve().parents[2]
LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def step(trainer: LoRATrainer, samples: list[Sample]):
    """The learner's pipeline on ``samples``: the configured estimator's advantages, then one trainer step."""
    return update(trainer, samples)[0]


def cfg(**kw) -> TrainerConfig:
    # the recorded behaviour logprobs as the old policy unless a test says otherwise: the PPO ratio these tests compute by hand
    base = dict(threads=1, progress=False, lr=1e-2, seed=0, micro_batch_tokens=4096, old_logprobs="behaviour", autocast="off")
    return TrainerConfig(**{**base, **kw})


def make_samples(seed: int, *, rewards: list[float] | None = None, n_groups: int = 2, per_group: int = 2) -> list[Sample]:
    """Deterministic per-turn samples for the tiny model (vocab 2000); no recorded logprobs (ratio 1)."""
    rng = random.Random(seed)
    rewards = rewards or [float(i % 2) for i in range(n_groups * per_group)]
    out = []
    for k, r in enumerate(rewards):
        ctx = [rng.randrange(3, 2000) for _ in range(rng.randrange(6, 20))]
        n = rng.randrange(3, 9)
        out.append(
            Sample(
                turn_id=f"t{seed}-{k}",
                trajectory_id=f"tr{seed}-{k}",
                group_id=f"g{seed}-{k // per_group}",
                turn_index=0,
                context_ids=ctx,
                output_ids=[rng.randrange(3, 2000) for _ in range(n)],
                logprobs=[],
                loss_mask=[1] * n,
                adapter=None,
                adapter_version=0,
                reward=None,
                trajectory_reward=r,
                temperature=1.0,
                created_at=0.0,
            )
        )
    return out


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_path(tiny_model_path: Path) -> Path:
    return tiny_model_path


def snapshot(trainer: LoRATrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_one_step_moves_lora_only(model_path: Path) -> None:
    tr = LoRATrainer(model_path, cfg(), LORA)
    before = snapshot(tr)
    lora_names = {n for n, _ in iter_lora_parameters(tr.model)}
    assert lora_names and all(("lora_A" in n) or ("lora_B" in n) for n in lora_names)
    assert {n for n, p in tr.model.named_parameters() if p.requires_grad} == lora_names
    m = step(tr, make_samples(1))
    assert m.optimizer_step and m.version == 1 and m.trained_samples == 4
    after = snapshot(tr)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed, "nothing moved"
    assert changed <= lora_names, f"base parameters moved: {sorted(changed - lora_names)[:5]}"
    # LoRA starts with B = 0, so dL/dA = s·Bᵀ(dL/dy)xᵀ is exactly 0 on the first step: every B moves, no A can
    assert {n for n in lora_names if "lora_B" in n} == changed
    step(tr, make_samples(2))
    final = snapshot(tr)
    assert {n for n in lora_names if not torch.equal(before[n], final[n])} == lora_names  # every LoRA parameter moved
    assert all(torch.equal(before[n], final[n]) for n in before if n not in lora_names)
    assert m.grad_norm > 0 and m.tokens > 0 and m.tokens_per_s > 0
    assert m.reward_std > 0 and m.frac_reward_zero_std == 0.0


def generate_turn(model: torch.nn.Module, context: list[int], n: int, temperature: float) -> tuple[list[int], list[float]]:
    """A turn the way an engine records it: greedy tokens, logprobs of log_softmax(logits / T)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([context]), max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    ids = out.sequences[0, len(context) :].tolist()
    lps = [float(torch.log_softmax(lg[0].float() / temperature, -1)[t]) for lg, t in zip(out.logits, ids)]
    return ids, lps


def test_logprobs_match_generation_and_base_for_a_fresh_adapter(model_path: Path) -> None:
    tr = LoRATrainer(model_path, cfg(micro_batch_tokens=64), LORA)
    rng = random.Random(7)
    samples = []
    for k, temperature in enumerate([1.0, 0.7, 1.0]):
        ctx = [rng.randrange(3, 2000) for _ in range(5 + 7 * k)]  # different lengths → left padding in a shared micro-batch
        with tr.model.disable_adapter():
            ids, lps = generate_turn(tr.model, ctx, 6, temperature)
        samples.append(replace(make_samples(k)[0], context_ids=ctx, output_ids=ids, logprobs=lps, loss_mask=[1] * 6, temperature=temperature))
    assert len(plan_micro_batches([len(s.context_ids) + 6 for s in samples], 64)) < len(samples)  # some rows share a padded batch
    with_adapter = tr.token_logprobs(samples)
    base = tr.token_logprobs(samples, adapter=False)
    for s, a, b in zip(samples, with_adapter, base):
        assert len(a) == len(s.output_ids)
        assert a == pytest.approx(b, abs=1e-6)  # B = 0: the adapter adds exactly nothing
        assert a == pytest.approx(s.logprobs, abs=1e-4)  # and the teacher-forced logprobs are the engine's
    # a direct single-row forward pass agrees too (off-by-one check without padding)
    s = samples[1]
    with torch.no_grad():
        logits = tr.model(torch.tensor([s.context_ids + s.output_ids])).logits[0].float() / s.temperature
    direct = [float(torch.log_softmax(logits[len(s.context_ids) + j - 1], -1)[t]) for j, t in enumerate(s.output_ids)]
    assert with_adapter[1] == pytest.approx(direct, abs=1e-5)


def test_zero_variance_batch_skips_the_optimizer_and_keeps_the_version(model_path: Path) -> None:
    # a version is a set of weights: an update that changed none makes none (the staleness bound counts versions)
    tr = LoRATrainer(model_path, cfg(), LORA, version=5)
    before = snapshot(tr)
    m = step(tr, make_samples(3, rewards=[1.0, 1.0, 0.0, 0.0]))  # each group has equal rewards
    assert (m.optimizer_step, m.version, tr.version, tr.optimizer_steps) == (False, 5, 5, 0)
    assert m.frac_reward_zero_std == 1.0 and m.trained_samples == 0 and m.skipped["zero_advantage"] == 4
    assert all(torch.equal(before[n], p) for n, p in tr.model.named_parameters())
    assert tr.optimizer.state_dict()["state"] == {}  # AdamW never stepped
    empty = step(tr, [])
    assert (empty.optimizer_step, empty.version) == (False, 5)


def test_micro_batching_and_activation_checkpointing_give_the_same_update(model_path: Path) -> None:
    samples = make_samples(4, n_groups=3, per_group=2)
    results = []
    for tokens, ckpt in ((4096, False), (64, False), (64, True)):
        tr = LoRATrainer(model_path, cfg(micro_batch_tokens=tokens, activation_checkpointing=ckpt), LORA)
        m = step(tr, samples)
        results.append((m, tr.lora_state()))
    (m_big, w_big), *others = results
    assert len(plan_micro_batches([len(s.context_ids) + len(s.output_ids) for s in samples], 64)) > 1
    for m_small, w_small in others:
        assert m_big.loss == pytest.approx(m_small.loss, rel=1e-5, abs=1e-7)
        assert m_big.grad_norm == pytest.approx(m_small.grad_norm, rel=1e-4)
        for k in w_big:
            torch.testing.assert_close(w_big[k], w_small[k], rtol=1e-4, atol=1e-6)


def test_epochs_take_several_optimizer_steps_on_one_batch_against_the_first_old_logprobs(model_path: Path) -> None:
    samples = make_samples(7, n_groups=2, per_group=2)
    one = LoRATrainer(model_path, cfg(lr=0.05), LORA)
    m1 = step(one, samples)
    three = LoRATrainer(model_path, cfg(lr=0.05, epochs=3, micro_batch_tokens=64), LORA)
    m3 = step(three, samples)
    assert (m3.version, three.version, three.optimizer_steps) == (1, 1, 3)  # one published version, three AdamW steps
    assert (m1.version, one.optimizer_steps) == (1, 1)
    assert m1.clip_frac == 0.0  # the first pass is its own old policy: ratio 1
    assert m3.clip_frac > 0.0  # later epochs are measured against the first pass's logprobs, so the clip bites
    moved1 = sum(float((a - b).abs().sum()) for a, b in zip(one.lora_state().values(), LoRATrainer(model_path, cfg(), LORA).lora_state().values()))
    moved3 = sum(float((a - b).abs().sum()) for a, b in zip(three.lora_state().values(), LoRATrainer(model_path, cfg(), LORA).lora_state().values()))
    assert moved3 > moved1 > 0
    assert m3.tokens_per_s > 0 and m3.trained_samples == m1.trained_samples


def test_recomputed_old_logprobs_keep_stale_turns_from_being_clipped_away(model_path: Path) -> None:
    """Turns sampled by an older version (behaviour logprobs 2 nats below the trainer's): with the recorded
    logprobs as the old policy the clip zeroes most of the gradient; 'recompute' trains on them at ratio 1,
    and behaviour_weight_cap weighs each token by min(pi_old / pi_behaviour, cap)."""
    fresh = make_samples(11, n_groups=2, per_group=2)
    own = LoRATrainer(model_path, cfg(), LORA).token_logprobs(fresh)
    stale = [replace(s, logprobs=[x - 2.0 for x in lp]) for s, lp in zip(fresh, own, strict=True)]
    behaviour = step(LoRATrainer(model_path, cfg(), LORA), stale)
    assert behaviour.clip_frac > 0.4  # ratio e^2 > 1.2 on every token; only the negative-advantage ones are unclipped
    plain = LoRATrainer(model_path, cfg(), LORA)
    m_plain = step(plain, fresh)
    recompute = LoRATrainer(model_path, cfg(old_logprobs="recompute", behaviour_weight_cap=None), LORA)
    m_re = step(recompute, stale)
    assert m_re.clip_frac == 0.0 and m_re.loss == pytest.approx(m_plain.loss, abs=1e-7)
    for k, w in plain.lora_state().items():
        torch.testing.assert_close(recompute.lora_state()[k], w)  # the same update as on-policy turns
    capped = step(LoRATrainer(model_path, cfg(old_logprobs="recompute", behaviour_weight_cap=3.0), LORA), stale)
    assert capped.loss == pytest.approx(3.0 * m_plain.loss, rel=1e-5)  # every weight e^2 = 7.4, capped at 3
    with pytest.raises(ValueError, match="needs old_logprobs"):
        cfg(behaviour_weight_cap=2.0)


def test_autocast_auto_is_bf16_only_on_a_cpu_with_native_bf16_where_it_measures_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    from learner import trainer as tm

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    probed: list[tuple[int, int]] = []

    def speedup(value: float):
        def probe(width: int, inner: int) -> float:
            probed.append((width, inner))
            return value

        return probe

    monkeypatch.setattr(tm, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(tm, "bf16_autocast_speedup", speedup(2.6))  # an EPYC with AVX512-BF16 measured 2.6x on a step
    assert tm.pick_autocast("auto", cpu, torch.float32, 960, 2560) and not tm.pick_autocast("auto", cpu, torch.bfloat16)
    assert probed == [(960, 2560)]  # at the model's shapes; a bf16 model or CUDA is never probed
    assert not tm.pick_autocast("auto", cuda, torch.float32) and not tm.pick_autocast("off", cpu, torch.float32)
    monkeypatch.setattr(tm, "bf16_autocast_speedup", speedup(0.64))  # a Xeon VM without AMX: autocast is slower there
    assert not tm.pick_autocast("auto", cpu, torch.float32) and tm.pick_autocast("bfloat16", cpu, torch.float32)
    monkeypatch.setattr(tm, "bf16_autocast_speedup", speedup(1.1))  # within noise of fp32: not worth the rounding
    assert not tm.pick_autocast("auto", cpu, torch.float32)
    monkeypatch.setattr(tm, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(tm, "bf16_autocast_speedup", speedup(9.0))
    n = len(probed)
    assert not tm.pick_autocast("auto", cpu, torch.float32) and tm.pick_autocast("bfloat16", cpu, torch.float32)
    assert len(probed) == n  # no native bf16: no probe


def test_the_autocast_probe_times_the_same_work_both_ways() -> None:
    # the real probe on this CPU: a positive finite ratio, cached (the second call does not time again)
    from learner import trainer as tm

    first = tm.bf16_autocast_speedup(64, 128, tokens=32, reps=1)
    assert 0 < first < float("inf") and tm.bf16_autocast_speedup(64, 128, tokens=32, reps=1) == first


def test_reward_stats_are_per_trajectory_outcomes_not_turn_process_scores(model_path: Path) -> None:
    tr = LoRATrainer(model_path, cfg(), LORA)
    samples = make_samples(8, rewards=[1.0, 0.0, 1.0, 1.0])
    samples = [replace(s, reward=0.0) for s in samples]  # a task's per-turn process scores, all 0 here
    samples.append(replace(samples[0], turn_id="t-extra", turn_index=1))  # a second turn of trajectory 0 counts once
    m = step(tr, samples)
    assert m.reward_mean == pytest.approx(0.75) and m.reward_std == pytest.approx(0.4330127, rel=1e-6)


def test_plan_micro_batches_bounds_padded_tokens() -> None:
    lengths = [10, 50, 20, 20, 200, 5]
    plan = plan_micro_batches(lengths, 60)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    for b in plan:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 60
    assert [4] in plan  # longer than the budget: alone


def test_kl_to_the_base_uses_the_disabled_adapter(model_path: Path) -> None:
    tr = LoRATrainer(model_path, cfg(kl_coef=0.1), LORA)
    first = step(tr, make_samples(5))
    assert first.kl == pytest.approx(0.0, abs=1e-9)  # B = 0: policy == base
    second = step(tr, make_samples(6))
    assert second.kl > 0 and "kl_loss" in second.loss_stats


def test_zero_advantage_samples_stay_in_the_kl_term(model_path: Path) -> None:
    # group 0 has equal rewards (advantage 0), group 1 has spread: with a KL term the zero-advantage samples still
    # carry its gradient (they pull toward the base), so they are not filtered out of the forward pass
    samples = make_samples(7, rewards=[1.0, 1.0, 0.0, 1.0])
    with_kl = step(LoRATrainer(model_path, cfg(kl_coef=0.1), LORA), samples)
    assert with_kl.trained_samples == 4 and with_kl.skipped["zero_advantage"] == 0
    without = step(LoRATrainer(model_path, cfg(), LORA), samples)
    assert without.trained_samples == 2 and without.skipped["zero_advantage"] == 2


def test_drgrpo_sets_its_constant_normalised_aggregation() -> None:
    # Dr.GRPO is the std-free advantage *and* seq-mean-token-sum-norm (Liu et al. 2025)
    assert TrainerConfig(estimator="drgrpo", max_tokens=128).agg == "seq-mean-token-sum-norm"
    assert TrainerConfig(estimator="drgrpo", agg="token-mean").agg == "token-mean"  # an explicit choice stays
    assert TrainerConfig(estimator="grpo").agg == "token-mean"
    with pytest.raises(ValueError, match="max_tokens"):
        TrainerConfig(estimator="drgrpo")  # the constant L must be given


def test_resume_uses_the_checkpoints_lora_shape(model_path: Path, tmp_path: Path) -> None:
    tr = LoRATrainer(model_path, cfg(), LORA)
    step(tr, make_samples(21))
    step(tr, make_samples(22))  # B != 0 now, so alpha / rank scales the output
    tr.save_checkpoint(tmp_path)
    probe = make_samples(23)
    want = tr.token_logprobs(probe)
    # configured with another alpha (and rank): the saved adapter is resumed as it was trained, not re-scaled
    other = LoRATrainer(model_path, cfg(), LoRAConfig(rank=8, alpha=64.0, target_modules=LORA.target_modules))
    other.load_checkpoint(tmp_path)
    assert other.lora_cfg == LORA and other.version == 2
    got = other.token_logprobs(probe)
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    step(other, make_samples(24))  # and it trains on: optimizer rebuilt for the checkpoint's parameters


def test_checkpoint_round_trip_and_damaged_checkpoint_skipped(model_path: Path, tmp_path: Path) -> None:
    tr = LoRATrainer(model_path, cfg(keep_checkpoints=3), LORA)
    for i in range(2):
        step(tr, make_samples(10 + i))
        tr.cursor = {"since": 100.0 + i}
        tr.save_checkpoint(tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000001", "ckpt-00000002"]
    fresh = LoRATrainer(model_path, cfg(), LORA)
    assert fresh.load_checkpoint(tmp_path) == tmp_path / "ckpt-00000002"
    assert (fresh.version, fresh.optimizer_steps, fresh.cursor) == (2, 2, {"since": 101.0})
    for k, v in tr.lora_state().items():
        assert torch.equal(v, fresh.lora_state()[k])
    a, b = tr.optimizer.state_dict(), fresh.optimizer.state_dict()
    for pid, st in a["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[key], b["state"][pid][key])
    assert fresh.scheduler.state_dict()["last_epoch"] == tr.scheduler.state_dict()["last_epoch"]
    # flip a byte of the newest checkpoint's weights: it is refused and the previous one is used
    weights = tmp_path / "ckpt-00000002" / LORA_FILE
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    again = LoRATrainer(model_path, cfg(), LORA)
    assert again.load_checkpoint(tmp_path) == tmp_path / "ckpt-00000001"
    assert again.version == 1 and again.cursor == {"since": 100.0}


def learn(model: Path, ckpt: Path, adapters: Path, steps: int, hang_at: int = 0) -> LoRATrainer:
    """The learner loop of the kill test: resume, publish a checkpointed-but-unpublished version, then
    step → checkpoint → publish (checkpoint first, so a version is never published twice). With
    ``hang_at`` the checkpoint save of that version stops after its weights file is written."""
    import learner.trainer as T
    from learner.publish import adapter_path, clean_staging, publish_adapter

    clean_staging(adapters)
    tr = T.LoRATrainer(model, cfg(keep_checkpoints=2), LORA)
    tr.load_checkpoint(ckpt)
    print("START", tr.version, json.dumps(tr.cursor), flush=True)
    if tr.version and not adapter_path(adapters, "fam", tr.version).exists():
        publish_adapter(tr.model, adapters, "fam", tr.version)
    real_save = T.save_file

    def save_then_hang(tensors, path, *a, **k):
        real_save(tensors, path, *a, **k)
        if tr.version == hang_at:
            print("HANG", tr.version, flush=True)
            time.sleep(600)

    T.save_file = save_then_hang
    try:
        while tr.version < steps:
            i = int(tr.cursor.get("since", 0))
            print("STEP", tr.version + 1, flush=True)
            step(tr, make_samples(100 + i))
            tr.cursor = {"since": float(i + 1)}
            tr.save_checkpoint(ckpt)
            publish_adapter(tr.model, adapters, "fam", tr.version)
            print("DONE", tr.version, flush=True)
    finally:
        T.save_file = real_save
    return tr


SCRIPT = """
import sys
from pathlib import Path
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from test_trainer import learn
learn(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
"""


def run_until(proc: subprocess.Popen, marker: str, timeout: float = 120) -> list[str]:
    lines = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.startswith(marker):
            return lines
    raise AssertionError(f"never saw {marker!r}; got {lines}; stderr: {proc.stderr.read() if proc.stderr else ''}")


def test_learner_killed_mid_update_resumes_exactly(model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.adapters.validation import validate_adapter

    script = tmp_path / "learn.py"
    script.write_text(SCRIPT.format(root=str(ROOT), tests=str(Path(__file__).parent)))
    ckpt, adapters, steps = tmp_path / "ckpt", tmp_path / "adapters", 4
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def start(hang_at: int) -> subprocess.Popen:
        cmd = [sys.executable, str(script), str(model_path), str(ckpt), str(adapters), str(steps), str(hang_at)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)

    first = start(hang_at=3)
    try:
        lines = run_until(first, "HANG")  # step 3 done, its checkpoint half-written
        os.kill(first.pid, signal.SIGKILL)
    finally:
        first.kill()
        first.wait()
    assert "DONE 2" in lines and "DONE 3" not in lines
    assert [p.name for p in list_checkpoints(ckpt)] == ["ckpt-00000001", "ckpt-00000002"]
    leftovers = [p.name for p in ckpt.iterdir() if p.name.startswith(".tmp-ckpt-00000003")]
    assert leftovers, "the killed save left no temp folder (was it really killed mid-save?)"
    assert not (adapters / "fam" / "v3").exists()

    # restart (in this process, from the files the killed one left): it resumes from the last complete checkpoint
    resumed = learn(model_path, ckpt, adapters, steps)
    out = capsys.readouterr().out
    assert 'START 2 {"since": 2.0}' in out.splitlines(), out
    assert "DONE 4" in out.splitlines()
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp-")]
    assert [p.name for p in list_checkpoints(ckpt)] == ["ckpt-00000003", "ckpt-00000004"]

    # an uninterrupted run in this process ends in the same weights and optimizer state
    ref = LoRATrainer(model_path, cfg(keep_checkpoints=2), LORA)
    for i in range(steps):
        step(ref, make_samples(100 + i))
    reloaded = LoRATrainer(model_path, cfg(), LORA)
    reloaded.load_checkpoint(ckpt)
    assert reloaded.version == steps and resumed.cursor == {"since": float(steps)}
    for k, v in ref.lora_state().items():
        torch.testing.assert_close(resumed.lora_state()[k], v, rtol=0, atol=1e-6)
        assert torch.equal(reloaded.lora_state()[k], resumed.lora_state()[k])
    ref_opt, res_opt = ref.optimizer.state_dict()["state"], reloaded.optimizer.state_dict()["state"]
    for pid in ref_opt:
        torch.testing.assert_close(res_opt[pid]["exp_avg_sq"], ref_opt[pid]["exp_avg_sq"], rtol=0, atol=1e-9)
        assert torch.equal(res_opt[pid]["step"], ref_opt[pid]["step"])
    assert read_checkpoint_meta(ckpt / "ckpt-00000004")["optimizer_steps"] == steps

    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_path))
    shapes = {n: (int(m.out_features), int(m.in_features)) for n, m in base.named_modules() if n and hasattr(m, "in_features")}
    published = sorted(p.name for p in (adapters / "fam").iterdir())
    assert published == ["v1", "v2", "v3", "v4"]
    for v in published:
        validate_adapter(adapters / "fam" / v, base_shapes=shapes, max_rank=8, adapter_root=adapters)
    assert not list((adapters / ".staging").iterdir())
    manifest = json.loads((adapters / "fam" / "v4" / "manifest.json").read_text())
    assert manifest["version"] == 4 and "adapter_model.safetensors" in manifest["files"]
