"""instructor's first calls against the sweep's server, its README's path: ``instructor.from_openai(OpenAI(...))`` (mode
``TOOLS``: a forced function call) with a Pydantic ``response_model``, streamed partial objects
(``create_partial``), several objects (``create_iterable``), and ``Mode.JSON`` (``response_format`` json_object), the
mode its docs suggest for open models.

instructor's own defaults are kept (its re-asking ``max_retries`` included: that is the library's behaviour, not a
retry of ours); the OpenAI client under it has ``max_retries=0``. Run by ``bench/client_sweep.py``.
"""

from __future__ import annotations

import instructor
from _common import KEY, MODEL, URL, ModelSide, main
from openai import OpenAI
from pydantic import BaseModel


class Person(BaseModel):
    name: str
    age: int


EXTRACT = [{"role": "user", "content": "Extract the person: John Smith is 42 years old."}]
client = instructor.from_openai(OpenAI(base_url=URL, api_key=KEY, max_retries=0))
json_client = instructor.from_openai(OpenAI(base_url=URL, api_key=KEY, max_retries=0), mode=instructor.Mode.JSON)


def create() -> str:
    return repr(client.chat.completions.create(model=MODEL, response_model=Person, messages=EXTRACT))


def create_partial() -> str:
    parts = list(client.chat.completions.create_partial(model=MODEL, response_model=Person, messages=EXTRACT))
    return f"{len(parts)} partials, last {parts[-1]!r}" if parts else "no partials"


def create_iterable() -> str:
    people = list(
        client.chat.completions.create_iterable(
            model=MODEL, response_model=Person, messages=[{"role": "user", "content": "Extract the people: Ann is 31 and Bob is 45."}]
        )
    )
    if not people:  # the schema lets the list be empty (or a stream cut at the length limit ends with none complete)
        raise ModelSide("no person extracted from a sentence about two")
    return repr(people)


def json_mode() -> str:
    return repr(json_client.chat.completions.create(model=MODEL, response_model=Person, messages=EXTRACT))


main(
    "instructor",
    ("instructor", "openai"),
    [("create", create), ("create_partial", create_partial), ("create_iterable", create_iterable), ("json_mode", json_mode)],
)
