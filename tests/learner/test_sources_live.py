"""PATR trees and the RODS pool in the live learner against ``serve.py``'s app on a real port (tiny model).

The tiny model is random, so its FrozenLake paths end in unreadable replies or holes (reward 0): the point here is
the plumbing a user switches on with ``rollouts = "patr"`` and ``[rods]`` (trees grown through the runs endpoint's
segments and trained in the update, the pool sampled, scored, grown by verified variants and saved, and the
figures in the history, ``GET /admin/learner`` and ``/metrics``); the algorithms' numbers are tested in
``test_patr.py`` and ``test_rods.py``.
"""

from __future__ import annotations

import json
import tomllib

import httpx
import pytest

from learner.config import LearnerSettings
from learner.service import LearnerService, ServiceConfig

ADMIN = "sources-admin"
AGENT = {"name": "fl-agent", "temperature": 1.0, "max_turns": 4, "max_tokens_per_turn": 8, "task": "frozenlake", "adapter_family": "flp"}

CONFIG = """
family = "flp"
rollouts = "patr"

[lora]
rank = 4
alpha = 8
target_modules = ["q_proj", "v_proj"]

[trainer]
progress = false

[samples]
settle_s = 0

[patr]
leaves = 4
roots = 2
branch = 2

[rods]
enabled = true
seeds = 4
items_per_update = 2
tau = 0.0
variants = 2
max_candidates = 64
"""


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    return start_server("--admin-key", ADMIN, "--agent", json.dumps(AGENT), data_dir=tmp_path_factory.mktemp("sources-data"))


def test_patr_trees_and_the_rods_pool_run_in_the_live_learner(server, tiny_model_path):
    data = server.data_dir
    settings = LearnerSettings.model_validate(tomllib.loads(CONFIG))  # the config lines a user writes
    assert settings.rollouts == "patr" and settings.rods.enabled
    svc = LearnerService(
        ServiceConfig(
            data_dir=data, admin_url=server.base_url, admin_key=ADMIN, base_model=tiny_model_path, settings=settings, agent="fl-agent", gate_n=0
        )
    )
    assert svc.tick() is True  # no traffic needed: the learner makes its own rollouts
    rows = [json.loads(line) for line in (data / "learner" / "flp" / "history.jsonl").read_text().splitlines()]
    src = rows[-1]["sources"]
    patr, rods = src["patr"], src["rods"]
    assert patr["trees"] == 2 and patr["runs"] >= 4 and patr["tokens"] > 0 and 2 <= patr["leaves"] <= 8 and patr["failed"] == 0
    assert rods["visited"] == 2 and sum(rods["boundary_histogram"]) == 2
    assert rods["synthesis"]["asked"] == 2 and rods["added"] == rods["synthesis"]["added"] > 0  # tau 0: every visited item is synthesised from
    assert rods["pool_size"] == 4 + rods["added"]
    assert rows[-1]["metrics"]["samples"] >= patr["runs"] - patr["failed"]  # every tree node's turn was in the step
    pool = json.loads((data / "learner" / "flp" / "rods_pool.json").read_text())
    assert len(pool["items"]) == rods["pool_size"]
    status = httpx.get(server.base_url + "/admin/learner", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()
    (mine,) = [s for s in status["data"] if s["family"] == "flp"]
    assert mine["sources"]["rods"]["pool_size"] == rods["pool_size"] and "per_tree" not in mine["sources"]["patr"]
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert f'loopwise_learner_rods_pool_size{{family="flp"}} {float(rods["pool_size"])}' in metrics
    assert 'loopwise_learner_rods_boundary_items{bin="0-0.25",family="flp"}' in metrics
    assert 'loopwise_learner_patr_sampled_tokens{family="flp"}' in metrics
    # the segments never enter the live sample stream; the pool is picked up again by the next learner process
    again = LearnerService(svc.cfg)
    assert again.tick() is True
    rows = [json.loads(line) for line in (data / "learner" / "flp" / "history.jsonl").read_text().splitlines()]
    assert rows[-1]["metrics"]["skipped"].get("rerollout", 0) >= patr["runs"] - patr["failed"]
    assert rows[-1]["sources"]["rods"]["pool_size"] >= rods["pool_size"]


def test_rods_alone_rolls_out_pool_items_and_trains_on_them_through_the_store(server, tiny_model_path):
    data = server.data_dir
    raw = tomllib.loads(CONFIG)
    raw.pop("rollouts")
    raw.pop("patr")
    settings = LearnerSettings.model_validate({**raw, "family": "flr", "rods": {**raw["rods"], "group": 3, "variants": 1}})
    svc = LearnerService(
        ServiceConfig(
            data_dir=data, admin_url=server.base_url, admin_key=ADMIN, base_model=tiny_model_path, settings=settings, agent="fl-agent", gate_n=0
        )
    )
    record = svc.update(force=False)
    src = record["sources"]
    assert "patr" not in src and src["rods_runs"] == 6 and src["rods_sampled_tokens"] > 0  # 2 items x 3 runs
    assert src["rods"]["visited"] == 2 and src["rods"]["synthesis"]["asked"] == 2 and src["rods"]["pool_size"] == 4 + src["rods"]["added"]
    # the pool items' runs are ordinary recorded runs of the agent: this update's sample collection took them
    assert record["metrics"]["samples"] >= 6
