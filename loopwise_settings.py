"""loopwise's root settings: one frozen pydantic-settings object, built once at the edge by ``serve.py``.

It embeds every package's settings as they are declared in their own packages: the runtime's (``runtime/settings.py``:
``[server]``, ``[engine]``, ``[recorder]``, ``[feedback]``, ``[admission]``, ``[adapters]``, ``[sglang]``, ``[vllm]``), the
served agents' (``agents/settings.py``: ``[agents]``), the memory store's (``memory/settings.py``: ``[memory]``) and the
learner processes ``serve.py`` starts (``[learner]``, declared here). Each component receives only its own sub-model: no
package imports this module (``tests/test_import_rules.py``), only ``serve.py`` and the tests.

Sources, highest priority first: ``serve.py`` flags, ``LOOPWISE_…`` environment variables (nested
with ``__``, e.g. ``LOOPWISE_ENGINE__MAX_BATCH_SIZE=16``; the server fields also answer to their
short names, e.g. ``LOOPWISE_PORT``), an optional TOML/JSON config file (``LOOPWISE_CONFIG`` or
``--config``), then the defaults.

``serve.py``'s flags are generated from the fields of every sub-model (name, help text, default;
``json_schema_extra={"flag": ...}`` renames one, e.g. ``--learner-family``), so there is no second list to keep in sync.
The learner's schedule (when it updates, its gate and A/B bounds) is declared once, in ``learner.config.ScheduleConfig``:
``[learner]`` and ``[[learner.jobs]]`` take those fields (default, bounds, help) and the A/B bounds' rule
(``check_ab_bounds``) from it.

Not here: the sections' own fields and rules (their packages), validation that needs the model loaded (context length,
vocabulary: the engine), building anything from the settings (``serve.py``).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from agents.settings import AgentSettings
from learner.config import ScheduleConfig, check_ab_bounds
from memory.settings import MemorySettings
from runtime.settings import (
    AdapterSettings,
    AdmissionSettings,
    EngineSettings,
    FeedbackSettings,
    RecorderSettings,
    ServerSettings,
    SGLangSettings,
    VLLMSettings,
    check_backend,
)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _schedule(name: str, flag: str | None = None) -> Any:
    """A learner field as ``learner.config.ScheduleConfig`` declares it (default, bounds, help), under ``flag`` here."""
    return FieldInfo.merge_field_infos(ScheduleConfig.model_fields[name], json_schema_extra={"flag": flag} if flag else None)


class LearnerJob(_Frozen):
    """One learner process: one adapter family, trained on the traffic its settings' ``[traffic]`` table selects."""

    family: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="the adapter family it publishes (family@N)")
    agent: str = Field("", description="train on this agent's runs and gate with it ('' = the [traffic] filter, no gate)")
    min_new_trajectories: int = _schedule("min_new_trajectories")
    gate_n: int = _schedule("gate_n")
    ab_min_samples: int = _schedule("ab_min_samples")
    ab_max_samples: int = _schedule("ab_max_samples")
    config: Path | None = Field(None, description="a learner config file; the tables in settings override its tables")
    settings: dict[str, Any] = Field(default_factory=dict, description="learner config tables ([traffic], [singletons], [trainer], ...)")

    @model_validator(mode="after")
    def _ab_bounds(self) -> LearnerJob:
        check_ab_bounds(self)  # pydantic locates it: learner.jobs.N
        return self


class LearnerProcessSettings(_Frozen):
    """The learner process ``serve.py`` starts (``python -m learner run``); see ``learner/service.py``."""

    enabled: bool = Field(True, description="start the learner process next to the server", json_schema_extra={"flag": "--learner"})
    agent: str = _schedule("agent", "--learner-agent")
    family: str = Field("calc-lora", description="the adapter family the learner publishes", json_schema_extra={"flag": "--learner-family"})
    min_new_trajectories: int = _schedule("min_new_trajectories", "--learner-min-trajectories")
    gate_n: int = _schedule("gate_n", "--learner-gate-n")
    ab_min_samples: int = _schedule("ab_min_samples", "--learner-ab-min-samples")
    ab_max_samples: int = _schedule("ab_max_samples", "--learner-ab-max-samples")
    config: Path | None = Field(
        None, description="learner config ([lora], [trainer], [samples], [rerollouts] tables)", json_schema_extra={"flag": "--learner-config"}
    )
    chat: bool = Field(
        True,
        description=(
            "also start a learner for plain chat traffic (family chat_family, one-off prompts against a running baseline) next to the "
            "agent's; off, or when the learner agent is not served, the one learner trains on all traffic"
        ),
        json_schema_extra={"flag": "--chat-learner"},
    )
    chat_family: str = Field(
        "chat-lora",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="the chat learner's adapter family",
        json_schema_extra={"flag": "--chat-family"},
    )
    jobs: tuple[LearnerJob, ...] = Field(
        (),
        description=(
            "several learners, one per adapter family, each with its own traffic filter: [[learner.jobs]] tables (family, agent, "
            "min_new_trajectories, gate_n, ab_min_samples, ab_max_samples, config, and [learner.jobs.settings] with the learner's "
            "tables: [traffic], [singletons], [trainer], ...); given, they replace the one-family flags and the chat learner"
        ),
        json_schema_extra={"flag": "--learner-job"},
    )

    @field_validator("jobs", mode="before")
    @classmethod
    def _json_jobs(cls, v: Any) -> Any:
        if isinstance(v, str | dict):
            v = [v]
        return [json.loads(x) if isinstance(x, str) else x for x in v] if isinstance(v, list | tuple) else v

    @model_validator(mode="after")
    def _ab_bounds(self) -> LearnerProcessSettings:
        check_ab_bounds(self)  # names the --learner-ab-* flags; pydantic locates it: learner
        return self

    @model_validator(mode="after")
    def _distinct_families(self) -> LearnerProcessSettings:
        families = [j.family for j in self.jobs]
        if len(set(families)) != len(families):
            raise ValueError(f"[[learner.jobs]] need distinct families (one learner per adapter family), got {families}")
        return self


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOPWISE_", env_nested_delimiter="__", frozen=True, extra="forbid")

    config: Path | None = Field(None, description="optional TOML or JSON config file")
    server: ServerSettings = Field(default_factory=ServerSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    recorder: RecorderSettings = Field(default_factory=RecorderSettings)
    feedback: FeedbackSettings = Field(default_factory=FeedbackSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    adapters: AdapterSettings = Field(default_factory=AdapterSettings)
    sglang: SGLangSettings = Field(default_factory=SGLangSettings)
    vllm: VLLMSettings = Field(default_factory=VLLMSettings)
    agents: AgentSettings = Field(default_factory=AgentSettings)
    learner: LearnerProcessSettings = Field(default_factory=LearnerProcessSettings)
    memory: MemorySettings = Field(default_factory=MemorySettings)

    @model_validator(mode="after")
    def _check_backend(self) -> Settings:
        check_backend(self.server, self.engine, self.adapters, self.sglang, self.vllm)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _ConfigFileSource(settings_cls))


class _ConfigFileSource(PydanticBaseSettingsSource):
    """Reads ``LOOPWISE_CONFIG`` (TOML or JSON) if set. ``serve.py`` passes ``--config`` the same way."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        import os

        path = os.environ.get("LOOPWISE_CONFIG")
        return load_config_file(Path(path)) if path else {}


def load_config_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc}") from exc
    data: dict[str, Any] = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    return data


def short_env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """``LOOPWISE_PORT`` etc.: the server fields also answer to their short names."""
    out: dict[str, Any] = {}
    for name in ServerSettings.model_fields:
        key = f"LOOPWISE_{name.upper()}"
        if key in environ:
            out[name] = environ[key]
    return out
