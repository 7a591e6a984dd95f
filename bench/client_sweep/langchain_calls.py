"""langchain-openai's first calls against the sweep's server: ``ChatOpenAI`` invoke and stream, ``bind_tools`` with a
tool round trip, ``with_structured_output`` (its default method, ``json_schema``) and ``OpenAIEmbeddings``.

``OpenAIEmbeddings`` is built as its docs say for OpenAI-compatible servers (``check_embedding_ctx_length=False``: raw
text, not tiktoken's cl100k token ids, which another model's vocabulary cannot read). ``max_retries=0``; nothing is
retried. Run by ``bench/client_sweep.py``.
"""

from __future__ import annotations

from _common import KEY, MODEL, URL, WEATHER_PROMPT, ModelSide, main
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import BaseModel

llm = ChatOpenAI(model=MODEL, base_url=URL, api_key=KEY, max_retries=0)  # type: ignore[arg-type]


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny, 22 C in {city}"


class Person(BaseModel):
    name: str
    age: int


def invoke() -> str:
    return str(llm.invoke("Say hello in one sentence.").content)


def stream() -> str:
    return "".join(str(chunk.content) for chunk in llm.stream("Count from 1 to 5."))


def tools() -> str:
    with_tools = llm.bind_tools([get_weather])
    messages: list = [HumanMessage(WEATHER_PROMPT)]
    ai = with_tools.invoke(messages)
    if not ai.tool_calls:
        raise ModelSide(f"no tool call: {ai.content!r}")
    call = ai.tool_calls[0]
    messages += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = with_tools.invoke(messages)
    return f"{call['name']}({call['args']}) -> {final.content!r}"


def structured() -> str:
    out = llm.with_structured_output(Person).invoke("John Smith is 42 years old.")
    if out is None:
        raise ModelSide("no structured output")
    return repr(out)


def embeddings() -> str:
    emb = OpenAIEmbeddings(model=MODEL, base_url=URL, api_key=KEY, max_retries=0, check_embedding_ctx_length=False)  # type: ignore[arg-type]
    vectors = emb.embed_documents(["hello world", "goodbye"])
    return f"{len(vectors)} vectors of {len(vectors[0])}"


main(
    "langchain-openai",
    ("langchain-openai", "langchain-core", "openai"),
    [("invoke", invoke), ("stream", stream), ("bind_tools", tools), ("with_structured_output", structured), ("embeddings", embeddings)],
)
