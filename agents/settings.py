"""The served agents' server-level settings: ``[agents]`` in loopwise's root settings, ``serve.py``'s agent flags.

Declared once here (name, default, bounds, help; ``json_schema_extra={"flag": ...}`` names the flag):
``loopwise_settings.py`` (the root settings, beside ``serve.py``) embeds :class:`AgentSettings` as its ``agents`` section,
and ``serve.py``'s flags are generated from these fields. One agent's own configuration is ``agents/config.py``'s ``AgentConfig``; the
definitions here stay plain JSON objects until the host validates them through it.

Imports only pydantic and the standard library, so the root settings embed it, and ``serve.py`` parses its flags,
without importing the agents package (``tests/test_import_rules.py``).

Not here: building the tools and agents from these settings (``serve.py``, ``agents/host.py``).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class AgentSettings(BaseModel):
    """Served agents (``agents/``): the built-in ones, extra tools, and agent definitions."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    builtin: bool = Field(True, description="serve the built-in agents (calc-agent, svr-agent)", json_schema_extra={"flag": "--builtin-agents"})
    tools: tuple[str, ...] = Field((), description="extra tool as a dotted path, module:function (repeatable)", json_schema_extra={"flag": "--tool"})
    definitions: tuple[dict[str, Any], ...] = Field(
        (),
        description="an agent definition as a JSON object (repeatable; in a config file: [[agents.definitions]] tables)",
        json_schema_extra={"flag": "--agent"},
    )

    @field_validator("definitions", mode="before")
    @classmethod
    def _json_items(cls, v: Any) -> Any:
        if isinstance(v, str | dict):
            v = [v]
        out = []
        for item in v or ():
            if isinstance(item, str):
                try:
                    item = json.loads(item)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"--agent must be a JSON object: {exc.msg}") from None
            out.append(item)
        return tuple(out)
