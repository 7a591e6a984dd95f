"""openai-agents' first runs against the sweep's server, on its default model class (the Responses API): a plain run, a
streamed run, a ``function_tool`` the agent should call, an ``output_type``, and the same plain run on the Chat
Completions model class (``set_default_openai_api("chat_completions")``, what its docs suggest for other servers).

The package is imported as ``agents``, the name of loopwise's own package: ``bench/client_sweep.py`` runs this from a
folder outside the checkout without ``PYTHONPATH``. The client is the docs' custom-server setup (a default
``AsyncOpenAI`` with the server's URL, tracing off) with ``max_retries=0``; nothing is retried.
"""

from __future__ import annotations

import asyncio

from _common import KEY, MODEL, URL, WEATHER_PROMPT, ModelSide, main
from openai import AsyncOpenAI
from pydantic import BaseModel

# openai-agents' package (ruff files it with loopwise's own ``agents``, first-party; this script never sees that one)
from agents import Agent, Runner, function_tool, set_default_openai_api, set_default_openai_client, set_tracing_disabled

set_default_openai_client(AsyncOpenAI(base_url=URL, api_key=KEY, max_retries=0), use_for_tracing=False)
set_tracing_disabled(True)
called: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    called.append(city)
    return f"sunny, 22 C in {city}"


class Person(BaseModel):
    name: str
    age: int


def plain() -> str:
    agent = Agent(name="assistant", instructions="You are a helpful assistant.", model=MODEL)
    return str(Runner.run_sync(agent, "Say hello in one sentence.").final_output)


def streamed() -> str:
    agent = Agent(name="assistant", instructions="You are a helpful assistant.", model=MODEL)

    async def go() -> str:
        result = Runner.run_streamed(agent, "Count from 1 to 5.")
        deltas = [
            e.data.delta async for e in result.stream_events() if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"
        ]
        return f"{len(deltas)} deltas: {result.final_output}"

    # run_sync runs on the thread's default loop, and the client's connection pool is bound to it: stay on it
    return asyncio.get_event_loop().run_until_complete(go())


def tool() -> str:
    agent = Agent(name="assistant", instructions="Use tools when they help.", model=MODEL, tools=[get_weather])
    out = Runner.run_sync(agent, WEATHER_PROMPT).final_output
    if not called:
        raise ModelSide(f"the agent answered without calling get_weather: {out!r}")
    return f"get_weather({called}) -> {out!r}"


def structured() -> str:
    agent = Agent(name="extractor", instructions="Extract the person.", model=MODEL, output_type=Person)
    return repr(Runner.run_sync(agent, "John Smith is 42 years old.").final_output)


def chat_completions_api() -> str:
    set_default_openai_api("chat_completions")
    try:
        agent = Agent(name="assistant", instructions="You are a helpful assistant.", model=MODEL)
        return str(Runner.run_sync(agent, "Say hello in one sentence.").final_output)
    finally:
        set_default_openai_api("responses")


main(
    "openai-agents",
    ("openai-agents", "openai"),
    [("run", plain), ("run_streamed", streamed), ("tool", tool), ("output_type", structured), ("chat_completions_api", chat_completions_api)],
)
