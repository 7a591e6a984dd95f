"""Logprob parity after every load: the serving engine and the trainer must agree on what the new version is.

    probe = probe_turns(learner_dir, store, trained_samples, k=4)     # {"greedy": [...], "sampled": [...], "constrained": [...]}
    report = parity_probe(admin_client, store, trainer, model="chat-lora@4", probe=probe, max_tokens=16)
    report["mean_abs_logp_diff"]        # nats per token, the worst kind's mean: the learner refuses above [parity] threshold
    report["kinds"]["sampled"]          # the same figures for each kind of probe turn
    refusal(report, threshold)          # the reason to refuse the version, None when it passes

A fixed probe of recorded turns (chosen among an update's trained turns and kept in
``<learner dir>/parity_probe.json``) is decoded by the served version from each turn's exact recorded context
(``POST /admin/turns/{id}/siblings`` with ``record: false``, so nothing is recorded); the trainer then scores
the same output tokens with its copy of the weights (teacher forcing), as it scores the turns it trains on,
and the absolute difference of the per-token logprobs is the metric (TRL logs its mean as
``sampling_logp_difference``; prime-rl's ``mismatch_kl`` is its KL form). Three kinds of probe turn:

- ``greedy``: the newest ``k`` unconstrained turns, decoded at temperature 0. Both sides compute logprobs of
  the raw logits, so an honest load differs by float noise only; a wrong LoRA scale (alpha/r), a wrong dtype
  or a missing target module shows up as a large difference before any user is served by it.
- ``sampled``: one unconstrained turn recorded at a temperature T other than 1, decoded at T with a fixed seed;
  the trainer scores it with ``logits / T`` (the logprob convention of ``runtime/engine.py``, the one the
  recorded behaviour logprobs follow). An engine that reports the logprobs of the raw logits at T != 1 (vLLM's
  ``logprobs_mode = "raw_logprobs"``, its default) fails here and passes the greedy kind.
- ``constrained``: one turn recorded under a decoding grammar, decoded at its recorded temperature under that
  grammar (the endpoint replays it); the trainer re-applies the grammar's mask (``learner/grammar_mask.py``)
  as it does when training. An engine that applies another grammar, or reports the unmasked distribution's
  logprobs, fails here; a served output the recorded grammar does not allow at all (the trainer gives it
  probability 0) counts :data:`FORBIDDEN_DIFF` nats per token and ``grammar_mismatch`` in the report.

The sampled and constrained turns join when the candidates have them (a later update's turns may add one);
a kind whose saved turns left the store is chosen again. The report's ``mean_abs_logp_diff`` is the largest
of the kinds' means, so one mis-handled sampled turn is not averaged away by the greedy ones.

A turn sampled under presence/frequency penalties or a logit bias is never a probe turn: it never trains
(``learner/samples.py``, ``sampling_penalties``), so it is no candidate, and a saved or chosen turn recorded
with them is dropped here too (:func:`learner.samples.sampled_with_penalties`).

Not here: what the learner does with a refused version (``learner/release.py``); the endpoint
(``runtime/admin/replay.py``). Top-p is not probed (the engine's logprobs are before top-p, by convention).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from learner.samples import Sample, sampled_with_penalties

__all__ = ["FORBIDDEN_DIFF", "KINDS", "PROBE_FILE", "ParityRefused", "parity_probe", "probe_turns", "refusal"]

PROBE_FILE = "parity_probe.json"
KINDS = ("greedy", "sampled", "constrained")
FORBIDDEN_DIFF = 30.0  # nats per token of a served output the recorded grammar forbids (the true difference is infinite; JSON has no inf)
GRAMMAR_KINDS = ("json_schema", "json_object", "ebnf")  # the grammars the siblings endpoint replays (runtime/admin/replay.py)
SEED = 0  # the sampled and constrained decodes' seed: the same tokens for every version's probe where the weights agree


class ParityRefused(RuntimeError):
    """A loaded version's served logprobs differ from the trainer's beyond ``[parity] threshold``: it must serve nothing."""

    def __init__(self, model: str, reason: str, report: Mapping[str, Any]) -> None:
        super().__init__(f"{model}: {reason}")
        self.model = model
        self.reason = reason
        self.report = dict(report)


def probe_turns(learner_dir: Path, store: Any, candidates: Sequence[Sample], k: int) -> dict[str, list[str]]:
    """The probe's turn ids by kind: for each kind, the saved ones while they are all still in the store, else the newest
    candidates of that kind (``k`` greedy, one sampled at T != 1, one constrained; never a turn sampled under penalties
    or a logit bias); saved for the next loads. A kind without turns is left out ({} when there is none yet). A saved
    list (the greedy-only probe's file) is its greedy turns."""
    path = Path(learner_dir) / PROBE_FILE
    saved: dict[str, list[str]] = {}
    if path.exists():
        raw = json.loads(path.read_text())
        saved = {"greedy": [str(t) for t in raw]} if isinstance(raw, list) else {str(a): [str(t) for t in b] for a, b in raw.items()}
    newest = sorted(candidates, key=lambda s: s.created_at, reverse=True)
    chosen: dict[str, list[str]] = {}
    for kind in KINDS:
        kept = saved.get(kind) or []
        if kept and all(_kept(store.get_turn(t)) for t in kept):
            chosen[kind] = kept
        elif fresh := _fresh(kind, newest, store, k):
            chosen[kind] = fresh
    if chosen and chosen != saved:
        path.write_text(json.dumps(chosen))
    return chosen


_FITS: dict[str, Callable[[Sample], bool]] = {
    "greedy": lambda s: s.grammar is None,
    "sampled": lambda s: s.grammar is None and s.temperature != 1.0,  # T = 1 cannot tell logits from logits / T
    "constrained": lambda s: s.grammar is not None and s.grammar.get("kind") in GRAMMAR_KINDS,
}


def _fresh(kind: str, newest: Sequence[Sample], store: Any, k: int) -> list[str]:
    """The newest candidates of one kind (:data:`_FITS`) not sampled under penalties: ``k`` greedy, one of each other kind."""
    n = k if kind == "greedy" else 1
    out: list[str] = []
    for s in newest:
        if len(out) == n:
            break
        if _FITS[kind](s) and not _penalized(store.get_turn(s.turn_id)):
            out.append(s.turn_id)
    return out


def _kept(turn: Any) -> bool:
    """A saved probe turn stays while it is in the store (and was not sampled under penalties)."""
    return turn is not None and not _penalized(turn)


def _penalized(turn: Any) -> bool:
    """A stored turn sampled under penalties or a logit bias (False for one not in the store)."""
    return turn is not None and sampled_with_penalties(getattr(turn, "sampling", None) or {})


def parity_probe(
    client: httpx.Client, store: Any, trainer: Any, *, model: str, probe: Mapping[str, Sequence[str]], max_tokens: int
) -> dict[str, Any]:
    """Served vs trainer logprobs of the probe's decodes: ``{"mean_abs_logp_diff", "max_abs_logp_diff", "tokens", "turns",
    "kinds": {kind: {the same four, "temperatures" (decoded at; 0 = greedy), "grammar_mismatch" (turns)}}}``; a diff is None
    when no token was compared."""
    kinds: dict[str, dict[str, Any]] = {}
    decoded = _decode_all(client, store, probe, model=model, max_tokens=max_tokens)
    for kind in KINDS:
        diffs: list[float] = []
        mismatch = 0
        probes, served, temperatures = decoded[kind]
        scorable = set(trainer.replayable(probes)) if probes else set()
        mine = iter(trainer.token_logprobs([p for i, p in enumerate(probes) if i in scorable]) if scorable else [])
        for i, lps in enumerate(served):
            if i in scorable:
                trained = next(mine)
                diffs += [abs(a - b) for a, b in zip(lps, trained[: len(lps)], strict=True)]
            else:  # the served output breaks the recorded grammar: the trainer's constrained policy cannot produce it
                mismatch += 1
                diffs += [FORBIDDEN_DIFF] * len(lps)
        if served:
            kinds[kind] = {**_summary(diffs, len(served)), "temperatures": temperatures, "grammar_mismatch": mismatch}
    means = [k["mean_abs_logp_diff"] for k in kinds.values() if k["mean_abs_logp_diff"] is not None]
    maxes = [k["max_abs_logp_diff"] for k in kinds.values() if k["max_abs_logp_diff"] is not None]
    return {
        "mean_abs_logp_diff": max(means) if means else None,
        "max_abs_logp_diff": max(maxes) if maxes else None,
        "tokens": sum(k["tokens"] for k in kinds.values()),
        "turns": sum(k["turns"] for k in kinds.values()),
        "kinds": kinds,
    }


def refusal(report: Mapping[str, Any] | None, threshold: float) -> str | None:
    """Why a probed version must be refused (its worst kind's mean difference is above ``threshold``); None when it passes
    or was not probed."""
    if report is None or report.get("mean_abs_logp_diff") is None or report["mean_abs_logp_diff"] <= threshold:
        return None
    worst = max(
        (k for k, v in report.get("kinds", {}).items() if v.get("mean_abs_logp_diff") is not None),
        key=lambda k: report["kinds"][k]["mean_abs_logp_diff"],
        default=None,
    )
    on = f" on its {worst} probe turns" if worst else ""
    return f"parity: served and trainer logprobs differ by {report['mean_abs_logp_diff']:.3g} nats/token{on} (> {threshold:g})"


def _decode_all(
    client: httpx.Client, store: Any, probe: Mapping[str, Sequence[str]], *, model: str, max_tokens: int
) -> dict[str, tuple[list[Sample], list[list[float]], list[float]]]:
    """The served version's decodes of every kind's turns, by kind: each as the sample the trainer scores, its served
    logprobs, and the temperature it was decoded at. The requests go out at once (the server batches them; one turn's
    prefill and 16 decode steps each, which one after another took most of a probe's time); the store is read here,
    in the caller's thread, before any of them."""
    jobs: list[tuple[str, str, Any, float, dict[str, str] | None]] = []
    for kind in KINDS:
        for tid in probe.get(kind, ()):
            turn = store.get_turn(tid)
            if turn is None:
                continue
            grammar = _served_grammar(turn.sampling)  # the endpoint replays a recorded grammar whatever the kind: mirror it
            temperature = 0.0 if kind == "greedy" else _recorded_temperature(turn.sampling)
            jobs.append((kind, tid, turn.context_ids, temperature, grammar))

    def one(job: tuple[str, str, Any, float, dict[str, str] | None]) -> tuple[list[int], list[float]]:
        _, tid, _, temperature, _ = job
        body = {"n": 1, "model": model, "record": False, "temperature": temperature, "max_tokens": max_tokens, "seed": SEED}
        r = client.post(f"/admin/turns/{tid}/siblings", json=body)
        r.raise_for_status()
        [choice] = r.json()["data"]
        return list(choice["output_ids"]), list(choice["logprobs"])

    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), 8))) as pool:
        answers = list(pool.map(one, jobs))
    out: dict[str, tuple[list[Sample], list[list[float]], list[float]]] = {kind: ([], [], []) for kind in KINDS}
    for (kind, tid, context_ids, temperature, grammar), (ids, lps) in zip(jobs, answers, strict=True):
        if not ids or not lps:
            continue
        probes, served, temperatures = out[kind]
        probes.append(_probe_sample(tid, context_ids, ids, model, temperature=temperature if temperature > 0 else 1.0, grammar=grammar))
        served.append(lps)  # a final stop token has no logprob here: the trainer's first len(lps) are compared
        temperatures.append(temperature)
    return out


def _recorded_temperature(sampling: Mapping[str, Any]) -> float:
    """The turn's sampling temperature as the siblings endpoint reads it (1.0 when none is recorded; 0 = greedy)."""
    t = sampling.get("temperature", 1.0)
    return float(t) if isinstance(t, int | float) and t >= 0 else 1.0


def _served_grammar(sampling: Mapping[str, Any]) -> dict[str, str] | None:
    """The grammar the siblings endpoint decodes a turn under: its recorded ``{"kind", "spec"}`` of a replayable kind."""
    g = sampling.get("grammar")
    if isinstance(g, dict) and g.get("kind") in GRAMMAR_KINDS:
        return {"kind": str(g["kind"]), "spec": str(g.get("spec") or "")}
    return None


def _summary(diffs: Sequence[float], turns: int) -> dict[str, Any]:
    return {
        "mean_abs_logp_diff": sum(diffs) / len(diffs) if diffs else None,
        "max_abs_logp_diff": max(diffs) if diffs else None,
        "tokens": len(diffs),
        "turns": turns,
    }


def _probe_sample(
    turn_id: str, context_ids: Sequence[int], output_ids: list[int], model: str, *, temperature: float, grammar: dict[str, str] | None
) -> Sample:
    """A served decode as the trainer scores it: at the decode's temperature (1 for greedy: raw logits), under its grammar.

    The id is fresh per probe: the trainer caches a turn's grammar mask by id, and another probe of the turn has other tokens."""
    return Sample(
        turn_id=f"parity:{uuid.uuid4().hex[:12]}:{turn_id}",
        trajectory_id="parity",
        group_id="parity",
        turn_index=0,
        context_ids=list(context_ids),
        output_ids=output_ids,
        logprobs=[],
        loss_mask=[1] * len(output_ids),
        adapter=model,
        adapter_version=0,
        reward=None,
        trajectory_reward=None,
        temperature=temperature,
        created_at=0.0,
        grammar=grammar,
    )
