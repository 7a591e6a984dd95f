"""The learner's configuration: LoRA shape, trainer knobs and sample selection (frozen pydantic models).

``LearnerSettings`` bundles them (plus ``TrafficFilter``, ``SingletonConfig``, ``RerolloutConfig``,
``LeapConfig``, ``ParityConfig``, ``PatrConfig`` with the ``rollouts`` switch, and ``RodsConfig``); each
component gets only its own part (``LoRAConfig`` and ``TrainerConfig`` go to ``learner.trainer.LoRATrainer``, ``SampleConfig`` to
``learner.samples.collect_samples``). Every field has a description and a default meant for a
small model on a shared CPU; validation fails at construction, before any model is loaded, and says
what to set instead.

``ScheduleConfig`` is the process's own part: when to update (the scheduler's thresholds) and how a version is
released (gate size and tolerance, the A/B experiment's sample bounds); the learner's command line and the
root settings' ``[learner]`` section (``loopwise_settings.py``) are built from it, and ``check_ab_bounds`` is the one
rule on the A/B bounds they share.

Not here: the server's other settings (``runtime/settings.py``, ``loopwise_settings.py``), the scheduler itself, the
eval gate or A/B policy.
Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ESTIMATORS = ("grpo", "drgrpo", "rloo", "gigpo", "turn_grpo", "rtpo", "tcpo", "rank")
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[AggMode, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

_FROZEN = ConfigDict(frozen=True, extra="forbid")
# the runtime's own evaluators first (clients cannot send verifier:*, judge:* or hook:* rewards), then users' feedback, then the rest
DEFAULT_REWARD_SOURCES = ("verifier:*", "judge:*", "hook:*", "*")


class LoRAConfig(BaseModel):
    """The adapter's shape: what ``peft.LoraConfig`` gets (plain LoRA only: what the runtime serves)."""

    model_config = _FROZEN
    rank: int = Field(8, ge=1, le=256, description="LoRA rank r (must not exceed the server's max LoRA rank)")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the LoRA input during training (0 keeps steps deterministic)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="names (suffixes) of the base model's linear layers that get a LoRA pair",
    )


class TrainerConfig(BaseModel):
    """Optimizer, loss and resource knobs of one learner update step."""

    model_config = _FROZEN
    lr: float = Field(
        1e-4,
        gt=0,
        description=(
            "AdamW learning rate (LoRA tolerates more than full fine-tuning). Live chat feedback is noisy: in a 60-minute "
            "live-traffic run 1e-3 on SmolLM2-135M made the model worse (held-out -14.5 points); 1e-3 suits the demo's "
            "verifier-rewarded groups of 8 (learner/demo.toml)"
        ),
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up over this many optimizer steps, then constant")
    max_grad_norm: float = Field(1.0, gt=0, description="clip the LoRA gradients' global norm to this")
    micro_batch_tokens: int = Field(
        2048,
        ge=64,
        description="padded tokens (rows x longest context+output) per forward pass; bounds activation memory, gradients accumulate",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass: a fraction of the activation memory for ~30% more compute"
    )
    pack_prefixes: bool = Field(
        True,
        description=(
            "forward each distinct token prefix of a micro-batch once (learner/packing.py: a group's shared context, a "
            "trajectory's earlier turns, a common system prompt), with a tree attention mask; the same logprobs as one row "
            "per sample, fewer positions. Llama/Qwen-style models under sdpa or eager attention; others use one row per sample"
        ),
    )
    epochs: int = Field(
        1,
        ge=1,
        le=16,
        description="optimizer steps per update over the same batch (PPO epochs); the clip on the ratio to the behaviour logprobs bounds the drift",
    )
    old_logprobs: Literal["behaviour", "recompute"] = Field(
        "behaviour",
        description=(
            "the PPO ratio's old policy: 'behaviour' = the recorded sampling logprobs; 'recompute' = the trainer's own "
            "logprobs at the start of the update (verl's recomputed old_log_prob; AReaL's proximal policy), so turns "
            "sampled by an older version (an A/B champion, a stale arm) are not clipped away"
        ),
    )
    behaviour_weight_cap: float | None = Field(
        None,
        gt=0,
        description=(
            "with old_logprobs='recompute': weight each token by min(pi_old / pi_behaviour, cap) (AReaL's decoupled PPO "
            "importance weight, correcting for who sampled it); None = no weight"
        ),
    )
    estimator: str = Field(
        "grpo",
        description=(
            f"advantage estimator, one of {', '.join(ESTIMATORS)} (read by the pipeline, learner/update.py, before the step); "
            "drgrpo also sets agg = seq-mean-token-sum-norm unless agg is given"
        ),
    )
    estimator_params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the estimator (e.g. eps, gamma)")
    drop_zero_advantage: bool = Field(
        True, description="leave samples whose advantage is exactly 0 out of the forward pass (DAPO-style filter; saves compute)"
    )
    clip_low: float = Field(0.2, ge=0, description="PPO clip below 1 (ratio >= 1 - clip_low)")
    clip_high: float = Field(0.2, ge=0, description="PPO clip above 1 (ratio <= 1 + clip_high); 0.28 = DAPO clip-higher")
    dual_clip_c: float = Field(3.0, gt=1, description="dual-clip constant for negative advantages")
    kl_coef: float = Field(0.0, ge=0, description="KL-to-base coefficient; > 0 runs a second forward pass with the adapter disabled")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="per-token KL estimator (Schulman's k1/k2/k3)")
    agg: AggMode = Field("token-mean", description=f"loss aggregation, one of {', '.join(AGG_MODES)}")
    max_tokens: int | None = Field(None, ge=1, description="the constant L of seq-mean-token-sum-norm (Dr.GRPO); required for that mode")
    seed: int = Field(0, description="seeds LoRA init, dropout and the RNGs saved in checkpoints")
    threads: int | None = Field(1, ge=1, description="torch CPU threads for training (None = torch's default); keep low so serving keeps its cores")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="base weights dtype; auto = bf16 on a GPU that supports it, else fp32")
    autocast: Literal["auto", "off", "bfloat16"] = Field(
        "auto",
        description=(
            "run the forward's matmuls in bf16 under torch.autocast while the weights (the LoRA master weights included) stay in "
            "dtype; auto = bfloat16 when dtype is fp32 on a CPU with native bf16 matmuls (AMX or AVX512-BF16) where a start-up "
            "probe times them faster than fp32 by 1.2x or more (a step ran 2.6x faster on one such CPU and 0.64x as fast on "
            "another: bench/learner_step.py), else off"
        ),
    )
    device: str = Field("auto", description="torch device; auto = cuda when available, else cpu")
    progress: bool = Field(True, description="show a tqdm bar over the micro-batches of a step")
    keep_checkpoints: int = Field(2, ge=1, description="how many checkpoints to keep (older ones are deleted after a new one is complete)")

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, v: str) -> str:
        if v not in ESTIMATORS:
            raise ValueError(f"unknown estimator {v!r}; choose one of {', '.join(ESTIMATORS)}")
        return v

    @field_validator("agg", mode="before")  # before the Literal's own check, for this message
    @classmethod
    def _known_agg(cls, v: Any) -> Any:
        if v not in AGG_MODES:
            raise ValueError(f"unknown loss aggregation {v!r}; choose one of {', '.join(AGG_MODES)}")
        return v

    @model_validator(mode="after")
    def _weight_needs_recompute(self) -> TrainerConfig:
        if self.behaviour_weight_cap is not None and self.old_logprobs != "recompute":
            raise ValueError("behaviour_weight_cap weighs tokens by pi_old / pi_behaviour: it needs old_logprobs = 'recompute'")
        return self

    @model_validator(mode="before")
    @classmethod
    def _drgrpo_aggregation(cls, data: Any) -> Any:
        """Dr.GRPO is two changes (Liu et al. 2025, arXiv 2503.20783): no std in the advantage *and* the constant-normalised sum; the
        estimator brings the first, so it also sets the aggregation unless ``agg`` is given explicitly."""
        if isinstance(data, dict) and data.get("estimator") == "drgrpo" and "agg" not in data:
            return {**data, "agg": "seq-mean-token-sum-norm"}
        return data

    @model_validator(mode="after")
    def _norm_needs_constant(self) -> TrainerConfig:
        if self.agg == "seq-mean-token-sum-norm" and self.max_tokens is None:
            raise ValueError("agg='seq-mean-token-sum-norm' (Dr.GRPO) divides by a fixed constant: set max_tokens (e.g. the max response length)")
        return self


class SampleConfig(BaseModel):
    """Which recorded turns become training samples (see ``learner/samples.py``)."""

    model_config = _FROZEN
    max_staleness: int = Field(
        2,
        ge=0,
        description=(
            "skip trajectories with a turn produced by a version older than the one the trainer reached max_staleness updates ago "
            "(updates counted whether published or held during an A/B experiment; the base model is version 0)"
        ),
    )
    settle_s: float = Field(
        120.0,
        ge=0,
        description="a trajectory is taken only once its last turn is this old, so late turns and rewards arrive first; later rewards are not used",
    )
    max_trajectories: int | None = Field(
        None,
        ge=1,
        description=(
            "most trajectories one update trains on; when traffic outpaces training, whole groups are kept, largest "
            "first (a group cut by the settle window is smaller; bigger groups give better baselines), then newest, "
            "and the rest are skipped as 'surplus' (freshness over backlog); None = take everything"
        ),
    )
    include_other_families: bool = Field(False, description="also train on turns another adapter family produced (off-policy; counted either way)")
    reward_sources: list[str] = Field(
        default_factory=lambda: list(DEFAULT_REWARD_SOURCES),
        min_length=1,
        description=(
            "which reward sources train, in precedence order (shell patterns, fnmatch): for each turn and trajectory the newest "
            "reward of the first matching pattern counts, and within one group every member is scored by the group's best "
            "source (members that only have a lower one lose that reward), so a verifier's rewards and a user's are never "
            "compared; sources matching no pattern are ignored. Default: the runtime's verifiers, then its judges, then "
            "the learner's reward hooks, then every other source alike (users' feedback, whatever source name the client gives it)"
        ),
    )
    owners: tuple[str, ...] | None = Field(
        None,
        description=(
            "train only on trajectories these owners made (key-<hash> of an API key, 'public' on an open server, 'admin' for "
            "runs through the admin API); None = every owner"
        ),
    )
    max_owner_share: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description=(
            "the largest share of one update's trajectories (and of an A/B arm's evidence, for the learner's experiments) one "
            "owner (API key) may make up; with K owners present the bound is max(max_owner_share, 1/K), so a lone owner is "
            "never cut. An owner over it keeps its oldest trajectories up to the bound, the rest are skipped as 'owner_share'. "
            "1.0 = no bound"
        ),
    )

    @field_validator("reward_sources")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        if any(not isinstance(p, str) or not p.strip() for p in v) or len(set(v)) != len(v):
            raise ValueError("reward_sources must be distinct, non-empty source patterns (e.g. 'verifier:*', 'feedback')")
        return v


class TrafficFilter(BaseModel):
    """Which recorded traffic this learner trains on (``[traffic]``); several learners use disjoint filters.

    A trajectory is this learner's when it passes every field that is set: its kind (an agent's run, or plain chat
    traffic: a request to the base model or an adapter), its agent, the API key that made it (``owners``, in
    ``[samples]``), the model name the client asked for, and the tag the client sent (``metadata.tag`` of a chat
    completion). Turns outside the filter are counted as ``other_traffic``."""

    model_config = _FROZEN
    chat: bool = Field(True, description="train on plain chat traffic (requests that named no agent)")
    agents: list[str] | None = Field(None, description="train on these agents' runs; None = every agent's, [] = no agent's")
    models: list[str] | None = Field(
        None, description="only requests that asked for one of these model names (base name, alias, family@N); None = any"
    )
    tags: list[str] | None = Field(None, description="only requests whose client tag (chat metadata 'tag') is one of these; None = any")


class SingletonConfig(BaseModel):
    """What a group of one trajectory (a one-off prompt: live chat rarely repeats one) learns from (``[singletons]``).

    - ``baseline``: REINFORCE with a running baseline per key (agent or ``chat``, the client's tag, the reward source,
      and the owner once it has ``baseline_owner_min`` rewards):
      ``A = (x - m) / s`` with ``m`` and ``s`` the key's exponentially weighted mean and std of the rewards seen
      *before* this one (``learner/baseline.py`` states the rule, its variance and its bias).
    - ``complete``: group completion by re-rollout: the learner samples ``group_size - 1`` siblings from the exact
      recorded context of a one-off conversation's last rated turn through the runtime and scores the whole group with
      ``scorer`` (``learner/group_completion.py``); a group whose scorer ranks the original against its user's label
      (``label_threshold``: a thumbs-up below the group's mean, a thumbs-down above it) is skipped. A multi-turn
      conversation's earlier turns, and the one-off conversations it does not complete (failed or contradicted ones,
      beyond ``max_turns_per_update``), get the baseline.
    - ``drop``: a singleton gets advantage 0 (the estimators' own rule: a lone reward carries no relative signal).
    """

    model_config = _FROZEN
    mode: Literal["baseline", "complete", "drop"] = Field("baseline", description="baseline | complete | drop (see the class docstring)")
    baseline_decay: float = Field(
        0.98, ge=0.0, lt=1.0, description="baseline: the running mean's decay (plain average over the first 1/(1-decay) rewards, then EMA)"
    )
    baseline_norm_by_std: bool = Field(True, description="baseline: divide by the running std once it is positive (GRPO's scale)")
    baseline_std_floor: float = Field(
        0.1, gt=0.0, description="baseline: the running std is taken as at least this (a key whose rewards barely vary would blow up A)"
    )
    baseline_clip: float = Field(
        3.0, gt=0.0, description="baseline: |A| is clipped to this (biased where it bites: a reward over 3 running stds out; learner/baseline.py)"
    )
    baseline_per_owner: bool = Field(
        True,
        description=(
            "baseline: one running baseline per owner (API key) under each key, so an owner's rating habit (lenient, strict, "
            "random) is not read as the reply's quality; the pooled key's baseline until the owner has baseline_owner_min rewards"
        ),
    )
    baseline_owner_min: int = Field(
        8, ge=1, le=10_000, description="baseline: an owner's own baseline is used from this many of its rewards on (before: the pooled one)"
    )
    group_size: int = Field(4, ge=2, le=16, description="complete: G, the group size; G-1 siblings are sampled per completed turn")
    max_turns_per_update: int = Field(16, ge=1, le=1024, description="complete: most one-off conversations completed per update (newest first)")
    scorer: Literal["hook", "judge"] = Field("hook", description="complete: who scores the group: the reward hook or an LLM judge")
    hook: str | None = Field(
        None,
        description=(
            "complete with scorer 'hook': an http(s) URL (POSTed {messages, completions}, answers {scores}) or 'module:function' "
            "(called with messages, completions; returns one float per completion); rewards are recorded as source learner:hook:<name>"
        ),
    )
    judge_model: str | None = Field(
        None,
        description="complete with scorer 'judge': a model the runtime serves (base name, alias, family@N) that scores the whole group in one call",
    )
    judge_rubric: str = Field(
        "Score how well each candidate answers the user: correct, helpful and concise.",
        max_length=4000,
        description="judge: the rubric the judge is given (RULER-style relative scoring of the group)",
    )
    timeout_s: float = Field(120.0, gt=0, description="complete: seconds one sibling request, hook call or judge call may take")
    label_threshold: float = Field(
        0.5,
        allow_inf_nan=False,
        description=(
            "complete: a user's reward on the original above this is a thumbs-up, below it a thumbs-down, equal to it no label "
            "(0.5 reads 0/1 and -1/+1 thumbs; 3 reads 1-5 stars); a group whose scorer ranks a thumbs-up original below the "
            "group's mean, or a thumbs-down one above it, is skipped"
        ),
    )

    @model_validator(mode="after")
    def _scorer_named(self) -> SingletonConfig:
        if self.mode == "complete" and self.scorer == "hook" and not self.hook:
            raise ValueError("[singletons] mode = 'complete' with scorer = 'hook' needs hook = 'https://...' or 'module:function'")
        if self.mode == "complete" and self.scorer == "judge" and not self.judge_model:
            raise ValueError("[singletons] mode = 'complete' with scorer = 'judge' needs judge_model (a model the runtime serves)")
        if self.hook and not (self.hook.startswith(("http://", "https://")) or ":" in self.hook):
            raise ValueError(f"hook must be an http(s) URL or 'module:function', got {self.hook!r}")
        return self


class ParityConfig(BaseModel):
    """The logprob parity probe after each load (``learner/parity.py``): served vs trainer logprobs on recorded turns,
    decoded greedily, at a sampled turn's recorded temperature and under a constrained turn's grammar; RTPO's
    intermediate versions are probed too."""

    model_config = _FROZEN
    enabled: bool = Field(True, description="score a fixed probe of recorded turns with the served version and the trainer after every load")
    turns: int = Field(
        4,
        ge=1,
        le=64,
        description=(
            "greedy turns in the probe (the same ones every time, chosen at the first probe), plus one turn sampled at a "
            "temperature other than 1 and one constrained turn once the trained turns have them"
        ),
    )
    max_tokens: int = Field(16, ge=1, le=256, description="output tokens decoded for each probe turn and compared")
    threshold: float = Field(
        0.1,
        gt=0,
        description="refuse the version when the mean absolute logprob difference (nats per token) of any kind of probe turn exceeds this",
    )


class RerolloutConfig(BaseModel):
    """Re-rollouts from stored contexts (``learner/rerollout.py``): RTPO sparse reverse trees, TCPO counterfactuals.

    Used only when the estimator is ``rtpo`` or ``tcpo`` and the learner trains one agent whose runs name
    task problems (the branches run through that agent's runs endpoint, with its verifier)."""

    model_config = _FROZEN
    enabled: bool = Field(True, description="re-roll for rtpo/tcpo; off = rtpo is trajectory GRPO and tcpo has no counterfactuals")
    branches: int = Field(2, ge=0, le=16, description="RTPO: branch turns K per backbone trajectory (uniform over its turns 1..T-1)")
    siblings: int = Field(2, ge=1, le=16, description="RTPO: sibling continuations m sampled at each branch turn, each rolled to the end")
    bucket_size: int = Field(1, ge=1, description="RTPO: turns per bucket of the reverse sweep (one optimizer step per bucket)")
    refresh: bool = Field(
        True, description="RTPO: publish each bucket's update before the next bucket's siblings, so they continue with the just-updated policy"
    )
    cf_top_q: float = Field(0.2, ge=0.0, le=1.0, description="TCPO: counterfactuals for this top fraction of turns by surprisal")
    cf_threshold: float | None = Field(None, ge=0.0, description="TCPO: counterfactuals for turns whose surprisal exceeds this (overrides cf_top_q)")
    cf_samples: int = Field(2, ge=1, le=16, description="TCPO: alternatives M per selected turn (one step each, scored by the verifier)")
    concurrency: int = Field(8, ge=1, le=64, description="branch runs in flight at once")


class LeapConfig(BaseModel):
    """LEAP's data engine inside the learner (``learner/leap_expand.py``): before each update, probe the next problems of
    the agent's kernel task with one-turn runs, prune them with DCP (``learner/leap_dcp.py``) and expand the useful ones
    into multi-turn episodes; the update trains on the episodes once they settle (``settle_s``). Pair with
    ``estimator = "rank"`` and the task's ``reward = "rank"``."""

    model_config = _FROZEN
    enabled: bool = Field(False, description="probe, prune and expand kernel problems before every update (needs the learner's agent)")
    problems_per_update: int = Field(4, ge=1, le=256, description="problems probed per update (problem indices advance over updates)")
    group: int = Field(4, ge=2, le=32, description="G: probes and expansion episodes per problem")
    max_turns: int = Field(4, ge=1, le=16, description="turns of an expansion episode")
    p_hi: float = Field(1.0, gt=0, le=1, description="DCP: share correct for 'simple'")
    s_hi: float = Field(1.0, gt=0, description="DCP: median speedup among the correct for 'simple'")
    seed: int = Field(0, ge=0, description="problem seed of the probed problems")


class SVRConfig(BaseModel):
    """SVR training (``learner/svr_rewards.py``): per-turn rewards from each turn's stored self-check, for the agent
    whose stop policy is ``svr``; pair with ``estimator = "turn_grpo"`` and ``estimator_params = {source = "reward"}``
    (advantages per turn index across the group). Optionally the learner makes its own fixed-horizon training runs."""

    model_config = _FROZEN
    enabled: bool = Field(False, description="score the agent's turns with the SVR turn reward (replaces the verifier's outcome)")
    tau: float = Field(
        0.7,
        ge=0.0,
        le=1.0,
        description="the stop threshold of the served agent (its stop_params.tau): stop-ready means Correct with confidence >= tau",
    )
    w_c: float = Field(1.0, ge=0.0, description="weight of correctness c_t (the verifier on the turn's answer)")
    w_v: float = Field(0.5, ge=0.0, description="weight of calibration-aware self-verification 1 - (q_t - c_t)^2, q_t the stated P(correct)")
    w_s: float = Field(
        0.5, ge=0.0, description="weight of the stop-ready term: +b when the agent would stop on a right answer, -b_wrong on a wrong one"
    )
    b: float = Field(1.0, ge=0.0, description="stop-ready bonus (the agent would stop, and the answer is right)")
    b_wrong: float = Field(1.0, ge=0.0, description="wrong-stop penalty (the agent would stop, and the answer is wrong)")
    format_penalty: float = Field(
        0.5, ge=0.0, description="subtracted from an unparsable turn's reward (which then has no verification or stop term)"
    )
    fixed_horizon_only: bool = Field(True, description="train only on fixed-horizon training runs (meta horizon); false also trains on adaptive runs")
    problems_per_update: int = Field(
        0,
        ge=0,
        le=256,
        description="before each update the learner runs this many training problems x group fixed-horizon runs itself (0 = only runs others made)",
    )
    group: int = Field(4, ge=2, le=32, description="fixed-horizon runs per problem (the GRPO group)")
    horizon: int = Field(3, ge=1, le=16, description="turns of a fixed-horizon training run")
    seed: int = Field(0, ge=0, description="problem seed of the training problems (the eval gate uses its own held-out seed)")


class SVRR1Config(BaseModel):
    """SVR-R1 training rewards (``learner/svr_rewards.py``) for the agent whose stop policy is ``svr_r1``: a trajectory reward
    ``r_acc(final) + w_v * (share of turns whose verdict matches their correctness) + w_f * (share of turns in format)
    + alpha * (r_acc(last) - r_acc(first))``, so more turns earn nothing by themselves; pair with a trajectory estimator (``grpo``)."""

    model_config = _FROZEN
    enabled: bool = Field(False, description="score the agent's trajectories with the SVR-R1 reward (replaces the verifier's outcome)")
    w_v: float = Field(0.5, ge=0.0, description="times the share of the trajectory's turns whose Yes/No matches whether their answer is right")
    w_f: float = Field(0.25, ge=0.0, description="times the share of the trajectory's turns that parsed")
    alpha: float = Field(0.0, ge=0.0, description="correction shaping: alpha * (last answer right - first answer right); 0 = off")


class RevesConfig(BaseModel):
    """REVES as the learner's data source (``learner/reves.py``): each round, the current policy answers the next training
    items; an item it gets wrong goes through repair rounds (previous full answer + "incorrect") until it is recovered or
    ``max_retries`` run out; a recovered item's k rounds become k repair and k + 1 verification prompts (the first wrong
    answer a False candidate; ``learner/reves.py`` balances the labels). The round's prompts (augmented and original,
    ``augmented_share``) are then run ``group`` times each and train once they settle."""

    model_config = _FROZEN
    enabled: bool = Field(False, description="run REVES augmentation and its training prompts before every update (needs the learner's agent)")
    items_per_round: int = Field(8, ge=1, le=256, description="training items the current policy attempts (and repairs) per round")
    max_retries: int = Field(8, ge=1, le=32, description="repair rounds per wrong item before it is given up (REVES: 8)")
    prompts_per_round: int = Field(8, ge=1, le=256, description="training prompts run per round, augmented and original together")
    augmented_share: float = Field(
        0.5, ge=0.0, le=1.0, description="share of the round's training prompts that are REVES prompts (the rest: original problems)"
    )
    group: int = Field(4, ge=2, le=32, description="runs per training prompt (the GRPO group)")
    seed: int = Field(0, ge=0, description="problem seed of the training items")


class ScheduleConfig(BaseModel):
    """When one learner updates and how its versions are released: the process-level settings.

    Declared once here: ``python -m learner run``'s flags are generated from these fields (``flag`` names the
    flag), and the root settings' ``[learner]`` section and ``[[learner.jobs]]`` tables take their defaults,
    bounds and help from them (``loopwise_settings.py``)."""

    model_config = _FROZEN
    agent: str = Field(
        "calc-agent", description="train on this agent's runs and gate with it ('' = all traffic, no gate)", json_schema_extra={"flag": "--agent"}
    )
    task: str | None = Field(None, description="the gate's task (default: the agent's)", json_schema_extra={"flag": "--task"})
    min_new_trajectories: int = Field(
        32, ge=1, description="start an update after this many new rewarded trajectories", json_schema_extra={"flag": "--min-new-trajectories"}
    )
    poll_s: float = Field(10.0, gt=0, description="seconds between scheduling rounds", json_schema_extra={"flag": "--poll-s"})
    gate_n: int = Field(32, ge=0, description="held-out problems per side in the eval gate (0 = no gate)", json_schema_extra={"flag": "--gate-n"})
    gate_seed: int = Field(100_000, description="the gate's problem seed: held-out problems the live traffic and demo never use")
    gate_tolerance: float = Field(
        0.05, ge=0, description="refuse a version whose held-out success is lower by more than this", json_schema_extra={"flag": "--gate-tolerance"}
    )
    ab_min_samples: int = Field(
        64,
        ge=2,
        description="rewards per arm before the A/B experiment against the champion may decide",
        json_schema_extra={"flag": "--ab-min-samples"},
    )
    ab_max_samples: int = Field(
        256,
        ge=0,
        description="an A/B experiment still undecided at this many rewards per arm ends and the champion stays (0 = no cap)",
        json_schema_extra={"flag": "--ab-max-samples"},
    )

    @model_validator(mode="after")
    def _ab_bounds(self) -> ScheduleConfig:
        check_ab_bounds(self)
        return self


def check_ab_bounds(cfg: BaseModel) -> None:
    """The A/B bounds' rule, for every model that carries them: ``ab_max_samples`` is 0 (no cap) or at least ``ab_min_samples``.

    ValueError names both fields, with the flags the model declares for them (``json_schema_extra={"flag": ...}``)."""
    values = dict(cfg)
    lo, hi = values["ab_min_samples"], values["ab_max_samples"]
    if 0 < hi < lo:
        raise ValueError(
            f"{_with_flag(cfg, 'ab_max_samples')} = {hi} must be at least {_with_flag(cfg, 'ab_min_samples')} = {lo}, or 0 for "
            "no cap: an A/B experiment capped below its minimum would end before it may decide"
        )


def _with_flag(cfg: BaseModel, field: str) -> str:
    extra = type(cfg).model_fields[field].json_schema_extra
    flag = extra.get("flag") if isinstance(extra, dict) else None
    return f"{field} ({flag})" if flag else field


def schedule_default(name: str) -> Any:
    """The declared default of one ``ScheduleConfig`` field (for the dataclasses and settings that carry it)."""
    return ScheduleConfig.model_fields[name].default


class PatrConfig(BaseModel):
    """PATR tree rollouts (``learner/patr.py``), used when ``rollouts = "patr"``: each update grows trees over turns for
    ``trees_per_update`` problems of the agent's task through the runs endpoint's segments and trains on their nodes."""

    model_config = _FROZEN
    trees_per_update: int = Field(2, ge=1, le=256, description="problems (trees) per update")
    leaves: int = Field(8, ge=2, le=64, description="G: leaves (finished or stopped paths) per tree at most; the tree's group")
    roots: int = Field(2, ge=1, le=64, description="M: root paths started from the problem")
    branch: int = Field(2, ge=1, le=8, description="b: children of a forked prefix (1 = no forks: independent paths, trajectory GRPO)")
    fork_every: int = Field(1, ge=1, le=64, description="k: fork points every k turns of a path")
    fork_rounds: int = Field(3, ge=0, le=64, description="L: fork points per tree at most")
    fork_top: int = Field(1, ge=1, le=64, description="the highest-scored live prefixes forked at each fork point")
    advance_turns: int = Field(1, ge=1, le=16, description="turns a path advances per segment run")
    max_tokens: int | None = Field(None, ge=1, description="sampled tokens per tree after which no new fork starts (paths still finish)")
    max_tool_calls: int | None = Field(None, ge=1, description="tool calls per tree after which no new fork starts (paths still finish)")
    repeat_n: int = Field(4, ge=0, le=64, description="stop a path after the same action this many times in a row without progress (0 = never)")
    invalid_n: int = Field(2, ge=0, le=64, description="stop a path after this many unreadable actions in a row (0 = never)")
    score_floor: float = Field(0.0, ge=0.0, le=1.0, description="a prefix score at or below this counts as dead")
    floor_k: int = Field(2, ge=0, le=64, description="stop a path after this many advances at or below score_floor (0 = never)")
    stop_reward: float = Field(0.0, ge=0.0, le=1.0, description="the reward of a path stopped as degenerate")
    seed: int = Field(0, ge=0, description="problem seed of the trees' problems when RODS is off (indices advance over updates)")


class RodsConfig(BaseModel):
    """RODS (``learner/rods.py``): the learner's task source for procedural tasks: a replay pool of problems sampled by
    boundary score ``Var_G(r) / ((r_max - r_min)^2 / 4)`` (``4 * Var_G(r)`` for rewards in [0, 1]; the range widens to every reward
    seen, so it never saturates; under PATR one independent leaf per root), grown with verified variants of the boundary problems (the runtime's
    ``POST /admin/agents/{name}/variants``). Each update rolls out ``items_per_update`` pool items ``group`` times (or
    grows their PATR trees when ``rollouts = "patr"``) and trains on those runs."""

    model_config = _FROZEN
    enabled: bool = Field(
        False, description="make the learner's own rollouts from the RODS pool every update (needs the learner's agent and its task)"
    )
    seeds: int = Field(64, ge=1, le=100_000, description="seed items: problems 0..seeds-1 of seed_problem_seed (never evicted)")
    seed_problem_seed: int = Field(0, ge=0, description="the problem seed of the seed items")
    capacity: int = Field(800, ge=1, le=100_000, description="pool size at most (seed items may exceed it; variants then wait for room)")
    items_per_update: int = Field(4, ge=1, le=256, description="pool items rolled out per update")
    group: int = Field(4, ge=2, le=64, description="G: rollouts per item (its boundary score's sample)")
    tau: float = Field(0.5, ge=0.0, le=1.0, description="boundary threshold: items with b >= tau get variants")
    variants: int = Field(2, ge=0, le=32, description="K: variants asked for per boundary item and update (0 = no synthesis)")
    patience: int = Field(2, ge=1, le=64, description="evict a variant after this many consecutive visits with b == 0")
    floor: float = Field(0.05, ge=0.0, le=1.0, description="priority floor added to b (zero-variance items stay reachable)")
    exponent: float = Field(1.0, gt=0.0, le=8.0, description="priority = (b + floor) ** exponent")
    max_candidates: int = Field(256, ge=1, le=1024, description="generator problems the synthesis looks at per boundary item")


class LearnerSettings(BaseModel):
    """Everything one learner process for one adapter family needs."""

    model_config = _FROZEN
    family: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="adapter family being trained (published as family@N)")
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    samples: SampleConfig = Field(default_factory=SampleConfig)
    traffic: TrafficFilter = Field(default_factory=TrafficFilter)
    singletons: SingletonConfig = Field(default_factory=SingletonConfig)
    rerollouts: RerolloutConfig = Field(default_factory=RerolloutConfig)
    leap: LeapConfig = Field(default_factory=LeapConfig)
    svr: SVRConfig = Field(default_factory=SVRConfig)
    svr_r1: SVRR1Config = Field(default_factory=SVRR1Config)
    reves: RevesConfig = Field(default_factory=RevesConfig)
    parity: ParityConfig = Field(default_factory=ParityConfig)
    ab_max_duration_s: float = Field(
        900.0,
        gt=0,
        description=(
            "the learner's A/B experiments end undecided after this many seconds, also when no evidence came at all, so an "
            "experiment never holds the learner forever ('inconclusive': the champion stays unless ab_non_inferiority_margin "
            "promotes the new version; the held version is released next)"
        ),
    )
    ab_non_inferiority_margin: float | None = Field(
        0.2,
        ge=0,
        le=2,
        description=(
            "how the learner's experiment ends when undecided (at ab_max_samples per arm or ab_max_duration_s): with a margin, the "
            "new version is promoted when the users' evidence shows the whole chain of promotions since the first champion worse "
            "by less than this many standard deviations (a one-sided 95% non-inferiority test on the sum of the chain's steps, "
            "looked at once per experiment); None = the champion stays. Chained, not per step: three promotions each tested "
            "alone at 0.2 sd ended 14.5 held-out points below the base model in a measured run, while a chain's losses add up "
            "against one margin (learner/release.py, runtime/adapters/experiment_stats.py)"
        ),
    )
    restart_from_champion: bool = Field(
        True,
        description=(
            "when a version is refused (eval gate, parity probe) or rolled back by its A/B experiment, the next update starts "
            "from the champion's weights (the base model before the first champion) with a fresh optimizer, instead of "
            "descending the rejected line; a version trained meanwhile on that line is dropped (learner/release.py)"
        ),
    )
    rollouts: Literal["live", "patr"] = Field(
        "live",
        description=(
            "'live': train on recorded traffic (and the estimator's re-rollouts); 'patr': every update also grows PATR trees "
            "(learner/patr.py) for problems of the agent's task and trains on their nodes with the tree advantage"
        ),
    )
    patr: PatrConfig = Field(default_factory=PatrConfig)
    rods: RodsConfig = Field(default_factory=RodsConfig)
    overlap_sampling: bool = Field(
        False,
        description=(
            "the learner's own runs (LEAP's probes and episodes, SVR's fixed-horizon runs, REVES's round, PATR trees, RODS "
            "items) for the next update are sampled while the current update's step trains, from the policy before that "
            "step, so they are one version stale when trained (within samples.max_staleness, which must be at least 1); "
            "off: each update samples them first, from its own weights, and the server idles while the trainer steps"
        ),
    )

    @model_validator(mode="after")
    def _overlap_needs_staleness(self) -> LearnerSettings:
        if self.overlap_sampling and self.samples.max_staleness < 1:
            raise ValueError("overlap_sampling trains runs sampled one version before the trainer's: set samples.max_staleness >= 1")
        return self

    @model_validator(mode="after")
    def _self_check_rewards(self) -> LearnerSettings:
        if self.svr.enabled and self.svr_r1.enabled:
            raise ValueError("[svr] and [svr_r1] rewards are for different agents: enable one per learner")
        if self.svr.enabled and (self.trainer.estimator != "turn_grpo" or self.trainer.estimator_params.get("source") != "reward"):
            raise ValueError(
                "[svr] turn rewards are normalised per turn index across the group: set estimator = 'turn_grpo' and "
                "estimator_params = {source = 'reward'}"
            )
        return self
