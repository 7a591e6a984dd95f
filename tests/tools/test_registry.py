"""ToolRegistry: schemas from signatures and docstrings, validation errors as results, calls, dotted paths."""

from __future__ import annotations

import asyncio
import dataclasses
import textwrap
import threading
from typing import Any, Literal

import pytest
from pydantic import BaseModel
from structlog.testing import capture_logs

from tools import ToolLoadError, ToolNotFound, ToolRegistrationError, ToolRegistry, ToolResult, default_registry, load_tool, tool


def multiply_tool(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def search(query: str, limit: int = 10, exact: bool = False, score: float | None = None) -> list[str]:
    """Search the notes.

    Longer explanation that is not part of the description.

    Args:
        query (str): Words to look for,
            several allowed.
        limit (int): At most this many results.

    Returns:
        Matching note titles.
    """
    return [query] * limit


def pick(mode: Literal["fast", "slow"], tags: list[str], weights: dict[str, float]) -> str:
    """Pick a mode."""
    return mode


class Point(BaseModel):
    x: int
    y: int = 0


def move(to: Point, note: str | None = None) -> str:
    """Move somewhere.

    Args:
        to: Target point.
    """
    return f"{to.x},{to.y}"


def no_doc(json: str, schema: int) -> str:
    return f"{json}{schema}"


SCHEMA_TABLE: list[tuple[Any, dict[str, Any]]] = [
    (
        multiply_tool,
        {
            "name": "multiply_tool",
            "description": "Multiply two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first integer."},
                    "b": {"type": "integer", "description": "The second integer."},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    ),
    (
        search,
        {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Words to look for, several allowed."},
                    "limit": {"type": "integer", "default": 10, "description": "At most this many results."},
                    "exact": {"type": "boolean", "default": False},
                    "score": {"anyOf": [{"type": "number"}, {"type": "null"}], "default": None},
                },
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    ),
    (
        pick,
        {
            "name": "pick",
            "description": "Pick a mode.",
            "parameters": {
                "type": "object",
                "properties": {
                    "mode": {"type": "string", "enum": ["fast", "slow"]},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "weights": {"type": "object", "additionalProperties": {"type": "number"}},
                },
                "required": ["mode", "tags", "weights"],
                "additionalProperties": False,
            },
        },
    ),
    (
        move,
        {
            "name": "move",
            "description": "Move somewhere.",
            "parameters": {
                "$defs": {
                    "Point": {
                        "type": "object",
                        "properties": {"x": {"type": "integer"}, "y": {"type": "integer", "default": 0}},
                        "required": ["x"],
                    }
                },
                "type": "object",
                "properties": {
                    "to": {"$ref": "#/$defs/Point", "description": "Target point."},
                    "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
                },
                "required": ["to"],
                "additionalProperties": False,
            },
        },
    ),
    (
        no_doc,
        {
            "name": "no_doc",
            "description": "",
            "parameters": {
                "type": "object",
                "properties": {"json": {"type": "string"}, "schema": {"type": "integer"}},
                "required": ["json", "schema"],
                "additionalProperties": False,
            },
        },
    ),
]


@pytest.mark.parametrize(("fn", "expected"), SCHEMA_TABLE, ids=[fn.__name__ for fn, _ in SCHEMA_TABLE])
def test_schema_from_signature_and_docstring(fn: Any, expected: dict[str, Any]) -> None:
    registry = ToolRegistry()
    registry.register(fn)
    assert registry.schemas() == [{"type": "function", "function": expected}]


def test_names_get_schemas_subset_and_decorators() -> None:
    registry = ToolRegistry()

    @registry.tool(name="times", description="Custom.")
    def mul(a: int, b: int) -> int:
        return a * b

    @tool(name="adder")
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    registry.register(add)
    registry.register(search)
    assert registry.names() == ["times", "adder", "search"]
    assert registry.get("adder").description == "Add."
    assert [s["function"]["name"] for s in registry.schemas(["search", "times"])] == ["search", "times"]
    assert registry.schemas(["times"])[0]["function"]["description"] == "Custom."
    assert add(2, 3) == 5  # the decorator leaves the function callable as before
    with pytest.raises(ToolNotFound, match="no tool named 'nope'"):
        registry.get("nope")
    with pytest.raises(ToolRegistrationError, match="already registered"):
        registry.register(search)
    registry.register(search, replace=True)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def f(a, b: int) -> int: return b", "parameter 'a' needs a type hint"),
        ("def f(*args: int) -> int: return 0", r"\*args/\*\*kwargs"),
        ("def f(a: int, /) -> int: return a", "positional-only"),
        ("class C: pass\ndef f(a: C) -> int: return 0", "no JSON schema"),
    ],
)
def test_registration_errors_are_clear(source: str, message: str) -> None:
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    with pytest.raises(ToolRegistrationError, match=message):
        ToolRegistry().register(namespace["f"])
    with pytest.raises(ToolRegistrationError, match="must match"):
        ToolRegistry().register(multiply_tool, name="bad name!")


def _call(registry: ToolRegistry, name: str, arguments: Any, **kw: Any) -> ToolResult:
    return asyncio.run(registry.call(name, arguments, **kw))


@pytest.fixture
def registry() -> ToolRegistry:
    reg = ToolRegistry()
    for fn in (multiply_tool, search, pick, move):
        reg.register(fn)
    return reg


def test_valid_calls_convert_types(registry: ToolRegistry) -> None:
    ok = _call(registry, "multiply_tool", '{"a": 6, "b": 7}')
    assert (ok.ok, ok.content, ok.error_kind) == (True, "42", None)
    assert ok.elapsed_s > 0
    assert _call(registry, "search", {"query": "x", "limit": 2}).content == '["x", "x"]'
    assert _call(registry, "move", {"to": {"x": 3}}).content == "3,0"  # nested dict became a Point


@pytest.mark.parametrize(
    ("name", "arguments", "kind", "fragments"),
    [
        ("multiply_tool", '{"a": "6", "b": 7}', "invalid_arguments", ["`a`", "'6' is not of type 'integer'"]),
        ("multiply_tool", '{"a": 6}', "invalid_arguments", ["'b' is a required property"]),
        ("multiply_tool", '{"a": 6, "b": 7, "c": 1}', "invalid_arguments", ["'c' was unexpected"]),
        ("multiply_tool", '{"a": 1.5, "b": true}', "invalid_arguments", ["`a`", "`b`", "True is not of type 'integer'"]),
        ("pick", '{"mode": "medium", "tags": [], "weights": {}}', "invalid_arguments", ["`mode`", "'medium' is not one of ['fast', 'slow']"]),
        ("pick", '{"mode": "fast", "tags": ["a", 2], "weights": {}}', "invalid_arguments", ["`tags.1`", "2 is not of type 'string'"]),
        ("move", '{"to": {"x": "q"}}', "invalid_arguments", ["`to.x`", "'q' is not of type 'integer'"]),
        ("search", '{"query": "x", "score": "high"}', "invalid_arguments", ["`score`", "'high' is not of type 'number'"]),
        ("multiply_tool", '{"a": 6, "b": ', "invalid_json", ["not valid JSON"]),
        ("multiply_tool", "[1, 2]", "invalid_arguments", ["must be a JSON object", "list"]),
        ("divide", '{"a": 1}', "unknown_tool", ["unknown tool `divide`", "multiply_tool", "search"]),
    ],
)
def test_bad_calls_come_back_as_results(registry: ToolRegistry, name: str, arguments: str, kind: str, fragments: list[str]) -> None:
    result = _call(registry, name, arguments)
    assert result.ok is False
    assert result.error_kind == kind
    for fragment in fragments:
        assert fragment in result.content


def test_empty_arguments_mean_no_arguments() -> None:
    registry = ToolRegistry()

    @registry.tool
    def now() -> str:
        """The time."""
        return "noon"

    assert _call(registry, "now", "").content == "noon"
    assert _call(registry, "now", None).content == "noon"
    assert _call(registry, "now", "{}").content == "noon"


def test_a_tool_that_raises_becomes_an_error_result_and_is_logged() -> None:
    registry = ToolRegistry()

    @registry.tool
    def explode(x: int) -> int:
        """Fail."""
        raise RuntimeError(f"boom {x}")

    with capture_logs() as logs:
        result = _call(registry, "explode", {"x": 3})
    assert (result.ok, result.error_kind) == (False, "tool_error")
    assert result.content == "tool `explode` failed: RuntimeError: boom 3"
    assert result.flags["exception"] == "RuntimeError"
    assert [entry["event"] for entry in logs] == ["tool_failed"]
    assert logs[0]["log_level"] == "error" and logs[0]["exc_info"] is True


def test_sync_tools_run_off_the_event_loop_and_async_tools_are_awaited() -> None:
    registry = ToolRegistry()
    loop_thread: list[int] = []

    @registry.tool
    def blocking(x: int) -> str:
        """Sync."""
        return f"{x}:{threading.get_ident() != loop_thread[0]}"

    @registry.tool
    async def waiting(x: int) -> dict[str, int]:
        """Async."""
        await asyncio.sleep(0.01)
        return {"x": x, "thread_is_loop": int(threading.get_ident() == loop_thread[0])}

    @registry.tool
    def returns_result(x: int) -> ToolResult:
        """Own flags."""
        return ToolResult(content="custom", ok=False, error_kind="custom_kind", flags={"x": x})

    async def main() -> list[ToolResult]:
        loop_thread.append(threading.get_ident())
        return list(
            await asyncio.gather(registry.call("blocking", {"x": 1}), registry.call("waiting", {"x": 2}), registry.call("returns_result", {"x": 3}))
        )

    sync_result, async_result, own = asyncio.run(main())
    assert sync_result.content == "1:True"  # ran in a worker thread
    assert async_result.content == '{"x": 2, "thread_is_loop": 1}'
    assert (own.content, own.ok, own.error_kind, own.flags) == ("custom", False, "custom_kind", {"x": 3})
    assert own.elapsed_s > 0


def test_timeout_is_a_result() -> None:
    registry = ToolRegistry()

    @registry.tool
    async def slow() -> str:
        """Slow."""
        await asyncio.sleep(5)
        return "late"

    result = _call(registry, "slow", {}, timeout_s=0.05)
    assert (result.ok, result.error_kind, result.flags) == (False, "timeout", {"timed_out": True})
    assert "0.05 s" in result.content


def test_tool_result_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ToolResult(content="x").content = "y"  # type: ignore[misc]


@pytest.fixture
def user_module(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    pkg = tmp_path / "lw_user_tools"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mytools.py").write_text(
        textwrap.dedent(
            '''
            from tools import tool

            NOT_CALLABLE = 3

            def shout(text: str) -> str:
                """Upper-case a text.

                Args:
                    text: The text.
                """
                return text.upper()

            @tool(name="whisper")
            def quiet(text: str) -> str:
                """Lower-case a text."""
                return text.lower()

            class Helpers:
                @staticmethod
                def double(n: int) -> int:
                    """Double."""
                    return 2 * n
            '''
        )
    )
    (pkg / "broken.py").write_text("raise ImportError('missing dependency foo')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "lw_user_tools"


def test_dotted_registration(user_module: str) -> None:
    registry = ToolRegistry()
    registry.register_dotted(f"{user_module}.mytools:shout")
    registry.register_dotted(f"{user_module}.mytools.quiet")  # dotted form; @tool name is kept
    registry.register_dotted(f"{user_module}.mytools:Helpers.double", name="double")
    assert registry.names() == ["shout", "whisper", "double"]
    assert registry.get("shout").parameters["properties"]["text"]["description"] == "The text."
    assert _call(registry, "shout", {"text": "hi"}).content == "HI"
    assert _call(registry, "whisper", {"text": "HI"}).content == "hi"
    assert _call(registry, "double", {"n": 4}).content == "8"
    assert default_registry(extra=[f"{user_module}.mytools:shout"], python=False, cuda=False).names() == ["calculator", "shout"]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'.*ModuleNotFoundError"),
        ("{m}.broken:fn", "cannot import module '{m}.broken'.*missing dependency foo"),
        ("{m}.mytools:nothing", "has no attribute 'nothing'"),
        ("{m}.mytools:NOT_CALLABLE", "is not callable \\(it is a int\\)"),
        ("justaname", "must look like 'package.module:function'"),
    ],
)
def test_dotted_registration_errors(user_module: str, path: str, message: str) -> None:
    with pytest.raises(ToolLoadError, match=message.format(m=user_module)):
        ToolRegistry().register_dotted(path.format(m=user_module))


def test_load_tool_of_an_untyped_builtin_fails_at_registration() -> None:
    assert load_tool("os.path:join") is not None
    with pytest.raises(ToolRegistrationError):
        ToolRegistry().register_dotted("os.path:join")


def test_default_registry_has_the_builtins() -> None:
    registry = default_registry()
    assert registry.names() == ["calculator", "python", "cuda_compile", "cuda_check", "cuda_bench"]
    for schema in registry.schemas():
        fn = schema["function"]
        assert fn["description"] and fn["parameters"]["required"] and fn["parameters"]["additionalProperties"] is False
    assert registry.get("python").parameters["properties"]["code"]["type"] == "string"
