"""Responses, Messages, Completions and Embeddings, in process, with the real client packages (openai, anthropic).

The engine is scripted (its replies are tokenized with the real tiny tokenizer; everything above it is
real: templating, constraints, tool-call parsing and streaming, recording into SQLite, adapter routing,
the wire formats). Embeddings run the real tiny model. The same recording and adapter checks run over
every generating API (decision 14: one path under all of them).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from runtime.adapters.names import AdapterRef
from tests.runtime._inproc import InProc, scripted_app

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RTOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def serve(tokenizer, tmp_path):
    made: list[InProc] = []

    def make(script, **server):
        app, engine, store = scripted_app(tokenizer, script, tmp_path, **server)
        srv = InProc(app)
        srv.engine, srv.store = engine, store
        made.append(srv)
        return srv

    yield make
    for s in made:
        s.close()


def oai(srv: InProc, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url, api_key=key, http_client=srv.client, max_retries=0)


def claude(srv: InProc, key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base_url, api_key=key, http_client=srv.client, max_retries=0)


def prompt_of(srv: InProc, k: int = -1) -> str:
    return srv.engine.tok.decode(srv.engine.calls[k].input_ids)


# ---- Responses ----------------------------------------------------------------------------------


def test_responses_plain_store_get_input_items_delete(serve):
    srv = serve(["Hello there."])
    r = oai(srv).responses.create(model="tiny", input="Say hello.", instructions="Be brief.", metadata={"k": "v"})
    assert r.status == "completed" and r.output_text == "Hello there." and r.id.startswith("resp_")
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == len(srv.engine.calls[0].input_ids) and r.usage.output_tokens == len(srv.engine.tok.encode("Hello there.")) + 1
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens and r.metadata == {"k": "v"}
    assert "Be brief." in prompt_of(srv) and "Say hello." in prompt_of(srv)
    got = oai(srv).responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == "Hello there."
    items = oai(srv).responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Say hello."
    ids = r.model_extra["loopwise"]
    turn = srv.store.get_trajectory(ids["trajectory_id"]).turns[0]
    assert turn.turn_id == ids["turn_id"] and turn.completion_id == r.id and turn.sampling["api"] == "responses"
    oai(srv).responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai(srv).responses.retrieve(r.id)


def test_responses_are_private_to_the_key_that_stored_them(serve):
    srv = serve(["a", "b"], api_keys=("k1", "k2"))
    r = oai(srv, "k1").responses.create(model="tiny", input="hi")
    with pytest.raises(openai.NotFoundError):
        oai(srv, "k2").responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        oai(srv, "k2").responses.create(model="tiny", input="more", previous_response_id=r.id)
    with pytest.raises(openai.NotFoundError):
        oai(srv, "k2").responses.delete(r.id)
    assert oai(srv, "k1").responses.retrieve(r.id).id == r.id


def test_responses_store_false_is_not_retrievable(serve):
    srv = serve(["a"])
    r = oai(srv).responses.create(model="tiny", input="hi", store=False)
    assert r.output_text == "a"
    with pytest.raises(openai.NotFoundError):
        oai(srv).responses.retrieve(r.id)


def test_responses_tool_round_trip_with_previous_response_id_continues_the_trajectory(serve):
    srv = serve([CALL, "It is 22C in Paris."])
    c = oai(srv)
    r1 = c.responses.create(model="tiny", input="Weather in Paris?", tools=RTOOLS)
    [call] = [o for o in r1.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert "get_weather" in prompt_of(srv, 0)
    r2 = c.responses.create(
        model="tiny", previous_response_id=r1.id, tools=RTOOLS, input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22C"}]
    )
    assert r2.output_text == "It is 22C in Paris."
    second = prompt_of(srv, 1)
    assert "Weather in Paris?" in second and "<tool_response>\n22C\n</tool_response>" in second and '"city": "Paris"' in second
    t1, t2 = r1.model_extra["loopwise"], r2.model_extra["loopwise"]
    assert t2["trajectory_id"] == t1["trajectory_id"]
    turns = srv.store.get_trajectory(t1["trajectory_id"]).turns
    assert [t.turn_id for t in turns] == [t1["turn_id"], t2["turn_id"]] and turns[1].parent_turn_id == t1["turn_id"]
    assert turns[0].tool_calls[0].name == "get_weather"
    # the whole history is what the model saw; input_items lists it
    kinds = [i.type for i in c.responses.input_items.list(r2.id, order="asc").data]
    assert kinds == ["message", "function_call", "function_call_output"]


def test_responses_history_resent_without_previous_response_id_also_continues(serve):
    """openai-agents' default: the client resends the output items as input."""
    srv = serve([CALL, "Done."])
    c = oai(srv)
    first_input = [{"role": "user", "content": "Weather in Paris?"}]
    r1 = c.responses.create(model="tiny", input=first_input, tools=RTOOLS, instructions="sys")
    history = [*first_input, *[o.model_dump(exclude_none=True) for o in r1.output]]
    history.append({"type": "function_call_output", "call_id": r1.output[-1].call_id, "output": "sunny"})
    r2 = c.responses.create(model="tiny", input=history, tools=RTOOLS, instructions="sys")
    assert r2.model_extra["loopwise"]["trajectory_id"] == r1.model_extra["loopwise"]["trajectory_id"]


def test_responses_text_format_json_schema_is_constrained(serve):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"], "additionalProperties": False}
    srv = serve(['{"answer":4}'])
    r = oai(srv).responses.create(
        model="tiny", input="2+2?", text={"format": {"type": "json_schema", "name": "result", "schema": schema, "strict": True}}
    )
    assert json.loads(r.output_text) == {"answer": 4}
    grammar = srv.engine.calls[0].sampling.grammar
    assert grammar is not None and grammar.kind == "json_schema" and json.loads(grammar.spec) == schema
    assert r.text.format.type == "json_schema"


def test_responses_stream_events_in_order(serve):
    srv = serve(["Hi you.", CALL])
    events = list(oai(srv).responses.create(model="tiny", input="hello", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == "Hi you." == final.output_text and final.usage.output_tokens > 0
    assert final.model_extra["loopwise"]["trajectory_id"]
    # a streamed tool call: its arguments arrive in pieces, and the SDK's helper assembles the final response
    with oai(srv).responses.stream(model="tiny", input="weather?", tools=RTOOLS, tool_choice="required") as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert len(deltas) > 2 and json.loads("".join(deltas)) == {"city": "Paris"}
    [call] = final.output
    assert call.type == "function_call" and call.arguments == "".join(deltas)
    assert srv.engine.calls[-1].sampling.grammar is not None  # tool_choice required is decoded under the call grammar
    assert oai(srv).responses.retrieve(final.id).output[0].arguments == call.arguments


def test_responses_incomplete_and_errors(serve):
    srv = serve(["a b c d e f g h i j"])
    r = oai(srv).responses.create(model="tiny", input="count", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as ei:
        oai(srv).responses.create(model="tiny", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}])
    assert ei.value.body["param"] == "input[0].content[0]"
    with pytest.raises(openai.BadRequestError) as ei:
        oai(srv).responses.create(model="tiny", input="x", tools=[{"type": "web_search"}])
    assert ei.value.body["param"] == "tools[0].type" and "function tools" in ei.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        oai(srv).responses.create(model="tiny", input="x", previous_response_id="resp_missing")


# ---- Anthropic Messages ---------------------------------------------------------------------------

ATOOLS = [{"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}]


def test_messages_plain_and_system(serve):
    srv = serve(["Bonjour."])
    m = claude(srv).messages.create(model="tiny", max_tokens=50, system="Answer in French.", messages=[{"role": "user", "content": "Hello"}])
    assert m.content[0].type == "text" and m.content[0].text == "Bonjour." and m.stop_reason == "end_turn"
    assert m.usage.input_tokens == len(srv.engine.calls[0].input_ids) and m.usage.output_tokens > 0
    assert "Answer in French." in prompt_of(srv) and m.id.startswith("msg_")


def test_messages_tools_round_trip_and_stream(serve):
    srv = serve([CALL, "It is 22C.", CALL])
    c = claude(srv)
    first = [{"role": "user", "content": "Weather in Paris?"}]
    m1 = c.messages.create(model="tiny", max_tokens=100, messages=first, tools=ATOOLS)
    assert m1.stop_reason == "tool_use"
    [use] = [b for b in m1.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    history = [
        *first,
        {"role": "assistant", "content": [b.model_dump() for b in m1.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "22C"}]},
    ]
    m2 = c.messages.create(model="tiny", max_tokens=100, messages=history, tools=ATOOLS)
    assert m2.content[0].text == "It is 22C." and "<tool_response>\n22C\n</tool_response>" in prompt_of(srv, 1)
    assert m2.model_extra["loopwise"]["trajectory_id"] == m1.model_extra["loopwise"]["trajectory_id"]
    # streamed, forced tool: input_json_delta pieces build the input
    with c.messages.stream(model="tiny", max_tokens=100, messages=first, tools=ATOOLS, tool_choice={"type": "any"}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_start" in kinds
    assert final.stop_reason == "tool_use" and final.content[0].input == {"city": "Paris"}


def test_messages_stream_text(serve):
    srv = serve(["one two three"])
    with claude(srv).messages.stream(model="tiny", max_tokens=50, messages=[{"role": "user", "content": "go"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text == "one two three" and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(srv.engine.tok.encode("one two three")) + 1


@pytest.mark.parametrize(
    ("finish", "matched", "want"),
    [
        ("stop", "STOP", ("stop_sequence", "STOP")),
        ("stop", 2, ("end_turn", None)),
        ("length", None, ("max_tokens", None)),
        ("tool_calls", None, ("tool_use", None)),
    ],
)
def test_messages_stop_reasons(finish, matched, want):
    from runtime.api.messages import _stop_reason
    from runtime.generation import ChoiceOut

    assert _stop_reason(ChoiceOut(0, "x", [], finish, matched_stop=matched)) == want


def test_messages_errors_use_anthropics_envelope(serve):
    srv = serve([])
    with pytest.raises(anthropic.BadRequestError) as ei:
        claude(srv).messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "pre "}])
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "invalid_request_error"
    assert "trailing whitespace" in ei.value.message
    with pytest.raises(anthropic.NotFoundError) as ei:
        claude(srv).messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert ei.value.body["error"]["type"] == "not_found_error"
    r = srv.client.post("/v1/messages", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "'max_tokens' is a required property"


def test_messages_x_api_key_is_the_api_key(serve):
    srv = serve(["ok"], api_keys=("secret",))
    with pytest.raises(anthropic.AuthenticationError):
        claude(srv, "wrong").messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert claude(srv, "secret").messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "x"}]).content[0].text == "ok"


def test_count_tokens(serve):
    srv = serve(["x"])
    n = claude(srv).messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "Hello there"}]).input_tokens
    claude(srv).messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "Hello there"}])
    assert n == len(srv.engine.calls[0].input_ids)


# ---- Completions ------------------------------------------------------------------------------------


def test_completions_string_ids_echo_logprobs_batch(serve, tokenizer):
    srv = serve(lambda req: " Paris is nice")
    c = oai(srv)
    r = c.completions.create(model="tiny", prompt="The capital of France is", max_tokens=10, logprobs=2)
    assert r.object == "text_completion" and r.choices[0].text == " Paris is nice" and r.choices[0].finish_reason == "stop"
    assert srv.engine.calls[0].input_ids == tuple(tokenizer("The capital of France is")["input_ids"])  # no chat template
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == " Paris is nice" and lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert all(len(t) <= 2 for t in lp.top_logprobs) and len(lp.token_logprobs) == len(lp.tokens)
    ids = [1, 2, 3, 4]
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=10, echo=True)
    assert srv.engine.calls[-1].input_ids == tuple(ids) and r.choices[0].text == tokenizer.decode(ids) + " Paris is nice"
    r = c.completions.create(model="tiny", prompt=["a", "b"], n=2, max_tokens=5)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3] and r.usage.prompt_tokens == 2 * len(tokenizer("a")["input_ids"])
    chunks = list(c.completions.create(model="tiny", prompt="x", max_tokens=10, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == " Paris is nice"
    assert chunks[-1].usage.completion_tokens > 0
    with pytest.raises(openai.BadRequestError) as ei:
        c.completions.create(model="tiny", prompt=[1, 10**9], max_tokens=2)
    assert "vocabulary" in ei.value.body["message"] and ei.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as ei:
        c.completions.create(model="tiny", prompt="x", suffix="y")
    assert ei.value.body["param"] == "suffix"


# ---- the same path under every API: recording and adapters -------------------------------------------

API_CALLS = {
    "chat": lambda srv, model: oai(srv).chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}]).model_extra,
    "responses": lambda srv, model: oai(srv).responses.create(model=model, input="hi").model_extra,
    "messages": lambda srv, model: claude(srv).messages.create(model=model, max_tokens=20, messages=[{"role": "user", "content": "hi"}]).model_extra,
    "completions": lambda srv, model: oai(srv).completions.create(model=model, prompt="hi", max_tokens=20).model_extra,
}
API_NAMES = {"chat": "chat.completions", "responses": "responses", "messages": "messages", "completions": "completions"}


@pytest.mark.parametrize("api", list(API_CALLS))
def test_every_api_records_its_turn_and_honours_adapters(serve, api):
    srv = serve(["hello back", "hello again"])
    registry = srv.app.state.services.registry
    srv.client.portal.call(functools.partial(registry.register, AdapterRef("tone", 1, "/unused"), make_alias=True))
    base = API_CALLS[api](srv, "tiny")["loopwise"]
    tuned = API_CALLS[api](srv, "tone")["loopwise"]
    assert [c.adapter for c in srv.engine.calls] == [None, "tone@1"]
    t_base = srv.store.get_trajectory(base["trajectory_id"]).turns[0]
    t_tuned = srv.store.get_trajectory(tuned["trajectory_id"]).turns[0]
    assert t_base.adapter is None and t_tuned.adapter == "tone@1" and tuned["adapter"] == "tone@1"
    assert t_base.sampling["api"] == API_NAMES[api]
    assert t_base.context_ids == list(srv.engine.calls[0].input_ids) and t_base.output_ids[-1] == srv.engine.tok.eos_token_id
    assert len(t_base.logprobs) == len(t_base.output_ids)
    # feedback by the response's own id reaches the turn
    fb = srv.client.post("/v1/feedback", json={"turn_id": base["turn_id"], "reward": 1.0})
    assert fb.status_code == 200, fb.text


@pytest.mark.parametrize("api", list(API_CALLS))
def test_every_api_answers_404_for_an_unknown_model(serve, api):
    srv = serve([])
    with pytest.raises((openai.NotFoundError, anthropic.NotFoundError)):
        API_CALLS[api](srv, "no-such-model")


# ---- Embeddings (the real tiny model) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_app(tiny_model_path, tmp_path_factory):
    from runtime.app import create_app
    from runtime.engines.embedded import EmbeddedEngine
    from runtime.settings import EngineSettings, ServerSettings

    engine = EmbeddedEngine(tiny_model_path, model_id="tiny", dtype="float32")
    srv = InProc(create_app(ServerSettings(data_dir=tmp_path_factory.mktemp("emb")), EngineSettings(), engine, "tiny"))
    yield srv
    srv.close()


def test_embeddings_are_the_pooled_final_hidden_states(tiny_app, tiny_model_path):
    import numpy as np
    import torch
    from transformers import AutoModel

    texts = ["The cat sat.", "A completely different sentence about stocks."]
    c = oai(tiny_app)
    mean = c.embeddings.create(model="tiny", input=texts, encoding_format="float")
    b64 = c.embeddings.create(model="tiny", input=texts)  # the SDK's default: base64 float32
    last = c.embeddings.create(model="tiny", input=texts, encoding_format="float", extra_body={"pooling": "last"})
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModel.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    for i, text in enumerate(texts):
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            h = model(input_ids=torch.tensor([ids])).last_hidden_state[0].double().numpy()
        for got, want in ((mean, h.mean(0)), (last, h[-1])):
            v = np.array(got.data[i].embedding)
            assert abs(np.linalg.norm(v) - 1) < 1e-5
            assert np.allclose(v, want / np.linalg.norm(want), atol=1e-4)
        assert np.allclose(np.array(b64.data[i].embedding), np.array(mean.data[i].embedding), atol=1e-6)
    assert mean.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in texts)
    with pytest.raises(openai.BadRequestError) as ei:
        c.embeddings.create(model="tiny", input="x", dimensions=3)
    assert ei.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError):
        c.embeddings.create(model="tiny", input="")
    r = tiny_app.client.post("/v1/embeddings", json={"model": "tiny@9", "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_embeddings_take_a_null_encoding_format_as_float(tiny_app):
    """litellm (and so dspy's ``Embedder``) sends ``"encoding_format": null`` when its caller names none, which OpenAI
    takes as the default: float vectors, the same as asking for them (it was a 400 that named the field)."""
    texts = ["hello world", "goodbye"]
    r = tiny_app.client.post("/v1/embeddings", json={"model": "tiny", "input": texts, "encoding_format": None})
    assert r.status_code == 200, r.text
    got = [d["embedding"] for d in r.json()["data"]]
    want = oai(tiny_app).embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert got == [d.embedding for d in want.data] and all(isinstance(x, float) for x in got[0])


def test_embeddings_are_501_on_a_backend_without_them(serve):
    srv = serve([])
    r = srv.client.post("/v1/embeddings", json={"model": "tiny", "input": "x"})
    assert r.status_code == 501 and "not supported by the scripted backend" in r.json()["error"]["message"]


def test_generating_while_embedding(tiny_app):
    r = httpx.Client(transport=httpx.MockTransport(lambda req: httpx.Response(200)))
    r.close()
    out = oai(tiny_app).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length")
