"""The logprob parity probe (``learner/parity.py``) on every kind of turn, for every estimator, against ``serve.py``'s app.

A real server (the tiny model in the embedded engine, SQLite store, admin API) records chat turns decoded
greedily, sampled at T = 0.3 and constrained by a JSON grammar, and multi-turn agent runs; real learners
(``LearnerService`` with ``LoRATrainer``) train on them, publish, load and probe. The broken engines are the
embedded engine with its sampling step wrapped (``runtime.engines.embedded.sample_next``, the one call that
computes the logprobs it reports, and the xgrammar mask it applies before): one reports the logprobs of the raw
logits at T != 1 (vLLM's default ``logprobs_mode = "raw_logprobs"``), one those of the distribution before the
grammar mask, one does not apply the grammar at all. A mis-scaled load is a published adapter whose config
says alpha x 8 (the runtime applies 8x the trained update).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

import learner.update as update_mod
from learner.config import LearnerSettings
from learner.parity import FORBIDDEN_DIFF, PROBE_FILE, ParityRefused, probe_turns, refusal
from learner.samples import Cursor, Sample, collect_samples
from learner.service import LearnerService, ServiceConfig
from learner.update import estimate

ADMIN = "parity-admin"
THRESHOLD = 0.05
MULTI_AGENT = {
    "name": "rtpo-agent",
    "temperature": 1.0,
    "stop_policy": "fixed",
    "max_turns": 3,
    "max_tokens_per_turn": 6,
    "task": "basic_arithmetic",
    "adapter_family": "rp",
}


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    return start_server("--admin-key", ADMIN, "--agent", json.dumps(MULTI_AGENT), data_dir=tmp_path_factory.mktemp("parity-data"))


def loaded(server) -> set[str]:
    r = httpx.get(server.base_url + "/admin/adapters", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    return {a["name"] for a in r.json()["data"]}


def service(server, tiny_model_path: Path, family: str, *, agent: str | None = None, estimator: str = "grpo", **more: Any) -> LearnerService:
    s: dict[str, Any] = {
        "family": family,
        "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "trainer": {"lr": 1e-2, "progress": False, "estimator": estimator},  # lr: a visible change in one step, so a wrong scale shows
        "samples": {"settle_s": 0, "reward_sources": ["feedback"]},
        "parity": {"threshold": THRESHOLD, "turns": 2},
        **more,
    }
    cfg = ServiceConfig(
        data_dir=server.data_dir,
        admin_url=server.base_url,
        admin_key=ADMIN,
        base_model=tiny_model_path,
        settings=LearnerSettings.model_validate(s),
        agent=agent,
        gate_n=0,
    )
    return LearnerService(cfg)


def chat_traffic(server, tag: str, *, temperature: float | None = None, response_format: dict[str, Any] | None = None) -> None:
    """One prompt answered 4 times (one group), rewarded 1, 0, 1, 0, tagged for the learner's filter."""
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": f"{tag} at {temperature}"}], "max_tokens": 6, "n": 4}
    body["metadata"] = {"tag": tag}
    if temperature is not None:
        body["temperature"] = temperature
    if response_format is not None:
        body["response_format"] = response_format
        body["max_tokens"] = 12
    r = httpx.post(server.url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    for i, c in enumerate(r.json()["loopwise"]["choices"]):
        httpx.post(server.url + "/feedback", json={"turn_id": c["turn_id"], "reward": float(i % 2 == 0)}, timeout=60).raise_for_status()


def raw_logit_logprobs(real: Any) -> Any:
    """The sampling step of an engine that reports ``log_softmax(logits)`` whatever the temperature (tokens still drawn at T)."""

    def sample(logits: torch.Tensor, rows: list[Any], *rest: Any) -> Any:
        out = real(logits, rows, *rest)
        raw = torch.log_softmax(logits, dim=-1)  # (B, V), the grammar mask kept: only the temperature is ignored
        out.logprobs = raw.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0].tolist()
        return out

    return sample


def wrong_scale(real: Any) -> Any:
    """``publish_adapter`` writing alpha x 8 into the adapter's config: the runtime loads 8x the trained update."""

    def publish(model: Any, *a: Any, **kw: Any) -> Any:
        cfg = model.peft_config["default"]
        alpha = cfg.lora_alpha
        cfg.lora_alpha = alpha * 8
        try:
            return real(model, *a, **kw)
        finally:
            cfg.lora_alpha = alpha

    return publish


@pytest.fixture(scope="module")
def chat_learner(server, tiny_model_path):
    """A GRPO chat learner after its first update on greedy, sampled (T = 0.3) and constrained (json_object, T = 0.7) turns."""
    chat_traffic(server, "conv", temperature=0.0)
    chat_traffic(server, "conv", temperature=0.3)
    chat_traffic(server, "conv", temperature=0.7, response_format={"type": "json_object"})
    svc = service(server, tiny_model_path, "conv", traffic={"chat": True, "agents": [], "tags": ["conv"]})
    record = svc.update()
    return svc, record


def test_an_honest_load_passes_the_probe_on_greedy_sampled_and_constrained_turns(chat_learner):
    svc, record = chat_learner
    parity = record["gate"]["parity"]
    assert record["gate"]["decision"] == "passed", record["gate"]
    kinds = parity["kinds"]
    assert set(kinds) == {"greedy", "sampled", "constrained"}
    for kind, k in kinds.items():
        assert k["tokens"] > 0 and k["mean_abs_logp_diff"] < THRESHOLD, (kind, k)  # float noise only (about 0.002)
    assert kinds["greedy"]["turns"] == 2 and kinds["greedy"]["temperatures"] == [0.0, 0.0]  # scored on the raw logits
    assert kinds["sampled"]["turns"] == 1 and kinds["sampled"]["temperatures"] == [0.3]  # at its recorded temperature
    assert kinds["constrained"]["temperatures"] == [0.7] and kinds["constrained"]["grammar_mismatch"] == 0
    assert parity["mean_abs_logp_diff"] == max(k["mean_abs_logp_diff"] for k in kinds.values())
    assert parity["tokens"] == sum(k["tokens"] for k in kinds.values())
    assert svc.status.last_parity["kinds"] == kinds and svc.status.last_parity["model"] == "conv@1"
    saved = json.loads((svc.dir / PROBE_FILE).read_text())  # the probe, fixed for the next loads
    store = svc.store
    assert all(store.get_turn(t).sampling.get("grammar") is None for t in saved["greedy"] + saved["sampled"])
    assert store.get_turn(saved["sampled"][0]).sampling["temperature"] == 0.3
    assert store.get_turn(saved["constrained"][0]).sampling["grammar"]["kind"] == "json_object"


def test_the_probe_refuses_an_engine_that_reports_raw_logit_logprobs_on_a_sampled_turn(chat_learner, server, monkeypatch):
    import runtime.engines.embedded as embedded

    svc, _ = chat_learner
    chat_traffic(server, "conv", temperature=0.0)  # recorded honestly; the next version trains on it
    monkeypatch.setattr(embedded, "sample_next", raw_logit_logprobs(embedded.sample_next))
    record = svc.update()
    gate = record["gate"]
    assert gate["decision"] == "refused" and gate["reason"].startswith("parity:"), gate
    kinds = gate["parity"]["kinds"]
    assert kinds["greedy"]["mean_abs_logp_diff"] < THRESHOLD  # greedy logprobs are of the raw logits: a greedy-only probe passes it
    assert kinds["sampled"]["mean_abs_logp_diff"] > THRESHOLD  # log_softmax(logits) is not log_softmax(logits / 0.3)
    assert gate["parity"]["mean_abs_logp_diff"] >= kinds["sampled"]["mean_abs_logp_diff"]
    assert gate["new"] not in loaded(server)
    assert "sampled probe turns" in (refusal(gate["parity"], THRESHOLD) or "")


def test_the_probe_refuses_an_engine_that_mishandles_a_constrained_turns_grammar(chat_learner, monkeypatch):
    import xgrammar

    import runtime.engines.embedded as embedded
    from runtime.engine import MIN_TEMPERATURE

    svc, _ = chat_learner
    trainer = svc.state.get_trainer()
    champion = svc.state.champion()
    assert champion == "conv@1"
    svc.release.restart_from_champion(trainer)  # the trainer holds the served champion's weights (whatever the tests before trained)
    honest = svc.release.parity(trainer, champion)
    assert refusal(honest, THRESHOLD) is None
    unmasked: list[torch.Tensor] = []
    real_apply, real_sample = xgrammar.apply_token_bitmask_inplace, embedded.sample_next

    def apply(logits: torch.Tensor, bitmask: torch.Tensor, indices: Any = None) -> None:
        unmasked.append(logits.clone())  # (B, V) before the mask
        real_apply(logits, bitmask, indices=indices)

    def sample(logits: torch.Tensor, rows: list[Any], *rest: Any) -> Any:
        """SGLang's way: tokens drawn under the mask, logprobs of the unmasked logits / T."""
        out = real_sample(logits, rows, *rest)
        if unmasked:
            temps = torch.tensor([r.temperature if r.temperature >= MIN_TEMPERATURE else 1.0 for r in rows])  # (B,)
            lp = torch.log_softmax(unmasked.pop() / temps[:, None], dim=-1)  # (B, V)
            out.logprobs = lp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0].tolist()
        return out

    monkeypatch.setattr(xgrammar, "apply_token_bitmask_inplace", apply)  # the engine imports xgrammar where it masks
    monkeypatch.setattr(embedded, "sample_next", sample)
    report = svc.release.parity(trainer, champion)
    assert report is not None
    kinds = report["kinds"]
    assert kinds["greedy"]["mean_abs_logp_diff"] < THRESHOLD and kinds["sampled"]["mean_abs_logp_diff"] < THRESHOLD
    assert kinds["constrained"]["mean_abs_logp_diff"] > THRESHOLD  # the mask's log of the allowed mass, missing on the served side
    assert kinds["constrained"]["grammar_mismatch"] == 0 and "constrained probe turns" in (refusal(report, THRESHOLD) or "")

    # an engine that does not apply the grammar at all: its output breaks the grammar, which the trainer's policy never produces
    monkeypatch.setattr(xgrammar, "apply_token_bitmask_inplace", lambda logits, bitmask, indices=None: None)
    monkeypatch.setattr(embedded, "sample_next", real_sample)
    report = svc.release.parity(trainer, champion)
    assert report is not None
    kinds = report["kinds"]
    assert kinds["constrained"]["grammar_mismatch"] == 1 and kinds["constrained"]["mean_abs_logp_diff"] == FORBIDDEN_DIFF
    assert kinds["greedy"]["mean_abs_logp_diff"] < THRESHOLD and refusal(report, THRESHOLD) is not None


def agent_traffic(server, problems: range) -> None:
    """Three-turn agent runs, four per problem, with alternating feedback (group variance)."""
    for p in problems:
        for k in range(4):
            body = {"task": "basic_arithmetic", "problem_index": p, "seed": 0, "sample_seed": k}
            r = httpx.post(server.url + f"/agents/{MULTI_AGENT['name']}/runs", json=body, timeout=120)
            assert r.status_code == 200, r.text
            fb = {"trajectory_id": r.json()["trajectory_id"], "reward": float(k % 2)}
            httpx.post(server.url + "/feedback", json=fb, timeout=60).raise_for_status()


def test_an_rtpo_learner_probes_its_intermediate_versions_and_refuses_a_mis_scaled_load(server, tiny_model_path, monkeypatch):
    agent_traffic(server, range(2))
    rerollouts = {"branches": 1, "siblings": 2, "refresh": True}
    svc = service(server, tiny_model_path, "rp", agent=MULTI_AGENT["name"], estimator="rtpo", rerollouts=rerollouts)
    svc.check_setup()  # an RTPO learner with re-rollouts (its agent has a task)
    trainer = svc.state.get_trainer()
    batch = collect_samples(svc.store, family="rp", cursor=Cursor(), cfg=svc.cfg.settings.samples, min_version=0, traffic=svc.traffic)
    samples = batch.samples
    assert samples and all(s.turn_index in (0, 1, 2) for s in samples)

    # an RTPO step, published as an intermediate for the next step's siblings: probed right after its load
    assert trainer.step(samples, estimate(samples, "rtpo", {})).optimizer_step
    assert svc.release.publish_intermediate(trainer, candidates=samples) == "rp@1"
    assert svc.status.last_parity["intermediate"] is True and svc.status.last_parity["model"] == "rp@1"
    assert refusal(svc.status.last_parity, THRESHOLD) is None and svc.status.last_parity["kinds"]["greedy"]["tokens"] > 0
    assert "rp@1" in loaded(server)

    # the next step's intermediate, loaded mis-scaled: refused, unloaded, and never sampled from
    assert trainer.step(samples, estimate(samples, "rtpo", {})).optimizer_step
    monkeypatch.setattr(update_mod, "publish_adapter", wrong_scale(update_mod.publish_adapter))
    with pytest.raises(ParityRefused) as refused:
        svc.release.publish_intermediate(trainer, candidates=samples)
    assert refused.value.model == "rp@2" and refused.value.reason.startswith("parity:")
    assert refused.value.report["mean_abs_logp_diff"] > THRESHOLD
    assert "rp@2" not in loaded(server) and "rp@2" in svc.state.rejected_names
    assert svc.steps.rollout_model(trainer) != "rp@2"  # re-rollouts never sample from it, even after the sweep

    # the sweep's final version (the update's trained samples are the RTPO learner's candidates too), mis-scaled: refused
    assert trainer.step(samples, estimate(samples, "rtpo", {})).optimizer_step  # published mis-scaled still (update_mod, above)
    svc.state.trained = samples
    gate = svc.release.publish_and_gate(trainer)
    assert gate["decision"] == "refused" and gate["reason"].startswith("parity:") and gate["parity"]["mean_abs_logp_diff"] > THRESHOLD
    assert "rp@3" not in loaded(server)


def _sample(turn_id: str, at: float, *, temperature: float = 1.0, grammar: dict[str, str] | None = None) -> Sample:
    return Sample(
        turn_id=turn_id,
        trajectory_id=f"traj-{turn_id}",
        group_id="g",
        turn_index=0,
        context_ids=[1, 2],
        output_ids=[3],
        logprobs=[-1.0],
        loss_mask=[1],
        adapter=None,
        adapter_version=0,
        reward=1.0,
        trajectory_reward=None,
        temperature=temperature,
        created_at=at,
        grammar=grammar,
    )


def test_probe_turns_picks_each_kind_once_and_keeps_it_while_the_store_has_it(tmp_path):
    present = {"a", "b", "c", "s", "j", "t"}
    store = SimpleNamespace(get_turn=lambda t: object() if t in present else None)
    json_object = {"kind": "json_object", "spec": ""}
    first = [_sample("a", 1), _sample("b", 2), _sample("c", 3), _sample("s", 0.5, temperature=0.3), _sample("j", 0, grammar=json_object)]
    assert probe_turns(tmp_path, store, first, 2) == {"greedy": ["c", "b"], "sampled": ["s"], "constrained": ["j"]}
    # fixed: newer candidates do not replace a kind whose turns are all still stored
    later = [_sample("t", 9, temperature=0.5), _sample("k", 9, grammar={"kind": "?", "spec": ""})]
    assert probe_turns(tmp_path, store, later, 2) == {"greedy": ["c", "b"], "sampled": ["s"], "constrained": ["j"]}
    present.discard("s")  # the sampled turn left the store: chosen again among the candidates
    assert probe_turns(tmp_path, store, later, 2)["sampled"] == ["t"]
    assert json.loads((tmp_path / PROBE_FILE).read_text())["sampled"] == ["t"]
    # the greedy-only probe's file (a list) is its greedy turns; the kinds it lacks join when the candidates have them
    (tmp_path / PROBE_FILE).write_text(json.dumps(["a", "b"]))
    assert probe_turns(tmp_path, store, first[:3], 2) == {"greedy": ["a", "b"]}
    assert probe_turns(tmp_path, store, first, 2) == {"greedy": ["a", "b"], "sampled": ["s"], "constrained": ["j"]}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert probe_turns(empty, store, [], 2) == {} and not (empty / PROBE_FILE).exists()  # nothing trained yet: no probe
