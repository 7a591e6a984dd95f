"""langchain-openai's calls against a loopwise server, run by ``test_litellm_langchain.py`` with the clients'
virtualenv's python (``make clients``; langchain-openai is not installed in the project's own).

``python langchain_calls.py <base_url> <model> <json>``, where the JSON gives ``prompts`` (``penalized``, ``plain``,
``streamed``: one per call, so the test finds each call's recorded turn by its prompt) and ``logit_bias``. Prints one
JSON line: per call, the reply text, or the error the library raised (a non-200 raises in langchain-openai).
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version

from langchain_openai import ChatOpenAI

url, model, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
prompts = spec["prompts"]
bias = {int(k): int(v) for k, v in spec["logit_bias"].items()}  # ChatOpenAI's logit_bias is dict[int, int]
# max_retries=0: a refused request fails at once instead of being retried with a back-off
penalized_model = ChatOpenAI(
    base_url=url, api_key="unused", model=model, presence_penalty=0.5, frequency_penalty=0.5, logit_bias=bias, temperature=0, max_retries=0
)
plain_model = ChatOpenAI(base_url=url, api_key="unused", model=model)  # the defaults, as a user writes it


def penalized() -> str:
    return str(penalized_model.invoke(prompts["penalized"]).content)


def plain() -> str:
    return str(plain_model.invoke(prompts["plain"]).content)


def streamed() -> str:
    return "".join(str(chunk.content) for chunk in penalized_model.stream(prompts["streamed"]))


out: dict[str, dict[str, str]] = {}
for name, call in (("penalized", penalized), ("plain", plain), ("streamed", streamed)):
    try:
        out[name] = {"content": call()}
    except Exception as exc:  # reported per call, so one failure does not hide the others
        out[name] = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps({"version": version("langchain-openai"), "calls": out}))
