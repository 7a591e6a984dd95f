"""Pydantic models of the OpenAI Chat Completions request and response (the subset loopwise serves).

Requests are validated here; every failure becomes a 400 in OpenAI's error envelope with ``param``
naming the field (``runtime/errors.py``). Unknown request fields are ignored, as OpenAI-compatible
servers do, so newer SDKs keep working. ``presence_penalty`` / ``frequency_penalty`` (-2 to 2) and
``logit_bias`` (at most 300 token ids, as strings, to a bias from -100 to 100: :func:`check_logit_bias`,
shared with ``/v1/completions``) are served; whether a token id is in the model's vocabulary is checked
where the vocabulary is known (``runtime/generation.py``).

Not here: turning messages into tokens (``runtime/chat_format.py``) or calling the engine.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_STOP_CHARS = 1024  # one stop string: the decode loop looks for each one's prefixes at the text's end after every token


def stop_problem(stop: str | list[str] | None, most: int = 4) -> str | None:
    """Why ``stop`` (a string or a list of them) is refused, or None: more than ``most`` strings, or one over ``MAX_STOP_CHARS``."""
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > most:
        return f"at most {most} stop sequences are allowed"
    if any(len(x) > MAX_STOP_CHARS for x in stops):
        return f"a stop sequence is at most {MAX_STOP_CHARS} characters long"
    return None


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


def check_logit_bias(v: Any) -> dict[str, float] | None:
    """``logit_bias`` as OpenAI takes it: at most :data:`MAX_LOGIT_BIAS` token ids (non-negative integers, as JSON's
    string keys) to a bias from -100 to 100; ``ValueError`` (a 400 naming ``logit_bias``) otherwise."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError("logit_bias must be an object mapping token ids to biases")
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} token ids; got {len(v)}")
    out: dict[str, float] = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit()):
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers); got {str(k)[:40]!r}")
        if isinstance(b, bool) or not isinstance(b, int | float) or not (math.isfinite(b) and -100 <= b <= 100):
            raise ValueError(f"logit_bias values must be numbers from -100 to 100; got {str(b)[:40]} for token {k}")
        out[str(int(k))] = float(b)
    return out


LogitBias = Annotated[dict[str, float] | None, BeforeValidator(check_logit_bias)]
Penalty = Annotated[float | None, Field(ge=-2, le=2)]  # OpenAI's presence/frequency penalty (null = 0)


class TextPart(_In):
    type: Literal["text"]
    text: str


class RefusalPart(_In):
    """An assistant's refusal, sent back as history: its text is what the model said."""

    type: Literal["refusal"]
    refusal: str


class UnsupportedPart(_In):
    type: Literal["image_url", "input_audio", "file", "image", "audio"]


ContentPart = Annotated[TextPart | RefusalPart | UnsupportedPart, Field(discriminator="type")]


class FunctionCall(_In):
    name: str
    arguments: str


class ToolCall(_In):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_In):
    role: Literal["system", "developer"]
    content: str | list[ContentPart]
    name: str | None = None


class UserMessage(_In):
    role: Literal["user"]
    content: str | list[ContentPart]
    name: str | None = None


class AssistantMessage(_In):
    role: Literal["assistant"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None  # legacy: one call, answered by a ``role: "function"`` message
    name: str | None = None
    refusal: str | None = None


class FunctionMessage(_In):
    """Legacy: the result of the assistant's ``function_call`` (a tool result without a call id)."""

    role: Literal["function"]
    name: str
    content: str | list[ContentPart] | None = None


class ToolMessage(_In):
    role: Literal["tool"]
    content: str | list[ContentPart]
    tool_call_id: str


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage, Field(discriminator="role")]


class FunctionDef(_In):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _valid_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        check_json_schema(v)
        return v


class Tool(_In):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_In):
    name: str


class NamedToolChoice(_In):
    type: Literal["function"]
    function: NamedFunction


class LegacyFunctionChoice(_In):
    name: str


class JsonSchemaSpec(_In):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        check_json_schema(v)
        return v


class ResponseFormat(_In):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class StreamOptions(_In):
    include_usage: bool = False


class ChatCompletionRequest(_In):
    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, as OpenAI's; wider values overflow torch's seed
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    logit_bias: LogitBias = None
    user: str | None = None
    # OpenAI's metadata (at most 16 string pairs); loopwise records ``tag``, which a learner's traffic filter can select
    metadata: dict[str, str] | None = None
    response_format: ResponseFormat | None = None
    # legacy function calling: mapped to tools / tool_choice (``serving_chat.to_internal``)
    functions: list[FunctionDef] | None = Field(None, min_length=1, max_length=128)
    function_call: Literal["none", "auto"] | LegacyFunctionChoice | None = None
    # SGLang-style extras (``extra_body``)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if (problem := stop_problem(v)) is not None:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> ChatCompletionRequest:
        if self.metadata is not None and (len(self.metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in self.metadata.items())):
            raise FieldError("metadata", "metadata holds at most 16 pairs, keys of at most 64 characters and values of at most 512")
        if self.functions or self.function_call is not None:
            self._legacy_functions()
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
            if not self.tools:
                raise FieldError("tool_choice", "tool_choice requires tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools:
            names = {t.function.name for t in self.tools}
            if self.tool_choice.function.name not in names:
                raise FieldError("tool_choice", f"tool_choice names function {self.tool_choice.function.name!r}, which is not in tools")
        return self

    def _legacy_functions(self) -> None:
        """``functions`` / ``function_call`` (deprecated by OpenAI) as ``tools`` / ``tool_choice``."""
        if self.tools or self.tool_choice is not None:
            raise FieldError("functions", "functions and function_call are the legacy form of tools and tool_choice; send one form, not both")
        if not self.functions:
            raise FieldError("function_call", "function_call requires functions")
        self.tools = [Tool(type="function", function=f) for f in self.functions]
        fc = self.function_call
        if isinstance(fc, LegacyFunctionChoice):
            if fc.name not in {f.name for f in self.functions}:
                raise FieldError("function_call", f"function_call names function {fc.name!r}, which is not in functions")
            self.tool_choice = NamedToolChoice(type="function", function=NamedFunction(name=fc.name))
        else:
            self.tool_choice = fc
        self.parallel_tool_calls = False


class FieldError(ValueError):
    """A cross-field check that failed; ``param`` names the field (pydantic reports such errors without a location)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


MAX_SCHEMA_NODES = 20_000  # objects and arrays in one JSON schema (OpenAI allows 5,000 properties: about 10,000)


def check_json_schema(schema: dict[str, Any]) -> None:
    """Raise ``ValueError`` if ``schema`` is not a valid JSON Schema (Draft 2020-12 meta-schema) or holds more than
    ``MAX_SCHEMA_NODES`` objects and arrays (the meta-schema check costs about 0.1-0.5 ms per node)."""
    from jsonschema import exceptions, validators

    nodes, stack = 0, list[Any]([schema])
    while stack:
        item = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise ValueError(f"invalid JSON schema: it holds more than {MAX_SCHEMA_NODES} objects and arrays")
        children = item.values() if isinstance(item, dict) else item
        stack.extend(c for c in children if isinstance(c, dict | list))
    if not isinstance(schema.get("$schema", ""), str):  # jsonschema looks it up as a URI: a number there raised a TypeError
        raise ValueError("invalid JSON schema: $schema must be a string (the URI of a JSON Schema dialect)")
    try:
        validators.validator_for(schema, default=validators.Draft202012Validator).check_schema(schema)
    except exceptions.SchemaError as exc:
        raise ValueError(f"invalid JSON schema: {exc.message}") from exc
    json.dumps(schema)


# ---- responses ---------------------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(_Out):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Out):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class ResponseMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class Choice(_Out):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[Choice]
    usage: Usage
    loopwise: dict[str, Any] | None = None  # ids to attach feedback to (trajectory_id, turn_id, adapter)


class FeedbackRequest(_In):
    """``POST /v1/feedback``: a reward for a completion, turn or trajectory, at any later time."""

    trajectory_id: str | None = None
    turn_id: str | None = None
    completion_id: str | None = None
    choice_index: int | None = Field(None, ge=0, le=127)  # with completion_id: reward only that choice's turn
    reward: float | None = None
    turn_rewards: dict[str, float] | None = None
    source: str = Field("feedback", min_length=1, max_length=200)
    comment: str | None = Field(None, max_length=10_000)
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)

    @model_validator(mode="after")
    def _one_target(self) -> FeedbackRequest:
        targets = [t for t in (self.trajectory_id, self.turn_id, self.completion_id) if t is not None]
        if len(targets) != 1 and not (not targets and self.turn_rewards):
            raise FieldError("trajectory_id", "give exactly one of trajectory_id, turn_id or completion_id")
        if targets and self.reward is None:
            raise FieldError("reward", "reward is required")
        if self.choice_index is not None and self.completion_id is None:
            raise FieldError("choice_index", "choice_index selects a choice of a completion: give it with completion_id")
        values = [self.reward] if self.reward is not None else []
        values += list((self.turn_rewards or {}).values())
        if any(not math.isfinite(v) for v in values):
            raise FieldError("reward", "rewards must be finite numbers")
        return self
