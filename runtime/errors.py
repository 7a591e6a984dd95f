"""HTTP-facing errors and their one translation into OpenAI's envelope.

``{"error": {"message", "type", "param", "code"}}`` with the status OpenAI uses. Domain errors from the
engine (``runtime.engine``) are mapped here; nothing else in the runtime builds error responses.
A 500 never carries the exception text: it is logged with the request id, and the client gets the id.

Not here: deciding *whether* a request is valid (schemas and the engine do that).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from runtime.engine import AdapterError, EngineClosed, EngineError, EngineOverloaded, InvalidRequest, NonFiniteOutput, NotSupported


class APIError(Exception):
    """An error the HTTP layer answers with, already in OpenAI's terms."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's envelope (``/v1/messages``): ``{"type": "error", "error": {"type", "message"}}``."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def from_engine(exc: EngineError) -> APIError:
    if isinstance(exc, EngineOverloaded):
        retry = max(1, round(exc.retry_after))
        return APIError(429, str(exc), type="rate_limit_error", code="server_overloaded", headers={"Retry-After": str(retry)})
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), param=exc.param, code=exc.code or "invalid_value")
    if isinstance(exc, AdapterError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, NotSupported):
        return APIError(501, str(exc), type="invalid_request_error", code="not_supported")
    if isinstance(exc, EngineClosed):
        return APIError(503, "the engine is not available", type="server_error", code="engine_unavailable")
    if isinstance(exc, NonFiniteOutput):  # only this request failed; a fixed text, as for every 500
        msg = "generation failed: the model produced non-finite logits for this request; the adapter it used may be broken"
        return APIError(500, msg, type="server_error", code="non_finite_output")
    return APIError(500, "generation failed", type="server_error", code="internal_error")


_UNION_TAGS = {
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
    "text",
    "refusal",
    "image_url",
    "input_audio",
    "file",
    "image",
    "audio",
}


_TYPE_TAGS = {"str", "list", "dict", "int", "float", "bool"}


def param_of(loc: tuple[int | str, ...]) -> str | None:
    """``('messages', 0, 'tool', 'tool_call_id')`` → ``messages[0].tool_call_id``."""
    out = ""
    for k, (prev, item) in enumerate(zip((None, *loc), loc, strict=False)):
        if isinstance(item, int):
            out += f"[{item}]"
        elif item == "function" and not (k == 2 and loc[0] == "messages"):  # a field (tools[0].function), not the role tag of messages[i]
            out += ("." if out else "") + item
        elif (item in _UNION_TAGS and isinstance(prev, int)) or "[" in item or item in _TYPE_TAGS:
            continue  # pydantic's name for a union member, not a field
        else:
            out += ("." if out else "") + item
    return out or None


_LIBRARY_PREFIXES = ("Value error, ", "Assertion failed, ")


def human_message(msg: str) -> str:
    """A validation message without pydantic's ``Value error, `` / ``Assertion failed, `` prefixes."""
    for prefix in _LIBRARY_PREFIXES:
        if msg.startswith(prefix):
            return msg[len(prefix) :]
    return msg


def from_validation(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    field_error = getattr((err.get("ctx") or {}).get("error"), "param", None)  # a cross-field check that names its field
    param = param_of(tuple(err["loc"])) or field_error
    msg = human_message(err["msg"])
    if err["type"] == "union_tag_invalid" and param and param.endswith("]"):
        param += ".role" if param.startswith("messages") else ".type"
    if err["type"] == "missing":
        msg = f"'{param}' is a required property" if param else "missing required property"
    elif param and not field_error:
        msg = f"Invalid value for '{param}': {msg}"
    return APIError(400, msg, param=param, code="invalid_value")
