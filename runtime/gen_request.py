"""The internal request every API is translated into: ``GenRequest`` (with ``NamedTool``, ``OutputFormat``, ``ToolChoice``).

Chat Completions, Responses, Anthropic Messages and Completions each turn their wire format into one
``GenRequest``: chat-template messages, tools, tool choice, output format, sampling. ``runtime/generation.py`` runs it
and ``runtime/constraints.py`` builds its decoding constraint.

Not here: any wire format (the ``serving_*`` modules), validation against the model (the context length, the logit
bias's vocabulary: ``runtime/generation.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class NamedTool:
    """``tool_choice`` naming one function: exactly one call to it is decoded."""

    name: str


@dataclass(frozen=True)
class OutputFormat:
    """A structured-output constraint on the reply text (``response_format``, ``text.format``)."""

    kind: Literal["json_object", "json_schema"]
    schema: dict[str, Any] | None = None
    name: str | None = None


ToolChoice = Literal["none", "auto", "required"] | NamedTool | None


@dataclass
class GenRequest:
    """What every API asks the model for, in one vocabulary.

    ``messages`` are chat-template dicts (``role``, ``content`` text, assistant ``tool_calls`` with
    arguments as objects, tool ``tool_call_id``); ``tools`` are OpenAI chat-shaped tool dicts
    (``{"type": "function", "function": {"name", "description", "parameters"}}``). ``prompt_ids`` set
    means a raw prompt (``/v1/completions``): no chat template, no tools.
    """

    model: str
    messages: list[dict[str, Any]]
    api: str  # which wire format asked (recorded with the turn's sampling parameters)
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool = True
    output_format: OutputFormat | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the wire field's name, for error messages
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    logprobs_with_stop: bool = False  # a final stop token keeps its logprob entry (legacy completions' echo, as vLLM's)
    top_logprobs: int = 0
    presence_penalty: float = 0.0  # OpenAI's penalties and logit bias (token id -> bias); recorded with the turn
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    user: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None  # the raw prompt as text, for records (with prompt_ids)
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs with this many alternatives (raw prompts; runtime/engine.py)
    prompt_logprobs_param: str = "prompt_logprobs"  # the wire field that asked for them, for error messages
    messages_param: str = "messages"
    session_id: str | None = None  # the session to record in (else X-Session-Id, else user); e.g. a chained response's
    tag: str | None = None  # the client's tag (chat ``metadata.tag``), recorded for learners' traffic filters

    @property
    def tools_on(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> bool:
        return self.tools_on and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedTool))

    def tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def forced_names(self) -> set[str] | None:
        """The names the one forced call may have (the ones its grammar admits); None when no call is forced."""
        if not self.forced_tool:
            return None
        return {self.tool_choice.name} if isinstance(self.tool_choice, NamedTool) else self.tool_names()
