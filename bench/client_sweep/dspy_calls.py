"""dspy's first programs against the sweep's server: ``dspy.LM("openai/<model>", api_base=...)`` called directly,
``dspy.Predict`` and ``dspy.ChainOfThought`` on ``"question -> answer"``, a typed signature (its adapters parse the
model's text into fields: what dspy is about), ``dspy.ReAct`` with a tool, and ``dspy.Embedder``.

dspy's own defaults are kept (its ChatAdapter falls back to the JSONAdapter when it cannot parse a reply: the
library's behaviour, not a retry of ours), except: the LM's cache is off (``cache=False``) so every run asks the
server, ``num_retries=0``, and ReAct's ``max_iters`` is 5 (of 20) to bound the run's time. Run by
``bench/client_sweep.py``.
"""

from __future__ import annotations

from typing import Literal

import dspy
from _common import KEY, MODEL, URL, ModelSide, main

lm = dspy.LM(f"openai/{MODEL}", api_base=URL, api_key=KEY, cache=False, num_retries=0)
dspy.configure(lm=lm)
called: list[str] = []


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    called.append(city)
    return f"sunny, 22 C in {city}"


def lm_call() -> str:
    return repr(lm("Say hello in one sentence."))


def predict() -> str:
    return repr(dspy.Predict("question -> answer")(question="What is the capital of France?").answer)


def chain_of_thought() -> str:
    r = dspy.ChainOfThought("question -> answer")(question="What is 2 + 3?")
    return f"{r.reasoning!r} -> {r.answer!r}"


def typed() -> str:
    class Sentiment(dspy.Signature):
        """Classify the sentiment of a sentence."""

        sentence: str = dspy.InputField()
        sentiment: Literal["positive", "negative", "neutral"] = dspy.OutputField()
        confidence: float = dspy.OutputField()

    r = dspy.Predict(Sentiment)(sentence="I love this sunny day!")
    return f"{r.sentiment!r} {r.confidence!r}"


def react() -> str:
    r = dspy.ReAct("question -> answer", tools=[get_weather], max_iters=5)(question="What is the weather in Paris right now?")
    if not called:
        raise ModelSide(f"the agent answered without calling get_weather: {r.answer!r}")
    return f"get_weather({called}) -> {r.answer!r}"


def embedder() -> str:
    vectors = dspy.Embedder(f"openai/{MODEL}", api_base=URL, api_key=KEY, caching=False)(["hello world", "goodbye"])
    return f"{len(vectors)} vectors of {len(vectors[0])}"


main(
    "dspy",
    ("dspy", "litellm", "openai"),
    [
        ("lm", lm_call),
        ("predict", predict),
        ("chain_of_thought", chain_of_thought),
        ("typed_signature", typed),
        ("react", react),
        ("embedder", embedder),
    ],
)
