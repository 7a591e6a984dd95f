"""An agent's configuration: what it is called, what it says, which tools and model it uses, when it stops.

Agents come from the settings file (``[[agents]]`` tables) or ``POST /admin/agents``; both validate
through :class:`AgentConfig`, so a bad field is a clear 400 (or a startup error) naming it.

Not here: running an agent (``agents/loop.py``) or serving it (``agents/host.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agents.t2po import T2POConfig
from agents.tasks.kernels import CONVENTION as KERNEL_CONVENTION
from memory.config import MemoryConfig

AGENT_NAME = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"


class AgentConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=AGENT_NAME, description="the model name clients use to reach the agent")
    description: str = Field("", description="shown in GET /v1/models and /admin/agents")
    system_prompt: str = Field(
        "You are a helpful assistant.", description="the agent's system prompt (the stop policy's format instructions are appended)"
    )
    tools: tuple[str, ...] = Field((), description="tool names from the tool registry")
    model: str | None = Field(None, description="base model name, adapter alias (family) or family@N; default the base model")
    adapter_family: str | None = Field(
        None,
        description="the adapter family the learner trains for this agent: its champion (the alias) serves once one exists, else `model`",
    )
    stop_policy: Literal["answer", "fixed", "svr", "svr_r1"] = Field(
        "answer", description="answer: stop at the first answer without tool calls; fixed: run max_turns; svr / svr_r1: self-verifying stop"
    )
    stop_params: dict[str, Any] = Field(default_factory=dict, description="parameters of the stop policy (svr: tau; svr_r1: cap; fixed: fmt)")
    max_turns: int = Field(6, ge=1, le=64, description="most model calls in one run")
    token_budget: int = Field(4096, ge=1, description="most generated tokens in one run, over all turns")
    max_tokens_per_turn: int = Field(384, ge=1, description="most generated tokens in one model call")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    constrain_format: bool = Field(
        True,
        description="decode the svr / svr_r1 self-check format under a grammar so every turn parses (not for agents with tools or T²PO thinking)",
    )
    task: str | None = Field(None, description="a built-in task whose verifier rewards runs that name one of its problems")
    task_options: dict[str, Any] = Field(default_factory=dict, description="options of the task (e.g. difficulty)")
    t2po: T2POConfig = Field(default_factory=T2POConfig, description="T²PO thinking intervention and turn resampling (both off by default)")
    memory: MemoryConfig | None = Field(
        None, description="per-user memory rewritten by the MemoPilot copilot after each interaction (memory/config.py); off when absent"
    )

    @model_validator(mode="after")
    def _known_policy_params(self) -> AgentConfig:
        from agents.policies import make_policy

        make_policy(self.stop_policy, **self.stop_params)  # raises ValueError naming an unknown parameter
        return self


BUILTIN_AGENTS: tuple[dict[str, Any], ...] = (
    {
        "name": "calc-agent",
        "description": "Arithmetic with a calculator tool; stops at its first final answer.",
        "system_prompt": "You are a careful assistant. Use the calculator tool for arithmetic.",
        "tools": ("calculator",),
        "stop_policy": "answer",
        "task": "calc_arith",
        "adapter_family": "calc-lora",
    },
    {
        "name": "svr-agent",
        "description": "Solves, checks itself, and stops once it is confident (SVR, tau 0.7).",
        "system_prompt": "You are a careful problem solver.",
        "stop_policy": "svr",
        "stop_params": {"tau": 0.7},
        "task": "calc_arith",
        "adapter_family": "svr-lora",
    },
    {
        "name": "kernel-agent",
        "description": "Writes CUDA kernels for PyTorch modules: compile, check, time, revise (kernels task, up to 4 attempts).",
        "system_prompt": "You are an expert CUDA engineer. You replace PyTorch modules with correct, fast CUDA kernels. " + KERNEL_CONVENTION,
        "stop_policy": "answer",
        "task": "kernels",
        "task_options": {"reward": "kevin", "max_turns": 4},
        "adapter_family": "kernel-lora",
        "max_turns": 4,
        "max_tokens_per_turn": 2048,
        "token_budget": 8192,
    },
)
