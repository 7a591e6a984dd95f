"""Logprob parity after every load: the serving engine and the trainer must agree on what the new version is.

    report = parity_probe(admin_client, store, trainer, model="chat-lora@4", turn_ids=probe_ids, max_tokens=16)
    report["mean_abs_logp_diff"]   # nats per token; the learner refuses the version above [parity] threshold

A fixed probe of recorded turns (chosen once, from the first update's trained turns without a decoding
constraint, and kept in ``<learner dir>/parity_probe.json``) is decoded greedily by the served version from
each turn's exact recorded context (``POST /admin/turns/{id}/siblings`` with ``record: false``, so nothing is
recorded); the trainer then scores the same output tokens with its copy of the weights (teacher forcing), and
the mean absolute difference of the per-token logprobs is the metric (TRL logs the same number as
``sampling_logp_difference``; prime-rl's ``mismatch_kl`` is its KL form). Both sides compute logprobs of the
raw logits (greedy decoding), so an honest load differs by float noise only; a wrong LoRA scale (alpha/r), a
wrong dtype or a missing target module shows up as a large difference before any user is served by it.

Not here: what the learner does with a refused version (``learner/release.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from learner.samples import Sample

PROBE_FILE = "parity_probe.json"


def probe_turns(learner_dir: Path, store: Any, candidates: Sequence[Sample], k: int) -> list[str]:
    """The probe's turn ids: the saved ones while they are all still in the store, else the newest ``k`` unconstrained
    candidates (saved for the next loads); [] when there is none yet."""
    path = Path(learner_dir) / PROBE_FILE
    if path.exists():
        saved = [str(t) for t in json.loads(path.read_text())]
        if saved and all(store.get_turn(t) is not None for t in saved):
            return saved
    chosen = [s.turn_id for s in sorted(candidates, key=lambda s: s.created_at, reverse=True) if s.grammar is None][:k]
    if chosen:
        path.write_text(json.dumps(chosen))
    return chosen


def parity_probe(client: httpx.Client, store: Any, trainer: Any, *, model: str, turn_ids: Sequence[str], max_tokens: int) -> dict[str, Any]:
    """Served vs trainer logprobs of greedy decodes from the probe's contexts: ``{"mean_abs_logp_diff", "max_abs_logp_diff",
    "tokens", "turns"}`` (the diff is None when no token could be compared)."""
    probes: list[Sample] = []
    served: list[list[float]] = []
    for tid in turn_ids:
        turn = store.get_turn(tid)
        if turn is None:
            continue
        body = {"n": 1, "model": model, "record": False, "temperature": 0, "max_tokens": max_tokens, "seed": 0}
        r = client.post(f"/admin/turns/{tid}/siblings", json=body)
        r.raise_for_status()
        [choice] = r.json()["data"]
        ids, lps = list(choice["output_ids"]), list(choice["logprobs"])
        if not ids or not lps:
            continue
        probes.append(_probe_sample(tid, turn.context_ids, ids, model))
        served.append(lps)
    if not probes:
        return {"mean_abs_logp_diff": None, "max_abs_logp_diff": None, "tokens": 0, "turns": 0}
    mine = trainer.token_logprobs(probes)
    diffs = [abs(a - b) for s, t in zip(served, mine, strict=True) for a, b in zip(s, t[: len(s)], strict=False)]
    return {
        "mean_abs_logp_diff": sum(diffs) / len(diffs) if diffs else None,
        "max_abs_logp_diff": max(diffs) if diffs else None,
        "tokens": len(diffs),
        "turns": len(probes),
    }


def _probe_sample(turn_id: str, context_ids: Sequence[int], output_ids: list[int], model: str) -> Sample:
    """A greedy decode as the trainer scores it: temperature 1 (greedy logprobs are of the raw logits), no grammar."""
    return Sample(
        turn_id=f"parity:{turn_id}",
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
        temperature=1.0,
        created_at=0.0,
    )
