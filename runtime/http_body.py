"""Reading a JSON request body at the HTTP edge, with OpenAI-style errors.

One function for every route: a body over ``limit`` is a 413 (checked while reading, so chunked
bodies are bounded too); an empty body, invalid JSON, a non-object, or JSON carrying unpaired
surrogate escapes is a 400 ``invalid_json``. Not here: validating the object's fields (pydantic).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from runtime.errors import APIError

DEFAULT_LIMIT = 4 * 1024 * 1024


async def read_json(request: Request, limit: int = DEFAULT_LIMIT) -> Any:
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
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:  # JSON may escape lone surrogates (\ud800), which are not text: the tokenizer would fail on them
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        msg = "We could not parse the JSON body of your request: it contains an unpaired surrogate escape"
        raise APIError(400, msg, code="invalid_json") from exc
    return body
