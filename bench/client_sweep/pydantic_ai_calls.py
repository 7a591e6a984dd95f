"""pydantic-ai's first runs against the sweep's server, as its docs write them: ``Agent("openai:<model>")`` with
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` set (the ``openai:`` prefix is its Responses model), a plain run, a streamed
run, a tool, a Pydantic ``output_type`` (what the library is about; also streamed), the Chat Completions model
(``openai-chat:``) with the same ``output_type``, and ``Embedder("openai:<model>")``.

Run by ``bench/client_sweep.py``; the library's own defaults (its output retries included) are left as they are.
"""

from __future__ import annotations

from _common import MODEL, WEATHER_PROMPT, ModelSide, main
from pydantic import BaseModel
from pydantic_ai import Agent, Embedder

called: list[str] = []


class Person(BaseModel):
    name: str
    age: int


def plain() -> str:
    return str(Agent(f"openai:{MODEL}", instructions="Be concise.").run_sync("Say hello in one sentence.").output)


def streamed() -> str:
    agent = Agent(f"openai:{MODEL}", instructions="Be concise.")
    with agent.run_stream_sync("Count from 1 to 5.") as result:
        pieces = list(result.stream_text(delta=True))
    return f"{len(pieces)} pieces: {''.join(pieces)}"


def tool() -> str:
    agent = Agent(f"openai:{MODEL}", instructions="Use tools when they help.")

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        called.append(city)
        return f"sunny, 22 C in {city}"

    out = agent.run_sync(WEATHER_PROMPT).output
    if not called:
        raise ModelSide(f"the agent answered without calling get_weather: {out!r}")
    return f"get_weather({called}) -> {out!r}"


def structured() -> str:
    return repr(Agent(f"openai:{MODEL}", output_type=Person).run_sync("John Smith is 42 years old.").output)


def structured_stream() -> str:
    with Agent(f"openai:{MODEL}", output_type=Person).run_stream_sync("John Smith is 42 years old.") as result:
        partials = list(result.stream_output())
        final = result.get_output()
    return f"{len(partials)} partial outputs, final {final!r}"


def structured_chat() -> str:
    return repr(Agent(f"openai-chat:{MODEL}", output_type=Person).run_sync("John Smith is 42 years old.").output)


def embeddings() -> str:
    r = Embedder(f"openai:{MODEL}").embed_documents_sync(["hello world", "goodbye"])
    return f"{len(r.embeddings)} vectors of {len(r.embeddings[0])}"


main(
    "pydantic-ai",
    ("pydantic-ai-slim", "openai"),
    [
        ("run", plain),
        ("run_stream", streamed),
        ("tool", tool),
        ("output_type", structured),
        ("output_type_stream", structured_stream),
        ("output_type_chat", structured_chat),
        ("embeddings", embeddings),
    ],
)
