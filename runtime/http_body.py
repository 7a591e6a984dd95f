"""Reading a JSON request body at the HTTP edge, with OpenAI-style errors.

One function for every route: a body over ``limit`` is a 413 (checked while reading, so chunked
bodies are bounded too); an empty body, bytes that are not UTF-8, invalid JSON (integers over 4,300 digits
included: ``runtime.json_text.loads_strict``), a non-object, JSON nested deeper than
``MAX_DEPTH`` (deep nesting makes recursive validators raise ``RecursionError``), or JSON carrying
unpaired surrogate escapes is a 400 ``invalid_json``; ``NaN`` or ``Infinity`` where a number goes is a 400
``invalid_value`` naming the field (JSON has neither; a reply echoing one could not be written).

:func:`json_body` is the one request-validation dependency of the wire APIs (``runtime/api/``): the body read
within the app's ``max_body`` and validated against the route's schema, a bad field a 400 naming it
(``runtime.errors.from_validation``); a body over ``VALIDATE_INLINE_BYTES`` is validated on a worker thread
within ``VALIDATE_TIMEOUT_S`` (JSON schemas in it are checked against their meta-schema, which is slow).
Not here: the schemas' own rules (pydantic), or JSON sent as text inside the
body (``runtime/json_text.py``, under the same depth limit).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from runtime.errors import APIError, from_validation
from runtime.json_text import MAX_DEPTH, NonFinite, loads_strict, non_finite_path, too_deep

DEFAULT_LIMIT = 4 * 1024 * 1024
OFFLOAD_BYTES = 256 * 1024  # bodies larger than this are parsed on a worker thread
# bodies larger than this are validated on a worker thread: a JSON schema in them (response_format, tool parameters)
# is checked against its meta-schema, about half a millisecond per anyOf branch, which must not stall the event loop
VALIDATE_INLINE_BYTES = 8 * 1024
VALIDATE_TIMEOUT_S = 10.0
_SURROGATE = re.compile(rb"\\[uU][dD][89a-fA-F][0-9a-fA-F]{2}")  # a \uD800-\uDFFF escape: the costly check runs only then
_parser_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="loopwise-parse")
M = TypeVar("M", bound=BaseModel)


async def read_json(request: Request, limit: int = DEFAULT_LIMIT) -> Any:
    return (await _read(request, limit))[0]


async def _read(request: Request, limit: int) -> tuple[Any, int]:
    """The parsed body and its size in bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    if len(raw) <= OFFLOAD_BYTES:
        return _parse(raw), len(raw)
    # a large body is parsed and checked off the event loop: a client sending 4 MB bodies in a loop stalls only itself
    return await asyncio.get_running_loop().run_in_executor(_parser_pool, _parse, raw), len(raw)


def json_body(schema: type[M], defaults: Mapping[str, Any] | None = None) -> Callable[[Request], Awaitable[M]]:
    """A FastAPI dependency: the request's JSON object (at most the app's ``services.max_body`` bytes), with ``defaults``
    under it, validated as ``schema``; use it as ``req: Annotated[Schema, Depends(json_body(Schema))]``."""

    async def validated(request: Request) -> M:
        body, size = await _read(request, request.app.state.services.max_body)
        data = {**defaults, **body} if defaults else body
        try:
            if size <= VALIDATE_INLINE_BYTES:
                return schema.model_validate(data)
            fut = asyncio.get_running_loop().run_in_executor(_parser_pool, schema.model_validate, data)
            return await asyncio.wait_for(asyncio.shield(fut), VALIDATE_TIMEOUT_S)
        except ValidationError as exc:
            raise from_validation(exc) from None
        except TimeoutError:
            raise APIError(
                503, f"the server could not validate this request within {VALIDATE_TIMEOUT_S:.0f} s; retry later or send smaller JSON schemas",
                type="server_error", code="validation_timeout", headers={"Retry-After": "1"},
            ) from None  # fmt: skip

    return validated


def _parse(raw: bytes) -> Any:
    try:
        # strict UTF-8 (json.loads of bytes lets encoded lone surrogates through, which the tokenizer then fails on)
        text = raw.decode("utf-8-sig")
        body = loads_strict(text)
    except NonFinite as exc:  # a field a client computed as NaN: name it, as a field's own check would
        field = non_finite_path(text)
        raise APIError(400, f"{field or 'the body'} is not a finite number: {exc}", param=field, code="invalid_value") from exc
    except (ValueError, UnicodeDecodeError) as exc:  # invalid JSON, an over-long integer, bytes not UTF-8
        raise APIError(400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from exc
    except RecursionError:
        raise APIError(400, f"the JSON body is nested more than {MAX_DEPTH} levels deep", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    if too_deep(body):
        raise APIError(400, f"the JSON body is nested more than {MAX_DEPTH} levels deep", code="invalid_json")
    if _SURROGATE.search(raw):  # JSON may escape lone surrogates (\ud800), which are not text: the tokenizer would fail on them
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            msg = "We could not parse the JSON body of your request: it contains an unpaired surrogate escape"
            raise APIError(400, msg, code="invalid_json") from exc
    return body
