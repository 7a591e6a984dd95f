"""The learning benchmarks' harness (``bench/_rl_harness.py``) releases through the learner's own jobs.

Its ``PromoteService`` once overrode a method the service no longer called (the release job had moved to
``learner/release.py``), so every benchmark update after the first tried to open an A/B experiment and died with a
409; these tests fail on that shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench._rl_harness import PromoteRelease, PromoteService
from learner.config import LearnerSettings
from learner.service import ServiceConfig


class _Admin:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def set_alias(self, family: str, name: str) -> None:
        self.calls.append(("alias", (family, name)))

    def create_experiment(self, config: dict[str, Any]) -> None:  # what the product's release does with a champion
        raise AssertionError("a benchmark's learner opened an A/B experiment")


def _service(tmp_path: Path) -> PromoteService:
    """A benchmark's learner for family ``fam`` (no runtime behind its admin URL: the tests replace what calls it)."""
    cfg = ServiceConfig(
        data_dir=tmp_path,
        admin_url="http://127.0.0.1:9",
        admin_key="k",
        base_model=tmp_path,
        settings=LearnerSettings.model_validate({"family": "fam"}),
        agent="a",
        gate_n=0,
    )
    return PromoteService(cfg)


def test_every_job_that_releases_promotes_the_newest_version(tmp_path: Path, monkeypatch) -> None:
    svc = _service(tmp_path)
    assert isinstance(svc.release, PromoteRelease)
    assert svc.steps.release is svc.release and svc.scheduler.release is svc.release

    admin = _Admin()
    monkeypatch.setattr(svc.state, "admin", admin)
    for version in (1, 2):  # the second release has a champion: the product would open an experiment here
        monkeypatch.setattr(svc.release, "publish_current", lambda trainer, meta=None, v=version: f"{svc.state.family}@{v}")
        gate = svc.release.publish_and_gate(trainer=None)  # type: ignore[arg-type]
        assert gate == {"decision": "promoted", "new": f"{svc.state.family}@{version}"}
        assert svc.state.status.champion == f"{svc.state.family}@{version}"
    assert [c[1][1] for c in admin.calls] == [f"{svc.state.family}@1", f"{svc.state.family}@2"]


def test_a_resumed_run_serves_the_newest_published_version_again(tmp_path: Path, monkeypatch) -> None:
    """A server restarted for ``--resume`` once served the base model for the family (its alias was gone): every run
    sampled the base, the learner skipped them all as stale and an arm ended on 17,799 tokens that trained nothing."""
    svc = _service(tmp_path)
    admin, loaded, aliases = _Admin(), [], {}
    monkeypatch.setattr(svc.state, "admin", admin)
    monkeypatch.setattr(svc.state, "ensure_loaded", lambda v: loaded.append(v) or f"fam@{v}")
    monkeypatch.setattr(svc.state, "champion", lambda: aliases.get("fam"))
    assert svc.serve_newest() is None and loaded == [] and admin.calls == []  # nothing published yet: the base serves
    for v in (1, 3, 2):
        (tmp_path / "adapters" / "fam" / f"v{v}").mkdir(parents=True)
    assert svc.serve_newest() == "fam@3" and loaded == [3] and admin.calls == [("alias", ("fam", "fam@3"))]
    assert svc.state.status.champion == "fam@3"
    aliases["fam"] = "fam@3"  # already served: loaded (a no-op when it is) and no alias flip
    assert svc.serve_newest() == "fam@3" and admin.calls == [("alias", ("fam", "fam@3"))]
