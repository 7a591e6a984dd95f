"""litellm's calls against a loopwise server, run by ``test_litellm_langchain.py`` with the clients' virtualenv's python
(``make clients``; litellm is not installed in the project's own).

``python litellm_calls.py <base_url> <model> <json>``, where the JSON gives ``prompts`` (``penalized``, ``plain``,
``streamed``: one per call, so the test finds each call's recorded turn by its prompt) and ``logit_bias``. Prints one
JSON line: per call, the reply text, or the error the library raised (a non-200 raises in litellm). A fourth call,
``embedding``, embeds the ``plain`` prompt with ``litellm.embedding``'s defaults (its vector, as JSON).
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from typing import Any

import litellm

url, model, spec = sys.argv[1], "openai/" + sys.argv[2], json.loads(sys.argv[3])
prompts, bias = spec["prompts"], spec["logit_bias"]
penalties: dict[str, Any] = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": bias, "temperature": 0}


def user(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def penalized() -> str:
    r = litellm.completion(model=model, api_base=url, api_key="unused", messages=user(prompts["penalized"]), **penalties)
    return r.choices[0].message.content or ""


def plain() -> str:
    r = litellm.completion(model=model, api_base=url, api_key="unused", messages=user(prompts["plain"]))
    return r.choices[0].message.content or ""


def streamed() -> str:
    chunks = litellm.completion(model=model, api_base=url, api_key="unused", messages=user(prompts["streamed"]), stream=True, **penalties)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def embedding() -> str:
    # no encoding_format: litellm sends "encoding_format": null (the server's default, float, answers it)
    r = litellm.embedding(model=model, api_base=url, api_key="unused", input=[prompts["plain"]])
    return json.dumps(r.data[0]["embedding"])


out: dict[str, dict[str, str]] = {}
for name, call in (("penalized", penalized), ("plain", plain), ("streamed", streamed), ("embedding", embedding)):
    try:
        out[name] = {"content": call()}
    except Exception as exc:  # reported per call, so one failure does not hide the others
        out[name] = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps({"version": version("litellm"), "calls": out}))
