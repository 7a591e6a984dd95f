"""An agent's memory configuration (the ``memory`` field of ``agents.config.AgentConfig``).

``"memory": {"scope": "user"}`` turns memory on for an agent with the defaults below; leaving the field
out (``None``) keeps it off. Validated like the rest of the agent config, so a bad value is a 400 on
``POST /admin/agents`` or a startup error.

Not here: what the options do at run time (``memory/copilot.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from memory.settings import MAX_MEMORY_CHARS


class MemoryConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["none", "append-all", "reflection", "memopilot"] = Field(
        "memopilot", description="how memory is rewritten after an interaction (memory/methods.py)"
    )
    scope: Literal["user", "session", "agent"] = Field(
        "user",
        description="whose memory: user (the request's user field), session (X-Session-Id, else user), agent (one per API key for this agent)",
    )
    when: Literal["interaction", "episode"] = Field(
        "interaction",
        description="rewrite after every run, or once per episode (a run with a verifier/environment reward ends one; "
        "the runs before it are buffered in this process)",
    )
    max_chars: int = Field(2000, ge=1, le=MAX_MEMORY_CHARS, description="longest memory text (at most the store's default limit, memory/settings.py)")
    adapter_family: str = Field(
        "memopilot", description="the copilot's adapter family: its champion serves once one is published, else the base model"
    )
    max_tokens: int = Field(512, ge=1, le=4096, description="most tokens the copilot generates per rewrite")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="the copilot's sampling temperature (0 = greedy)")
