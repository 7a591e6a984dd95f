"""smolagents' first runs against the sweep's server: ``OpenAIServerModel`` (its class for OpenAI-compatible servers)
called directly and streamed, its default agent ``CodeAgent`` (the model writes Python code that calls the tools), and
``ToolCallingAgent`` (native tool calls) with a tool.

An agent run that ends at ``max_steps`` without a final answer has failed; each step's error says why (a step whose
model call failed on HTTP is server-side, one whose output the agent could not parse or run is model-side).
``max_steps`` is 4 (of 20) to bound the run's time. Run by ``bench/client_sweep.py``.
"""

from __future__ import annotations

from typing import Any

from _common import KEY, MODEL, URL, WEATHER_PROMPT, ModelSide, ServerSide, main
from smolagents import CodeAgent, OpenAIServerModel, ToolCallingAgent, tool

model = OpenAIServerModel(model_id=MODEL, api_base=URL, api_key=KEY)
called: list[str] = []


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: The city's name.
    """
    called.append(city)
    return f"sunny, 22 C in {city}"


def generate() -> str:
    return str(model.generate([{"role": "user", "content": [{"type": "text", "text": "Say hello in one sentence."}]}]).content)


def generate_stream() -> str:
    deltas = list(model.generate_stream([{"role": "user", "content": [{"type": "text", "text": "Count from 1 to 5."}]}]))
    return f"{len(deltas)} deltas: {''.join(d.content or '' for d in deltas)}"


def finished(agent: Any, result: Any) -> str:
    """The run's answer, or the failure its steps' errors name."""
    if getattr(result, "state", "success") == "success":
        return repr(result.output if hasattr(result, "output") else result)
    errors = [s.error for s in agent.memory.steps if getattr(s, "error", None) is not None]
    names = [type(e).__name__ for e in errors]
    calls = [f"{c.name}({c.arguments})"[:80] for s in agent.memory.steps for c in getattr(s, "tool_calls", None) or []]
    text = "; ".join(f"{type(e).__name__}: {str(e)[:150]}" for e in errors[-3:]) + f"; the steps' tool calls: {calls}"
    if "AgentGenerationError" in names:  # the model call itself failed (smolagents wraps the HTTP error)
        raise ServerSide(f"run ended {result.state}: {text}")
    raise ModelSide(f"run ended {result.state}: {text}")


def code_agent() -> str:
    agent = CodeAgent(tools=[get_weather], model=model, max_steps=4)
    return finished(agent, agent.run("What is the weather in Paris right now?", return_full_result=True))


def tool_calling_agent() -> str:
    called.clear()
    agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=4)
    out = finished(agent, agent.run(WEATHER_PROMPT, return_full_result=True))
    if not called:
        raise ModelSide(f"the agent answered without calling get_weather: {out}")
    return f"get_weather({called}) -> {out}"


main(
    "smolagents",
    ("smolagents", "openai"),
    [("model", generate), ("model_stream", generate_stream), ("code_agent", code_agent), ("tool_calling_agent", tool_calling_agent)],
)
