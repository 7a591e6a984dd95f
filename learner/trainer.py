"""LoRA policy-gradient trainer on per-turn samples (peft, AdamW, PPO-clip loss), with exact-resume checkpoints.

    trainer = LoRATrainer(base_model_dir, TrainerConfig(), LoRAConfig(), version=current_version)
    trainer.load_checkpoint(ckpt_root)              # resume if a complete checkpoint exists
    adv = learner.update.estimate(batch.samples, "grpo")   # the estimator stage, before the trainer
    metrics = trainer.step(batch.samples, adv, skipped=batch.counts.as_dict())
    trainer.cursor = batch.cursor.to_dict()
    trainer.save_checkpoint(ckpt_root)
    publish_adapter(trainer.model, adapter_root, family, trainer.version)   # learner.publish

The trainer is the loss → step part of the learner's pipeline (``learner/update.py``): it gets the samples
and one advantage per sample, and computes nothing about rewards itself. One ``step`` is one update:
``epochs`` optimizer steps over the same batch (PPO epochs; TRL's ``num_iterations``, verl's
``ppo_epochs``), each as follows (PPO-clip over GRPO-family advantages, one sample per turn; ``docs/methods.md``):
1. samples with advantage exactly 0 are left out of the forward pass when ``drop_zero_advantage`` and
   ``kl_coef == 0`` (DAPO's filter; with a KL term they still carry its gradient). If no sample has a
   non-zero advantage (zero-variance groups), the optimizer step is skipped and ``version`` stays: a
   version is a set of weights, so the staleness bound does not move for an update that changed nothing.
2. micro-batches bounded by ``micro_batch_tokens`` padded tokens; each is one teacher-forced forward
   pass over ``context_ids + output_ids``, keeping only the logits that predict the output tokens: the
   logit at position ``p`` predicts the token at ``p + 1``, so the output token at position
   ``len(context) + j`` is scored by the logit at ``len(context) + j - 1``. With ``pack_prefixes`` (on) the
   samples are laid out as prefix tries (``learner.packing``: each distinct prefix once, a tree attention
   mask, depth position ids; Llama/Mistral/Qwen under sdpa or eager), otherwise one left-padded row each.
   Logits are divided by the sample's sampling temperature, as the engine did for its logprobs, and a
   turn decoded under a grammar (``Sample.grammar``) gets the same mask the engine applied
   (``learner.grammar_mask``), so its trained and behaviour logprobs are one distribution (a turn whose
   grammar does not replay over its output is left out, counted as ``grammar_mismatch``).
   The PPO ratio's old policy is fixed in the first epoch: the recorded behaviour logprobs
   (``old_logprobs="behaviour"``), or the trainer's own logprobs before any step of this update
   (``"recompute"``, verl's recomputed ``old_log_prob``): turns sampled by an older version, such as an A/B
   champion while the learner trains on, are then not clipped away; ``behaviour_weight_cap`` adds AReaL's
   decoupled-PPO token weight ``min(pi_old / pi_behaviour, cap)``.
3. reference logprobs with the adapter disabled (same model, no second copy) only when ``kl_coef > 0``.
4. ``learner.losses.policy_loss`` per micro-batch, weighted so the sum equals the loss of the whole
   batch under the aggregation mode; gradients accumulate; the LoRA gradients are clipped to
   ``max_grad_norm``; AdamW and a linear warm-up scheduler step.
A step refuses samples holding token ids outside the model's vocabulary (:class:`SampleError`, naming their
trajectories) before any forward pass, so the learner can quarantine them (``learner/quarantine.py``).
Metrics per step (``StepMetrics``): loss, kl, clip_frac, entropy, grad norm, reward mean/std,
``frac_reward_zero_std``, advantage mean/std, tokens/s, and the skipped counts given by the caller.

Checkpoints (``save_checkpoint(root)``)::

    <root>/ckpt-00000004/                  one complete checkpoint per version (the newest keep_checkpoints kept)
        lora.safetensors                   the LoRA weights (peft state dict)
        trainer_state.pt                   optimizer + scheduler state, RNG states (torch, cuda, numpy, python)
        state.json                         version, optimizer_steps, cursor, seed, sha256 of the two files (written last)
    <root>/.tmp-ckpt-<version>-<pid>-<hex>/  a save in progress; renamed into place only when complete

A killed save leaves only a ``.tmp-`` folder, which is never read and is removed by the next save or
load; ``load_checkpoint`` takes the newest ``ckpt-*`` whose ``state.json`` hashes match (a corrupt one
is logged and skipped), so a resumed learner continues from exactly the state it saved. A learner
loop should checkpoint *before* it publishes ``family@version`` and, after a resume, publish the
checkpoint's version if it is not published yet: the other order could publish one version twice
with different weights. A checkpoint records its LoRA config; resuming one whose shape differs from
the configured one rebuilds the adapter in the checkpoint's shape (logged), never loads it mis-scaled.

Not here: choosing samples (``learner.samples``), advantages (``learner.advantages``, called by
``learner.update``), the loss formulas (``learner.losses``), publishing (``learner.publish``), scheduling updates.
Data parallelism is ``learner/distributed.py``: in a process group each rank takes its share of the
micro-batches (``b % world_size == rank``) and the LoRA gradients are summed across ranks before clipping
(``learner/collectives.py``).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import random
import shutil
import statistics
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from learner._files import fsync_path, writer_alive
from learner.collectives import allreduce_grads, allreduce_sums, world
from learner.config import LoRAConfig, TrainerConfig
from learner.grammar_mask import GrammarMasks, GrammarReplayError, unpack_bitmask
from learner.losses import LossConfig, policy_loss
from learner.packing import pack, plan_micro_batches, plan_packed
from learner.records.adapter_manifest import sha256_file
from learner.samples import Sample, make_groups, stored_trajectory_id

log = structlog.get_logger(__name__)

CKPT_PREFIX, TMP_PREFIX = "ckpt-", ".tmp-ckpt-"
LORA_FILE, STATE_FILE, META_FILE = "lora.safetensors", "trainer_state.pt", "state.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or none that is complete and intact could be read."""


class SampleError(ValueError):
    """Samples this model cannot be trained on (token ids outside its vocabulary, as a store shared across a model switch
    holds); ``trajectory_ids`` names their stored trajectories, so the learner quarantines those (``learner/quarantine.py``)."""

    def __init__(self, message: str, trajectory_ids: Sequence[str]) -> None:
        super().__init__(message)
        self.trajectory_ids = list(dict.fromkeys(stored_trajectory_id(t) for t in trajectory_ids))


@dataclass
class StepMetrics:
    version: int  # the trainer's version after this step
    optimizer_step: bool  # False when every advantage was zero (or there were no samples)
    samples: int  # samples given to the step
    trained_samples: int  # samples in the forward pass (non-zero advantage, unless drop_zero_advantage is off)
    tokens: int  # loss-mask tokens trained on
    loss: float = 0.0
    kl: float = 0.0
    clip_frac: float = 0.0
    entropy: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0
    reward_mean: float = 0.0
    reward_std: float = 0.0
    frac_reward_zero_std: float = 0.0  # groups whose rewards are all equal (they teach nothing)
    adv_mean: float = 0.0
    adv_std: float = 0.0
    step_s: float = 0.0
    tokens_per_s: float = 0.0  # forward+backward tokens (context + output, unpadded) per second
    skipped: dict[str, int] = field(default_factory=dict)
    loss_stats: dict[str, float] = field(default_factory=dict)  # everything policy_loss reported, batch-weighted

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16 in /proc/cpuinfo: bf16 matmuls run natively (the serving engine's ``--dtype auto`` reads the same flags)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


AUTOCAST_MIN_SPEEDUP = 1.2  # ``auto`` takes bf16 autocast only where the probe measures at least this much faster


@functools.cache
def bf16_autocast_speedup(width: int = 576, inner: int = 1536, tokens: int = 512, reps: int = 3) -> float:
    """fp32 time ÷ bf16-autocast time of a frozen linear's forward and input-gradient backward (a LoRA step's bulk) at the
    model's width, on this CPU and torch's current thread count: the median of ``reps`` alternating timings after a
    warm-up (~0.1 s in all). Measured because the ISA flags do not say it: with AVX512-BF16 a learner step under autocast
    ran 2.6x faster than fp32 on a 2-core EPYC, and 0.64x as fast on a 2-core Xeon whose VM hides AMX."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(inner, width, generator=gen) / width**0.5
    x = torch.randn(tokens, width, generator=gen).requires_grad_()

    def once(bf16: bool) -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = torch.nn.functional.linear(x, w)
        y.float().square().mean().backward()
        x.grad = None
        return time.perf_counter() - t0

    once(False), once(True)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps):
        for bf16 in (False, True):
            times[bf16].append(once(bf16))
    return statistics.median(times[False]) / statistics.median(times[True])


def pick_autocast(name: str, device: torch.device, dtype: torch.dtype, width: int = 576, inner: int = 1536) -> bool:
    """Whether the forward runs under bf16 autocast. ``auto``: on a CPU with native bf16 (the flags) while the weights are
    fp32, and only where :func:`bf16_autocast_speedup` measures it at least ``AUTOCAST_MIN_SPEEDUP`` faster at the
    model's ``width`` and MLP ``inner`` size; ``bfloat16`` / ``off`` as set."""
    if name != "auto":
        return name == "bfloat16"
    if not (device.type == "cpu" and dtype == torch.float32 and cpu_has_native_bf16()):
        return False
    speedup = bf16_autocast_speedup(width, inner)
    log.info("bf16 autocast probe", speedup=round(speedup, 2), autocast=speedup >= AUTOCAST_MIN_SPEEDUP)
    return speedup >= AUTOCAST_MIN_SPEEDUP


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


# causal LMs whose forward is ``lm_head(decoder(...))`` (no logit scale or soft-capping after the head) and whose decoder
# takes a custom 4D attention mask: the packed forward (learner/packing.py) calls the decoder and the head itself
PACKABLE = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


def packable(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot take the prefix-packed forward pass, or None when it can."""
    name = type(model).__name__
    cfg = model.config
    if name not in PACKABLE:
        return f"{name} is not one of the packed architectures ({', '.join(sorted(PACKABLE))})"
    attn = getattr(cfg, "_attn_implementation", None) or "eager"
    if attn not in ("sdpa", "eager"):
        return f"attention implementation {attn!r} (packing builds an sdpa or eager mask)"
    if getattr(cfg, "use_sliding_window", False) or (name == "MistralForCausalLM" and getattr(cfg, "sliding_window", None)):
        return "sliding-window attention (a custom mask would drop the window)"
    return None


def _scored(
    logits: torch.Tensor, temps: torch.Tensor, targets: torch.Tensor, allowed: torch.Tensor | None, *, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each target's logprob under ``logits / temps`` (the engine's sampling distribution), masked by the recorded grammar
    (``allowed``, as the engine applied it before its logprobs), and the distribution's entropy when asked. ``logits``
    (..., V); ``targets`` and the results (...)."""
    logits = logits.float() / temps
    if allowed is not None:
        logits = logits.masked_fill(~allowed[..., : logits.shape[-1]], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - lse
    ent = None
    if entropy:
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)
            ent = lse - (probs * torch.nan_to_num(logits, neginf=0.0)).sum(-1)  # masked tokens have p = 0
    return logp, ent


def _micro_weight(agg: str, mb_rows: int, mb_tokens: int, rows: int, tokens: int) -> float:
    """Factor that makes the micro-batch losses sum to the whole batch's loss under ``agg``."""
    if agg == "token-mean":
        return mb_tokens / tokens
    if agg == "seq-mean-token-sum-norm":
        return 1.0  # sum over rows / a fixed constant: already additive over micro-batches
    return mb_rows / rows  # seq-mean-*: a mean over rows


class LoRATrainer:
    """A peft LoRA on a base causal LM, its AdamW optimizer and scheduler, the version counter and the data cursor."""

    def __init__(self, base_model: Path, cfg: TrainerConfig, lora: LoRAConfig, *, version: int = 0) -> None:
        self.cfg = cfg
        self.base_model_dir = Path(base_model)
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)  # process-wide: the learner runs in its own process
        self.device = pick_device(cfg.device)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        self._seed_everything(cfg.seed)
        base = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=self.dtype)
        width = int(getattr(base.config, "hidden_size", 576))
        inner = int(getattr(base.config, "intermediate_size", None) or 4 * width)
        self.autocast = pick_autocast(cfg.autocast, self.device, self.dtype, width, inner)  # bf16 matmuls under fp32 master weights
        eos = base.generation_config.eos_token_id if base.generation_config is not None else None
        self.eos_token_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, list | tuple) else ((eos,) if eos is not None else ())
        self.vocab_size = int(base.config.vocab_size)
        self._masks: GrammarMasks | None = None  # built on the first grammar-constrained sample
        self._bits_cache: dict[str, torch.Tensor] = {}  # turn id → its replayed grammar bitmask (T, V/32)
        self._build(base, lora)
        why_not = packable(base) if cfg.pack_prefixes else "pack_prefixes is off"
        self.packing = why_not is None
        if cfg.pack_prefixes and why_not:
            log.info("prefix packing off: one row per sample", reason=why_not)
        self.loss_cfg = LossConfig(
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            dual_clip_c=cfg.dual_clip_c,
            kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator,
            agg=cfg.agg,
            max_tokens=cfg.max_tokens,
        )
        self.version = version
        self.optimizer_steps = 0
        self.cursor: dict[str, Any] = {}
        log.info(
            "trainer ready",
            base=str(base_model),
            device=str(self.device),
            dtype=str(self.dtype),
            autocast=self.autocast,
            packing=self.packing,
            lora_params=sum(p.numel() for p in self.params),
        )

    def _build(self, base: torch.nn.Module, lora: LoRAConfig) -> None:
        """Wrap ``base`` in a fresh LoRA of shape ``lora`` and make its optimizer and scheduler."""
        cfg = self.cfg
        self.lora_cfg = lora
        peft_cfg = PeftLoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates an int; it only divides by it (alpha / r)
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        self.model: PeftModel = get_peft_model(base, peft_cfg).to(self.device)
        if cfg.activation_checkpointing:  # keep only layer inputs for backward, recompute the rest: much less memory, ~30% more compute
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.enable_input_require_grads()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        warm = cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / (warm + 1)) if warm else 1.0)

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    # -- forward ----------------------------------------------------------------------------------

    def _plan(self, samples: Sequence[Sample]) -> list[tuple[list[int], list[int] | None]]:
        """Micro-batches: each one's sample indices and, when packed, its rows' sample counts (the indices in row order)."""
        seqs = [s.context_ids + s.output_ids for s in samples]
        if self.packing and all(s.context_ids for s in samples):
            return [([i for row in rows for i in row], [len(row) for row in rows]) for rows in plan_packed(seqs, self.cfg.micro_batch_tokens)]
        return [(idx, None) for idx in plan_micro_batches([len(x) for x in seqs], self.cfg.micro_batch_tokens)]

    def _batch_tensors(self, mb: Sequence[Sample], row_sizes: Sequence[int] | None = None) -> dict[str, Any]:
        """The model's input and the output-aligned tensors, each sample's outputs right-aligned in T columns.

        Unpacked (``row_sizes`` None): one left-padded ``context + output`` row per sample. Packed: ``mb`` in row
        order, ``row_sizes[r]`` samples per row, laid out as prefix tries (``learner.packing.pack``)."""
        rows = len(mb)
        t_out = max(len(s.output_ids) for s in mb)
        mask = torch.zeros(rows, t_out)  # (B, T) loss mask, row i's outputs in its last len(output) columns
        old = torch.zeros(rows, t_out)  # (B, T) behaviour logprobs
        has_old = torch.zeros(rows, dtype=torch.bool)  # (B,)
        out: dict[str, Any] = {}
        if row_sizes is None:
            length = max(len(s.context_ids) + len(s.output_ids) for s in mb)
            input_ids = torch.zeros(rows, length, dtype=torch.long)  # (B, L)
            attn = torch.zeros(rows, length, dtype=torch.long)  # (B, L)
            for i, s in enumerate(mb):
                seq = s.context_ids + s.output_ids
                input_ids[i, length - len(seq) :] = torch.tensor(seq)
                attn[i, length - len(seq) :] = 1
            position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # (B, L): each row starts at position 0 after its padding
            out.update(input_ids=input_ids, attention_mask=attn, position_ids=position_ids)
        else:
            starts = np.cumsum([0, *row_sizes]).tolist()
            local = [list(range(a, b)) for a, b in itertools.pairwise(starts)]
            out["packed"] = pack(local, [s.context_ids for s in mb], [s.output_ids for s in mb])
        for i, s in enumerate(mb):
            n = len(s.output_ids)
            mask[i, t_out - n :] = torch.tensor(s.loss_mask, dtype=torch.float32)
            if s.logprobs:
                old[i, t_out - n :] = torch.tensor(s.logprobs, dtype=torch.float32)
                has_old[i] = True
        temps = torch.tensor([s.temperature for s in mb], dtype=torch.float32)  # (B,)
        out.update(mask=mask, old=old, has_old=has_old, temps=temps)
        if any(s.grammar for s in mb):
            allowed = torch.ones(rows, t_out, self.vocab_size, dtype=torch.bool)  # (B, T, V); padding columns stay unmasked
            for i, s in enumerate(mb):
                if s.grammar:
                    allowed[i, t_out - len(s.output_ids) :] = unpack_bitmask(self._grammar_bits(s), self.vocab_size)
            out["allowed"] = allowed
        return {k: v.to(self.device) for k, v in out.items()}

    def _grammar_bits(self, s: Sample) -> torch.Tensor:
        """The recorded constraint of ``s`` replayed over its output ids (learner.grammar_mask), cached per turn."""
        if self._masks is None:
            self._masks = GrammarMasks(self.base_model_dir, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids)
        cached = self._bits_cache.get(s.turn_id)
        if cached is None:
            assert s.grammar is not None
            cached = self._bits_cache[s.turn_id] = self._masks.bitmask(s.grammar, s.output_ids)
        return cached

    def replayable(self, samples: Sequence[Sample]) -> list[int]:
        """Indices of ``samples`` that can be scored exactly: unconstrained, or constrained with a grammar that replays over the output."""
        keep: list[int] = []
        for i, s in enumerate(samples):
            if s.grammar:
                try:
                    self._grammar_bits(s)
                except GrammarReplayError as exc:
                    log.warning("constrained turn left out: its recorded grammar does not replay", turn=s.turn_id, error=str(exc))
                    continue
            keep.append(i)
        return keep

    def _logprobs(self, t: Mapping[str, Any], *, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs of the output tokens (B, T) under the current model (adapter state as set by the caller)."""
        if "packed" in t:
            return self._packed_logprobs(t, entropy=entropy)
        t_out = t["mask"].shape[1]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(
                input_ids=t["input_ids"],
                attention_mask=t["attention_mask"],
                position_ids=t["position_ids"],
                logits_to_keep=t_out + 1,
                use_cache=False,
            )
        # out.logits: (B, T+1, V) for positions L-T-1 .. L-1; the last one predicts past the end → drop it
        targets = t["input_ids"][:, -t_out:]  # (B, T): the tokens those logits predict
        return _scored(out.logits[:, :-1, :], t["temps"][:, None, None], targets, t.get("allowed"), entropy=entropy)

    def _packed_logprobs(self, t: Mapping[str, Any], *, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``_logprobs`` of a packed micro-batch: the decoder over the prefix tries, the head only where a logit predicts an
        output token, then each token's logprob scattered into its sample's (B, T) place (zeros elsewhere)."""
        p = t["packed"]
        causal_lm: Any = self.model.get_base_model()
        attend = p.attend
        if (getattr(causal_lm.config, "_attn_implementation", None) or "eager") == "eager":  # eager adds the mask to the scores
            attend = torch.zeros(attend.shape, device=attend.device).masked_fill(~attend, torch.finfo(torch.float32).min)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            hidden = causal_lm.model(input_ids=p.input_ids, attention_mask=attend, position_ids=p.position_ids, use_cache=False).last_hidden_state
            head = causal_lm.lm_head(hidden[p.row, p.pos])  # (N, V): one logit row per output token
        allowed = t.get("allowed")
        flat, ent_flat = _scored(
            head, t["temps"][p.sample][:, None], p.target, None if allowed is None else allowed[p.sample, p.col], entropy=entropy
        )  # (N,)

        def placed(x: torch.Tensor) -> torch.Tensor:  # (N,) → (B, T): each token at its sample's row and column, zeros elsewhere
            return torch.zeros(t["mask"].shape, dtype=x.dtype, device=x.device).index_put((p.sample, p.col), x)

        return placed(flat), None if ent_flat is None else placed(ent_flat)

    def check_token_ids(self, samples: Sequence[Sample]) -> None:
        """Raise :class:`SampleError` naming the turns and trajectories whose context or output ids fall outside ``[0, vocab_size)``
        (an embedding lookup would fail on them with a bare IndexError on a CPU, a device-side assert on a GPU)."""
        bad = [
            s
            for s in samples
            if (s.context_ids and (min(s.context_ids) < 0 or max(s.context_ids) >= self.vocab_size))
            or (s.output_ids and (min(s.output_ids) < 0 or max(s.output_ids) >= self.vocab_size))
        ]
        if bad:
            first = next(t for s in bad for t in s.context_ids + s.output_ids if not 0 <= t < self.vocab_size)
            turns = ", ".join(f"{s.turn_id} (trajectory {s.trajectory_id})" for s in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise SampleError(
                f"{len(bad)} recorded turn{'s' if len(bad) > 1 else ''} with token ids outside this model's vocabulary (size {self.vocab_size}; "
                f"e.g. id {first}), so not recorded with {self.base_model_dir.name}: {turns}",
                [s.trajectory_id for s in bad],
            )

    @torch.no_grad()
    def token_logprobs(self, samples: Sequence[Sample], *, adapter: bool = True) -> list[list[float]]:
        """Each sample's output-token logprobs (the trainer's view of the recorded behaviour logprobs)."""
        self.check_token_ids(samples)
        self.model.eval()
        back: list[list[float]] = [[] for _ in samples]
        for idx, row_sizes in self._plan(samples):
            mb = [samples[i] for i in idx]
            t = self._batch_tensors(mb, row_sizes)
            if adapter:
                logp, _ = self._logprobs(t)
            else:
                with self.model.disable_adapter():
                    logp, _ = self._logprobs(t)
            for i, row, s in zip(idx, logp.tolist(), mb, strict=True):
                back[i] = row[len(row) - len(s.output_ids) :]
        return back

    # -- one update -------------------------------------------------------------------------------

    def step(self, samples: Sequence[Sample], advantages: Sequence[float], skipped: Mapping[str, int] | None = None) -> StepMetrics:
        """One optimizer update of ``samples`` with one advantage per sample (same order); always advances ``version`` by one.

        The advantages come from the estimator stage (``learner.update.estimate``); a
        ``learner.advantages.Advantages`` also carries the estimator's stats (excluded samples, zero-spread
        groups), which the metrics report. Samples with advantage exactly 0 are left out of the forward pass
        when ``drop_zero_advantage`` and there is no KL term (with ``kl_coef > 0`` they still pull toward the
        base model, so they stay). Constrained turns whose recorded grammar does not replay are left out."""
        t0 = time.perf_counter()
        if len(advantages) != len(samples) or not all(math.isfinite(a) for a in advantages):
            raise ValueError(f"step needs one finite advantage per sample: got {len(advantages)} for {len(samples)} samples, or non-finite ones")
        self.check_token_ids(samples)  # before any forward pass: a bad id must not half-step the trainer (or assert on a GPU)
        m = StepMetrics(version=self.version, optimizer_step=False, samples=len(samples), trained_samples=0, tokens=0, skipped=dict(skipped or {}))
        self._reward_stats(samples, advantages, m)
        est_stats = getattr(advantages, "stats", None)  # learner.advantages.Advantages carries the estimator's own view
        if est_stats is not None:
            m.frac_reward_zero_std = float(est_stats.frac_reward_zero_std)  # same zero-std tolerance as the advantages
            m.skipped["excluded_by_estimator"] = int(est_stats.n_excluded)
        drop_zero = self.cfg.drop_zero_advantage and self.cfg.kl_coef == 0
        keep = [i for i, a in enumerate(advantages) if a != 0.0 or not drop_zero]
        m.skipped["zero_advantage"] = len(samples) - len(keep)
        if m.frac_reward_zero_std == 1.0:
            log.warning("frac_reward_zero_std == 1: every group has equal rewards, so nothing is learned (harder tasks, bigger groups?)")
        replays = self.replayable([samples[i] for i in keep])
        if len(replays) < len(keep):
            m.skipped["grammar_mismatch"] = len(keep) - len(replays)
        keep = [keep[j] for j in replays]
        chosen, adv = [samples[i] for i in keep], [float(advantages[i]) for i in keep]
        if not any(a != 0.0 for a in adv):  # nothing to learn: the weights, and so the version, stay
            m.version, m.step_s = self.version, time.perf_counter() - t0
            log.warning(
                "all advantages are zero: optimizer step skipped (see the update's unused reasons)", version=self.version, samples=len(samples)
            )
            self._bits_cache.clear()
            return m
        m.trained_samples = len(chosen)
        m.tokens = total_tokens = sum(s.n_tokens for s in chosen)
        self.model.train()
        batches = self._plan(chosen)
        seen_tokens = 0
        olds: dict[int, torch.Tensor] = {}  # micro-batch → the first epoch's old logprobs (recorded ones, else the first pass's own)
        weights: dict[int, torch.Tensor] = {}  # micro-batch → decoupled-PPO token weights (behaviour_weight_cap)
        for epoch in range(self.cfg.epochs):  # the metrics reported are the last epoch's
            label = f"v{self.version + 1}" + (f" epoch {epoch + 1}/{self.cfg.epochs}" if self.cfg.epochs > 1 else "")
            sums, entropy_sum, epoch_tokens = self._optimizer_step(chosen, adv, batches, total_tokens, label, m, olds, weights)
            seen_tokens += epoch_tokens
        self._bits_cache.clear()
        self.version += 1
        m.optimizer_step, m.version = True, self.version
        m.loss_stats = {k: v / max(total_tokens, 1) for k, v in sums.items()}
        m.loss = m.loss_stats.pop("loss")
        m.kl = m.loss_stats.get("kl", 0.0)
        m.clip_frac = m.loss_stats.get("clip_frac", 0.0)
        m.entropy = entropy_sum / max(total_tokens, 1)
        m.step_s = time.perf_counter() - t0
        m.tokens_per_s = seen_tokens / m.step_s if m.step_s > 0 else 0.0
        if m.clip_frac >= 1.0:
            log.warning("every token was clipped: the policy moved far from the behaviour policy (lower lr?)", version=self.version)
        log.info("learner step", **{k: v for k, v in m.as_dict().items() if k not in ("skipped", "loss_stats")}, skipped=m.skipped)
        return m

    def _optimizer_step(
        self,
        chosen: Sequence[Sample],
        adv: Sequence[float],
        batches: list[tuple[list[int], list[int] | None]],
        total_tokens: int,
        label: str,
        m: StepMetrics,
        olds: dict[int, torch.Tensor],
        weights: dict[int, torch.Tensor],
    ) -> tuple[dict[str, float], float, int]:
        """One pass over the micro-batches and one AdamW step; returns the loss sums, entropy sum and tokens seen."""
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        entropy_sum = 0.0
        seen_tokens = 0
        rank, size = world()  # data-parallel (learner/distributed.py): this rank's share of the micro-batches
        for b, (idx, row_sizes) in enumerate(tqdm(batches, desc=f"learner step {label}", unit="mb", disable=not self.cfg.progress, leave=False)):
            if b % size != rank:
                continue
            mb = [chosen[i] for i in idx]
            t = self._batch_tensors(mb, row_sizes)
            logp, ent = self._logprobs(t, entropy=True)  # (B, T)
            # the first epoch fixes the old policy: the recorded behaviour logprobs, or ('recompute', or none recorded)
            # the trainer's own first-pass logprobs (ratio 1 in that epoch; the clip applies in later ones)
            if b not in olds:
                own = logp.detach()
                if self.cfg.old_logprobs == "recompute":
                    olds[b] = own
                    if self.cfg.behaviour_weight_cap is not None:
                        behav = torch.where(t["has_old"][:, None], t["old"], own)
                        weights[b] = torch.exp(torch.clamp(own - behav, max=math.log(self.cfg.behaviour_weight_cap)))
                else:
                    olds[b] = torch.where(t["has_old"][:, None], t["old"], own)
            old = olds[b]
            ref = None
            if self.cfg.kl_coef > 0:
                with torch.no_grad(), self.model.disable_adapter():
                    ref, _ = self._logprobs(t)
            a = torch.tensor([adv[i] for i in idx], dtype=torch.float32, device=self.device)  # (B,)
            loss, stats = policy_loss(logp, old, a, t["mask"], self.loss_cfg, ref_logp=ref, token_weight=weights.get(b))
            mb_tokens = int(t["mask"].sum().item())
            w = _micro_weight(self.cfg.agg, len(mb), mb_tokens, len(chosen), total_tokens)
            (loss * w).backward()
            for k, v in stats.items():
                if k != "loss":  # the batch loss is summed exactly below
                    sums[k] = sums.get(k, 0.0) + float(v) * mb_tokens
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach()) * w * total_tokens  # so /total_tokens gives the batch loss
            assert ent is not None
            entropy_sum += float((ent * t["mask"]).sum())
            seen_tokens += sum(len(s.context_ids) + len(s.output_ids) for s in mb)
        if size > 1:  # the micro-batch weights are relative to the whole batch: the sum over ranks is the one-process gradient
            allreduce_grads(self.params)
            total = allreduce_sums({**sums, "__entropy": entropy_sum, "__tokens": float(seen_tokens)})
            entropy_sum, seen_tokens = total.pop("__entropy"), int(total.pop("__tokens"))
            sums = total
        m.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
        m.lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return sums, entropy_sum, seen_tokens

    @staticmethod
    def _reward_stats(samples: Sequence[Sample], advantages: Sequence[float], m: StepMetrics) -> None:
        if not samples:
            return
        # one value per trajectory: its outcome reward (a task's per-turn process scores are a different scale), else
        # the mean of its rated turns' rewards; a trajectory with neither (never handed to a step) has no value
        per_traj: dict[str, list[float]] = {}
        outcome: dict[str, float] = {}
        for s in samples:
            if s.trajectory_reward is not None:
                outcome[s.trajectory_id] = s.trajectory_reward
            rated = per_traj.setdefault(s.trajectory_id, [])
            if s.reward is not None:
                rated.append(s.reward)
        value = {t: outcome[t] if t in outcome else float(np.mean(v)) for t, v in per_traj.items() if t in outcome or v}
        if value:
            values = np.array(list(value.values()), dtype=np.float64)
            m.reward_mean, m.reward_std = float(values.mean()), float(values.std())
        groups = [[value[t] for t in g.trajectory_ids if t in value] for g in make_groups(samples)]
        groups = [g for g in groups if g]
        m.frac_reward_zero_std = sum(1 for g in groups if np.std(g) == 0.0) / len(groups) if groups else 0.0
        a = np.asarray(advantages, dtype=np.float64)
        m.adv_mean, m.adv_std = float(a.mean()), float(a.std())

    def restart_from(self, lora_state: Mapping[str, torch.Tensor] | None) -> None:
        """Continue from other LoRA weights with a fresh optimizer and scheduler (the learner's restart from its champion).

        ``lora_state`` is a published adapter's state dict (``peft``'s keys, as ``save_pretrained`` writes them); None
        starts from the base model again (a fresh LoRA initialisation: B = 0, so the adapter is the identity). The
        version counter and the data cursor are kept: versions are never reused."""
        if lora_state is None:
            for module in self.model.modules():
                if hasattr(module, "reset_lora_parameters") and "default" in getattr(module, "lora_A", {}):
                    module.reset_lora_parameters("default", True)  # type: ignore[operator]  # torch types Module attributes as Tensor | Module
        else:
            result = set_peft_model_state_dict(self.model, {k: v.to(self.device) for k, v in lora_state.items()})
            missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
            if missing:
                raise ValueError(f"the adapter to restart from lacks {len(missing)} LoRA weights of this trainer (e.g. {missing[0]})")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        cfg, warm = self.cfg, self.cfg.warmup_steps
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / (warm + 1)) if warm else 1.0)
        log.info("restarted from other weights", base_only=lora_state is None, version=self.version)

    # -- checkpoints --------------------------------------------------------------------------------

    def lora_state(self) -> dict[str, torch.Tensor]:
        """The LoRA weights (peft's adapter state dict), on CPU."""
        return {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(self.model).items()}

    def save_checkpoint(self, root: Path) -> Path:
        """Write a complete checkpoint of the current version atomically (temp folder + rename); returns its folder."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        clean_checkpoint_temps(root)
        final = root / f"{CKPT_PREFIX}{self.version:08d}"
        tmp = root / f"{TMP_PREFIX}{self.version:08d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            save_file(self.lora_state(), str(tmp / LORA_FILE))
            state = {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": _rng_state(),
            }
            torch.save(state, tmp / STATE_FILE)
            meta = {
                "version": self.version,
                "optimizer_steps": self.optimizer_steps,
                "cursor": self.cursor,
                "seed": self.cfg.seed,
                "lora": self.lora_cfg.model_dump(),
                "files": {name: sha256_file(tmp / name) for name in (LORA_FILE, STATE_FILE)},
                "saved_at": time.time(),
            }
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1))  # last: a folder with state.json is complete
            for name in (LORA_FILE, STATE_FILE, META_FILE):
                fsync_path(tmp / name)
            fsync_path(tmp)
            if final.exists():  # re-saving a version (resumed from an older checkpoint): swap, never leave a gap
                old = root / f"{TMP_PREFIX}old-{self.version:08d}-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old)
            else:
                os.rename(tmp, final)
            fsync_path(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for stale in list_checkpoints(root)[: -self.cfg.keep_checkpoints]:
            shutil.rmtree(stale)
        log.info("checkpoint saved", path=str(final), version=self.version, optimizer_steps=self.optimizer_steps)
        return final

    def load_checkpoint(self, root: Path) -> Path | None:
        """Restore the newest intact checkpoint under ``root``; None (state unchanged) when there is none."""
        root = Path(root)
        if not root.is_dir():
            return None
        clean_checkpoint_temps(root)
        for folder in reversed(list_checkpoints(root)):
            try:
                meta = read_checkpoint_meta(folder)
            except CheckpointError as exc:
                log.error("skipping a damaged checkpoint", path=str(folder), error=str(exc))
                continue
            saved_lora = meta.get("lora")
            if saved_lora is not None and LoRAConfig.model_validate(saved_lora) != self.lora_cfg:
                # the checkpoint's adapter is the one being trained: rebuild its shape (rank, alpha, targets) rather
                # than load its weights into a differently shaped or scaled LoRA
                log.warning(
                    "the checkpoint's LoRA config differs from the configured one; resuming with the checkpoint's",
                    saved=saved_lora,
                    configured=self.lora_cfg.model_dump(),
                )
                self._build(self.model.unload(), LoRAConfig.model_validate(saved_lora))
            set_peft_model_state_dict(self.model, {k: v.to(self.device) for k, v in load_file(str(folder / LORA_FILE)).items()})
            # on CPU: RNG states must stay there; load_state_dict moves optimizer state to each parameter's device
            state = torch.load(folder / STATE_FILE, weights_only=True, map_location="cpu")
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            _set_rng_state(state["rng"])
            self.version = int(meta["version"])
            self.optimizer_steps = int(meta["optimizer_steps"])
            self.cursor = dict(meta.get("cursor") or {})
            log.info("checkpoint loaded", path=str(folder), version=self.version, optimizer_steps=self.optimizer_steps)
            return folder
        return None


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest version first."""
    found = [p for p in Path(root).iterdir() if p.is_dir() and p.name.startswith(CKPT_PREFIX) and p.name[len(CKPT_PREFIX) :].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CKPT_PREFIX) :]))


def clean_checkpoint_temps(root: Path) -> list[Path]:
    """Remove leftovers of killed saves (``.tmp-ckpt-*``) whose writer process is gone; returns what was removed."""
    removed = []
    for p in Path(root).iterdir():
        if p.name.startswith(TMP_PREFIX) and not writer_alive(p.name):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if removed:
        log.info("removed unfinished checkpoint writes", paths=[str(p) for p in removed])
    return removed


def read_checkpoint_meta(folder: Path) -> dict[str, Any]:
    """``state.json`` of a checkpoint after checking the files' hashes; raises ``CheckpointError``."""
    try:
        meta: dict[str, Any] = json.loads((folder / META_FILE).read_text())
        files = meta["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{folder / META_FILE} is missing or unreadable: {exc}") from exc
    for name, digest in files.items():
        path = folder / name
        if not path.is_file() or sha256_file(path) != digest:
            raise CheckpointError(f"{path} is missing or does not match its sha256 in {META_FILE}")
    return meta


def _rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(gauss)],
        "python": _py_state_to_lists(random.getstate()),
    }


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def _py_state_to_lists(s: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss_next = s
    return [version, list(internal), gauss_next]


def iter_lora_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The LoRA parameters of a peft model (``lora_A``/``lora_B`` weights)."""
    for name, p in model.named_parameters():
        if "lora_" in name:
            yield name, p
