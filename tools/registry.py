"""Tool registry: typed Python functions become OpenAI function tools, validated and called safely.

    registry = ToolRegistry()

    @registry.tool
    def multiply(a: int, b: int) -> int:
        '''Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        '''
        return a * b

    registry.schemas()                                  # [{"type": "function", "function": {...}}]
    result = await registry.call("multiply", '{"a": 6, "b": 7}')   # ToolResult(content="42", ok=True, ...)

The JSON schema of a tool comes from its signature (pydantic builds it: str/int/float/bool, lists,
dicts, ``Literal``, ``Optional``, defaults, pydantic models, dataclasses) and its Google-style docstring
(first paragraph → description; ``Args:`` entries → parameter descriptions). ``call`` parses the JSON
arguments and validates them against that schema (``jsonschema``, exactly the contract the model saw)
before the function runs; then pydantic turns them into the annotated Python types. Sync functions run
in a worker thread so the event loop is never blocked; async functions are awaited.

``call`` never raises for the model's mistakes or the tool's failures: an unknown tool, bad JSON,
invalid arguments, an exception inside the tool or a timeout come back as ``ToolResult(ok=False,
error_kind=..., content=<message for the model>)``; exceptions are logged with their traceback. A tool
may return a ``ToolResult`` itself to set its own flags (the Python runner does).

What it does not do: it cannot stop a sync tool's thread when ``timeout_s`` expires (the result says
timed out, the thread finishes in the background; tools that run untrusted code use the sandbox, which
does kill), and it does not sandbox the tool functions themselves: registered tools are trusted code.

Exceptions (raised at registration or lookup, never by ``call``): ``ToolError`` ▸ ``ToolRegistrationError``,
``ToolLoadError``, ``ToolNotFound`` (also a ``KeyError``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import re
import time
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import jsonschema
import pydantic
import structlog
from pydantic import BaseModel, ConfigDict, Field, create_model

log = structlog.get_logger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SECTION_RE = re.compile(r"^(Args|Arguments|Parameters|Params|Returns|Return|Yields|Raises|Examples?|Notes?|Attributes|See Also):\s*$")
_ARG_RE = re.compile(r"^(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")


class ToolError(Exception):
    """Base class for registry errors raised to the developer (not to the model)."""


class ToolRegistrationError(ToolError):
    """A function cannot become a tool (missing type hints, *args, bad name, duplicate)."""


class ToolLoadError(ToolError):
    """A dotted tool path from configuration cannot be imported or is not callable."""


class ToolNotFound(ToolError, KeyError):
    """No tool with that name is registered."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "tool not found"


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one tool call; ``content`` is what the model sees as the observation."""

    content: str
    ok: bool = True
    error_kind: str | None = None  # unknown_tool, invalid_json, invalid_arguments, tool_error, timeout, or tool-specific
    flags: dict[str, Any] = field(default_factory=dict)  # e.g. timed_out, memory_exceeded, exit_code, truncated
    elapsed_s: float = 0.0

    @classmethod
    def failure(cls, error_kind: str, content: str, **flags: Any) -> ToolResult:
        return cls(content=content, ok=False, error_kind=error_kind, flags=flags)


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {parameter: description}).

    The description is the first paragraph, joined into one line. ``Args:`` entries may carry a type in
    parentheses (ignored: the signature is the source of truth) and continue on more-indented lines.
    """
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION_RE.match(line.strip()):
            break
        summary.append(line.strip())
    params: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    entry_indent = 0
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        header = _SECTION_RE.match(stripped) if indent == 0 else None
        if header:
            section, current = header.group(1), None
            continue
        if section not in ("Args", "Arguments", "Parameters", "Params") or not stripped:
            continue
        if indent == 0:  # dedented text ends the section
            section = None
            continue
        match = _ARG_RE.match(stripped)
        if match and (current is None or indent <= entry_indent):
            current, entry_indent = match.group(1).lstrip("*"), indent
            params[current] = match.group(3).strip()
        elif current is not None:
            params[current] = (params[current] + " " + stripped).strip()
    return " ".join(summary), params


def _strip_titles(schema: Any) -> Any:
    """Remove pydantic's auto-generated ``title`` keywords (noise for the model), keeping property names."""
    if isinstance(schema, list):
        return [_strip_titles(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "$defs", "patternProperties"):
            out[key] = {name: _strip_titles(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "oneOf", "allOf", "prefixItems", "not"):
            out[key] = _strip_titles(value)
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class Tool:
    """A registered tool: the function, its OpenAI schema and the validators built from it."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]
    is_async: bool
    arguments_model: type[BaseModel]
    field_names: dict[str, str]  # parameter name -> internal pydantic field name
    validator: jsonschema.protocols.Validator

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> Tool:
        name = name or getattr(fn, "__name__", None) or type(fn).__name__
        if not _NAME_RE.match(name):
            raise ToolRegistrationError(f"tool name {name!r} must match {_NAME_RE.pattern} (OpenAI's rule)")
        try:
            sig = inspect.signature(fn)
            hints = typing.get_type_hints(fn, include_extras=True)
        except (TypeError, ValueError, NameError) as exc:
            raise ToolRegistrationError(f"cannot read the signature of tool {name!r}: {exc}") from exc
        doc_description, doc_params = parse_docstring(inspect.getdoc(fn))
        fields: dict[str, Any] = {}
        field_names: dict[str, str] = {}
        for i, (pname, param) in enumerate(sig.parameters.items()):
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise ToolRegistrationError(f"tool {name!r}: *args/**kwargs (parameter {pname!r}) cannot be described by a JSON schema")
            if param.kind is param.POSITIONAL_ONLY:
                raise ToolRegistrationError(f"tool {name!r}: positional-only parameter {pname!r} cannot be passed by name")
            if pname not in hints:
                raise ToolRegistrationError(f"tool {name!r}: parameter {pname!r} needs a type hint (the JSON schema is built from it)")
            default = ... if param.default is param.empty else param.default
            internal = f"p{i}"  # aliases keep names like `json` or `schema` from clashing with BaseModel attributes
            fields[internal] = (hints[pname], Field(default, alias=pname, description=doc_params.get(pname)))
            field_names[pname] = internal
        try:
            model = create_model(f"{name}_arguments", __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=False), **fields)
            parameters = _strip_titles(model.model_json_schema(by_alias=True))
        except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError, TypeError) as exc:
            raise ToolRegistrationError(f"tool {name!r}: a parameter type has no JSON schema: {exc}") from exc
        parameters.setdefault("properties", {})
        parameters.pop("description", None)
        validator_cls = jsonschema.validators.validator_for(parameters, default=jsonschema.Draft202012Validator)
        return cls(
            name=name,
            description=description or doc_description,
            parameters=parameters,
            fn=fn,
            is_async=inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)),  # noqa: B004
            arguments_model=model,
            field_names=field_names,
            validator=validator_cls(parameters),
        )

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool dict for this tool."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None) -> Any:
    """Mark a function as a tool (``@tool`` or ``@tool(name=...)``); the schema is built and checked now.

    The function is returned unchanged (still directly callable); ``ToolRegistry.register`` and
    ``register_dotted`` use the name and description given here.
    """

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        f.__loopwise_tool__ = Tool.from_function(f, name, description)  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


def load_tool(dotted: str) -> Callable[..., Any]:
    """Import ``"package.module:function"`` (or ``"package.module.function"``) and return the callable."""
    module_name, sep, attr = dotted.partition(":")
    if not sep:
        module_name, _, attr = dotted.rpartition(".")
    if not module_name or not attr:
        raise ToolLoadError(f"tool path {dotted!r} must look like 'package.module:function' or 'package.module.function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # an arbitrary user module: any import-time error is a load error
        raise ToolLoadError(f"cannot import module {module_name!r} for tool {dotted!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ToolLoadError(f"tool {dotted!r}: module {module_name!r} has no attribute {attr!r}") from exc
    if not callable(obj):
        raise ToolLoadError(f"tool {dotted!r} is not callable (it is a {type(obj).__name__})")
    return typing.cast(Callable[..., Any], obj)


def _render(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    return json.dumps(value, default=str, ensure_ascii=False)


def _describe_errors(errors: Iterable[jsonschema.ValidationError]) -> list[str]:
    messages = []
    for err in sorted(errors, key=lambda e: [str(p) for p in e.absolute_path]):
        while err.validator in ("anyOf", "oneOf") and err.context:
            # Optional[Model] fails both branches; the deepest error (inside the model) is the useful one.
            err = max(err.context, key=lambda e: (len(e.absolute_path), e.validator != "type"))
        path = ".".join(str(p) for p in err.absolute_path)
        messages.append(f"argument `{path}`: {err.message}" if path else err.message)
    return messages


class ToolRegistry:
    """Holds tools by name; ``call`` is safe to use from the agent loop (it never raises)."""

    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}

    def register(self, fn: Callable[..., Any], name: str | None = None, *, description: str | None = None, replace: bool = False) -> Tool:
        marked: Tool | None = getattr(fn, "__loopwise_tool__", None)
        if marked is not None and marked.fn is fn and name in (None, marked.name) and description in (None, marked.description):
            spec = marked
        else:
            spec = Tool.from_function(fn, name or (marked.name if marked else None), description or (marked.description if marked else None))
        if spec.name in self._tools and not replace:
            raise ToolRegistrationError(f"a tool named {spec.name!r} is already registered (pass replace=True to override)")
        self._tools[spec.name] = spec
        return spec

    def tool(self, fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None) -> Any:
        """Decorator form of ``register`` (``@registry.tool`` or ``@registry.tool(name=...)``)."""

        def add(f: Callable[..., Any]) -> Callable[..., Any]:
            self.register(f, name, description=description)
            return f

        return add(fn) if fn is not None else add

    def register_dotted(self, dotted: str, name: str | None = None) -> Tool:
        """Register a tool named in configuration by its import path (``ToolLoadError`` if it cannot load)."""
        return self.register(load_tool(dotted), name)

    def names(self) -> list[str]:
        return list(self._tools)

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise ToolNotFound(f"no tool named {name!r}; registered: {', '.join(self._tools) or '(none)'}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def schemas(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """OpenAI tool dicts, for all tools or the given names (in that order)."""
        return [self.get(n).schema() for n in (self._tools if names is None else names)]

    async def call(self, name: str, arguments: str | dict[str, Any] | None, *, timeout_s: float | None = None) -> ToolResult:
        """Validate ``arguments`` (a JSON object text or a dict) and run the tool; never raises."""
        started = time.perf_counter()
        result = await self._call(name, arguments, timeout_s)
        return replace(result, elapsed_s=time.perf_counter() - started)

    async def _call(self, name: str, arguments: str | dict[str, Any] | None, timeout_s: float | None) -> ToolResult:
        spec = self._tools.get(name)
        if spec is None:
            known = ", ".join(self._tools) or "(none)"
            return ToolResult.failure("unknown_tool", f"unknown tool `{name}`; available tools: {known}")
        if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
            args: Any = {}
        elif isinstance(arguments, str):
            try:
                args = json.loads(arguments)
            except json.JSONDecodeError as exc:
                return ToolResult.failure("invalid_json", f"arguments for tool `{name}` are not valid JSON: {exc.msg} at position {exc.pos}")
            except RecursionError:  # json.loads gives up past about a thousand levels
                return ToolResult.failure("invalid_json", f"arguments for tool `{name}` are nested too deeply to parse")
        else:
            args = arguments
        if not isinstance(args, dict):
            return ToolResult.failure("invalid_arguments", f"arguments for tool `{name}` must be a JSON object, got {type(args).__name__}")
        errors = _describe_errors(spec.validator.iter_errors(args))
        if errors:
            return ToolResult.failure("invalid_arguments", f"invalid arguments for tool `{name}`: " + "; ".join(errors))
        try:
            parsed = spec.arguments_model.model_validate(args)
        except pydantic.ValidationError as exc:
            msgs = [f"argument `{'.'.join(str(p) for p in e['loc'])}`: {e['msg']}" for e in exc.errors()]
            return ToolResult.failure("invalid_arguments", f"invalid arguments for tool `{name}`: " + "; ".join(msgs))
        kwargs = {pname: getattr(parsed, internal) for pname, internal in spec.field_names.items()}
        try:
            if spec.is_async:
                work = spec.fn(**kwargs)
            else:
                work = asyncio.to_thread(spec.fn, **kwargs)
            value = await asyncio.wait_for(work, timeout_s) if timeout_s is not None else await work
            if inspect.isawaitable(value):
                value = await value
        except TimeoutError:
            log.warning("tool_timeout", tool=name, timeout_s=timeout_s)
            return ToolResult.failure("timeout", f"tool `{name}` did not finish within {timeout_s:g} s", timed_out=True)
        except Exception as exc:  # the tool's own failure becomes an observation for the model
            log.exception("tool_failed", tool=name)
            return ToolResult.failure("tool_error", f"tool `{name}` failed: {type(exc).__name__}: {exc}", exception=type(exc).__name__)
        if isinstance(value, ToolResult):
            return value
        return ToolResult(content=_render(value))
