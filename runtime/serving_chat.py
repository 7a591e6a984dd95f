"""``/v1/chat/completions``: a validated request → engine requests → an OpenAI response or SSE stream.

Flow: render the prompt (``chat_format``), pick the constraint (``constraints``), build one
:class:`GenerateRequest` per choice (``n``), then either gather the results or merge the streams.
Tool calls are extracted from the generated text with the model's parser; with ``tool_choice: auto``
streaming holds back text from the first possible tool-call marker so a call is never shown as content.

Streaming follows OpenAI exactly: a role delta first, content deltas, tool-call deltas by index, a
chunk with ``finish_reason`` and an empty delta, a usage chunk when ``stream_options.include_usage``,
then ``data: [DONE]``. Errors after the stream has started are sent as one ``{"error": …}`` event, and
that choice is recorded as a turn with ``finish_reason: "abort"`` and the tokens it got before the failure.

Not here: authentication, body limits, error envelopes (``app``), or recording (a later issue).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from learner.records import ToolCallRecord, Turn, TurnTimings
from runtime.chat_format import ChatFormatter, to_plain
from runtime.constraints import grammar_for
from runtime.engine import (
    Engine,
    EngineError,
    GenerateRequest,
    GenerateResult,
    InvalidRequest,
    SamplingParams,
    StreamChunk,
    Timings,
    TokenLogprob,
)
from runtime.metrics import Metrics
from runtime.openai_schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    FunctionCall,
    ResponseMessage,
    TokenLogprobOut,
    ToolCall,
    TopLogprob,
    Usage,
)
from runtime.openai_schemas import (
    ChatCompletionRequest as _Req,
)
from runtime.recorder import ANONYMOUS, Recorder, TurnSlot, messages_key
from runtime.token_bytes import token_bytes_fn
from runtime.tool_parsers import ParseResult, get_parser

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    completion_id: str
    created: int
    prompt_ids: tuple[int, ...]
    engine_reqs: list[GenerateRequest]
    tool_names: set[str] | None  # None: tool calls are not parsed (no tools, or tool_choice none)
    forced_tool: bool  # tool_choice required / named: the whole output is one call
    messages: list[dict[str, Any]]  # the request's messages as chat-template dicts
    adapter: str | None  # the adapter version serving every choice (None = the base model)
    slots: list[TurnSlot] | None  # recorded turn ids per choice; None when recording is off

    def loopwise(self) -> dict[str, Any] | None:
        """The ``loopwise`` response field: ids to attach feedback to (choice 0, and every choice when n > 1)."""
        if self.slots is None:
            return None
        first = self.slots[0]
        out: dict[str, Any] = {"trajectory_id": first.trajectory_id, "turn_id": first.turn_id, "adapter": self.adapter}
        if len(self.slots) > 1:
            out["choices"] = [{"index": i, "trajectory_id": s.trajectory_id, "turn_id": s.turn_id} for i, s in enumerate(self.slots)]
        return out

    def headers(self) -> dict[str, str]:
        if self.slots is None:
            return {}
        return {
            "X-Loopwise-Trajectory-Id": ",".join(s.trajectory_id for s in self.slots),
            "X-Loopwise-Turn-Id": ",".join(s.turn_id for s in self.slots),
        }


class ChatService:
    def __init__(
        self,
        engine: Engine,
        formatter: ChatFormatter,
        model_id: str,
        default_max_tokens: int,
        metrics: Metrics,
        recorder: Recorder | None = None,
    ) -> None:
        self.engine = engine
        self.recorder = recorder
        self.formatter = formatter
        self.model_id = model_id
        self.default_max_tokens = default_max_tokens
        self.metrics = metrics
        self.parser = get_parser(formatter.parser_name)
        self._tok = formatter.tokenizer
        self._bytes = token_bytes_fn(formatter.tokenizer)

    # ---- preparation -----------------------------------------------------------------------
    def prepare(self, req: ChatCompletionRequest, request_id: str, session_id: str = ANONYMOUS, adapter: str | None = None) -> Prepared:
        tools_on = bool(req.tools) and req.tool_choice != "none"
        prompt = self.formatter.render(req.messages, req.tools if tools_on else None)
        prompt_len = len(prompt.token_ids)
        max_len = self.engine.info.max_model_len
        if prompt_len >= max_len:
            raise InvalidRequest(
                f"This model's maximum context length is {max_len} tokens. However, your messages resulted in "
                f"{prompt_len} tokens. Please reduce the length of the messages.",
                param="messages",
                code="context_length_exceeded",
            )
        asked = req.max_completion_tokens or req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        if asked is not None and prompt_len + asked > max_len:
            raise InvalidRequest(
                f"This model's maximum context length is {max_len} tokens. However, you requested {prompt_len + asked} "
                f"tokens ({prompt_len} in the messages, {asked} in the completion). Please reduce the length of the "
                "messages or completion.",
                param=param,
                code="context_length_exceeded",
            )
        max_new = asked if asked is not None else min(self.default_max_tokens, max_len - prompt_len)
        grammar = grammar_for(req, self.formatter.parser_name)
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        temperature = 1.0 if req.temperature is None else req.temperature
        reqs = []
        for i in range(req.n):
            sampling = SamplingParams(
                max_new_tokens=max_new,
                temperature=temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=None if req.seed is None else req.seed + i,
                stop=stop,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=req.logprobs or self.recorder is not None,  # recorded turns always keep logprobs
                top_logprobs=req.top_logprobs or 0,
                grammar=grammar,
            )
            reqs.append(GenerateRequest(request_id=f"{request_id}-{i}", input_ids=prompt.token_ids, sampling=sampling, adapter=adapter))
        forced = tools_on and (req.tool_choice == "required" or not isinstance(req.tool_choice, str | None))
        names = {t.function.name for t in req.tools} if tools_on and req.tools else None
        self.metrics.prompt_tokens.inc(prompt_len * req.n)
        plain = [to_plain(m, i) for i, m in enumerate(req.messages)]
        return Prepared(
            completion_id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
            created=int(time.time()),
            prompt_ids=prompt.token_ids,
            engine_reqs=reqs,
            tool_names=names,
            forced_tool=forced,
            messages=plain,
            adapter=adapter,
            slots=self.recorder.assign(session_id, plain, req.n) if self.recorder is not None else None,
        )

    def _turn(self, prep: Prepared, i: int, res: GenerateResult, content: str | None, calls: list[ToolCall], finish: str) -> Turn:
        """The record of choice ``i``: exact prompt ids, output ids and logprobs as the engine gave them."""
        assert prep.slots is not None
        slot = prep.slots[i]
        sp = prep.engine_reqs[i].sampling
        reply: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if calls:
            reply["tool_calls"] = [c.model_dump() for c in calls]
        return Turn(
            turn_id=slot.turn_id,
            trajectory_id=slot.trajectory_id,
            session_id=slot.session_id,
            index=slot.index,
            parent_turn_id=slot.parent_turn_id,
            completion_id=prep.completion_id,
            choice_index=i,
            model=self.model_id,
            adapter=prep.engine_reqs[i].adapter,
            context_ids=list(res.prompt_ids),
            output_ids=list(res.output_ids),
            logprobs=[lp.logprob for lp in res.logprobs],
            loss_mask=[1] * len(res.output_ids),
            sampling={
                "temperature": sp.temperature,
                "top_p": sp.top_p,
                "seed": sp.seed,
                "max_new_tokens": sp.max_new_tokens,
                "stop": list(sp.stop),
                "grammar": sp.grammar.kind if sp.grammar else None,
            },
            tool_calls=[ToolCallRecord(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in calls],
            finish_reason=finish,
            timings=TurnTimings(queued_s=res.timings.queued_s, ttft_s=res.timings.ttft_s, total_s=res.timings.total_s),
            messages=prep.messages,
            output_text=res.text,
            prefix_key=messages_key(prep.messages),
            continuation_key=messages_key([*prep.messages, reply]),
        )

    # ---- non-streamed ----------------------------------------------------------------------
    async def complete(self, req: _Req, prep: Prepared) -> ChatCompletion:
        tasks = [asyncio.ensure_future(self.engine.generate(r)) for r in prep.engine_reqs]
        try:
            results: list[GenerateResult] = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:  # one choice failed or the client left: stop the others too
                t.cancel()
            raise
        choices = []
        turns: list[Turn] = []
        for i, res in enumerate(results):
            self.metrics.ttft.observe(res.timings.ttft_s)
            parsed = self._parse(res.text, prep)
            finish = res.finish_reason
            if parsed.tool_calls and finish == "stop":
                finish = "tool_calls"
            message = ResponseMessage(
                content=parsed.content if parsed.tool_calls else res.text,
                tool_calls=[_tool_call(c.id, c.name, c.arguments) for c in parsed.tool_calls] or None,
            )
            logprobs = ChoiceLogprobs(content=self._logprobs(res.logprobs, res.matched_stop)) if req.logprobs else None
            choices.append(Choice(index=i, message=message, logprobs=logprobs, finish_reason=_openai_finish(finish)))
            if self.recorder is not None:
                turns.append(self._turn(prep, i, res, message.content, message.tool_calls or [], _openai_finish(finish)))
        if turns:
            assert self.recorder is not None
            await self.recorder.record(turns)
        completion_tokens = sum(len(r.output_ids) for r in results)
        prompt_tokens = len(prep.prompt_ids)
        return ChatCompletion(
            id=prep.completion_id,
            created=prep.created,
            model=req.model,
            choices=choices,
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens),
            loopwise=prep.loopwise(),
        )

    def _parse(self, text: str, prep: Prepared) -> ParseResult:
        if prep.tool_names is None:
            return ParseResult(content=text or None, tool_calls=[])
        return self.parser.parse(text, prep.tool_names)

    # ---- streamed --------------------------------------------------------------------------
    async def open_streams(self, prep: Prepared) -> list[tuple[AsyncIterator[StreamChunk], StreamChunk]]:
        """Start every choice's stream and wait for its first chunk, so that 429/400 happen before any byte is sent."""
        opened: list[tuple[AsyncIterator[StreamChunk], StreamChunk]] = []
        try:
            for r in prep.engine_reqs:
                it = aiter(self.engine.stream(r))
                first = await anext(it)
                opened.append((it, first))
        except BaseException:
            for it, _ in opened:
                await it.aclose()  # type: ignore[attr-defined]
            raise
        return opened

    async def stream(self, req: _Req, prep: Prepared, opened: list[tuple[AsyncIterator[StreamChunk], StreamChunk]]) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        queue: asyncio.Queue[tuple[int, StreamChunk | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, it: AsyncIterator[StreamChunk], first: StreamChunk) -> None:
            try:
                await queue.put((index, first))
                if first.finish_reason is None:
                    async for chunk in it:
                        await queue.put((index, chunk))
            except EngineError as exc:
                await queue.put((index, exc))
            finally:
                await queue.put((index, None))

        states = [_ChoiceStream(i, prep, self) for i in range(len(opened))]
        tasks = [asyncio.create_task(pump(i, it, first)) for i, (it, first) in enumerate(opened)]
        completion_tokens = 0
        finals: list[dict[str, Any]] = []
        try:
            for st in states:
                yield self._sse(
                    prep,
                    req,
                    [{"index": st.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                    include_usage,
                )
            live = len(tasks)
            while live:
                index, item = await queue.get()
                if item is None:
                    live -= 1
                    continue
                if isinstance(item, BaseException):
                    log.error("stream failed: %s", item)
                    states[index].abort()  # recorded below as an aborted turn, with the tokens it got
                    yield _sse_raw({"error": {"message": "generation failed", "type": "server_error", "param": None, "code": "internal_error"}})
                    continue
                completion_tokens += len(item.token_ids)
                for choice in states[index].feed(item, req.logprobs):
                    if choice["finish_reason"] is not None:
                        finals.append(choice)  # sent after the turns are recorded (sync durability)
                    else:
                        yield self._sse(prep, req, [choice], include_usage)
            if self.recorder is not None and all(st.result is not None for st in states):
                await self.recorder.record([self._turn(prep, st.index, st.result, st.content, st.calls, st.finish) for st in states])  # type: ignore[arg-type]
            ids = prep.loopwise()
            for choice in sorted(finals, key=lambda c: c["index"]):
                body = {**self._envelope(prep, req), "choices": [choice]}
                if include_usage:
                    body["usage"] = None
                if ids is not None:
                    body["loopwise"] = ids
                yield _sse_raw(body)
            if include_usage:
                p = len(prep.prompt_ids)
                usage = {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}
                yield _sse_raw({**self._envelope(prep, req), "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for it, _ in opened:
                # a stream still inside its pump's anext() cannot be closed from here ("already running");
                # cancelling that pump closes it (and so cancels its generation)
                with contextlib.suppress(RuntimeError):
                    await it.aclose()  # type: ignore[attr-defined]

    def _envelope(self, prep: Prepared, req: _Req) -> dict[str, Any]:
        return {"id": prep.completion_id, "object": "chat.completion.chunk", "created": prep.created, "model": req.model, "system_fingerprint": None}

    def _sse(self, prep: Prepared, req: _Req, choices: list[dict[str, Any]], include_usage: bool) -> str:
        body = {**self._envelope(prep, req), "choices": choices}
        if include_usage:
            body["usage"] = None
        return _sse_raw(body)

    # ---- shared ----------------------------------------------------------------------------
    def _logprobs(self, lps: tuple[TokenLogprob, ...], matched_stop: str | int | None) -> list[TokenLogprobOut]:
        out = []
        for lp in lps:
            if isinstance(matched_stop, int) and lp.token_id == matched_stop and lp is lps[-1]:
                continue  # the stop token is not part of the content
            top = [TopLogprob(token=self._tok.decode([tid]), logprob=v, bytes=list(self._bytes(tid))) for tid, v in lp.top]
            out.append(
                TokenLogprobOut(token=self._tok.decode([lp.token_id]), logprob=lp.logprob, bytes=list(self._bytes(lp.token_id)), top_logprobs=top)
            )
        return out


class _ChoiceStream:
    """Per-choice streaming state: what content was shown, what is held back for tool-call parsing."""

    def __init__(self, index: int, prep: Prepared, svc: ChatService) -> None:
        self.index = index
        self.prep = prep
        self.svc = svc
        self.text = ""  # all text generated so far
        self.shown = 0  # chars of self.text sent as content
        self.in_call = False
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.content = ""  # content the client received
        self.calls: list[ToolCall] = []
        self.finish = ""
        self.result: GenerateResult | None = None  # set at the end, for recording

    def feed(self, chunk: StreamChunk, want_logprobs: bool) -> list[dict[str, Any]]:
        out = self._deltas(chunk, want_logprobs)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        for c in out:
            self.content += c["delta"].get("content") or ""
            for call in c["delta"].get("tool_calls") or []:
                self.calls.append(_tool_call(call["id"], call["function"]["name"], call["function"]["arguments"]))
            if c["finish_reason"] is not None:
                self.finish = c["finish_reason"]
                req = self.prep.engine_reqs[self.index]
                self.result = GenerateResult(
                    request_id=req.request_id,
                    prompt_ids=req.input_ids,
                    output_ids=tuple(self.token_ids),
                    text=self.text,
                    finish_reason=chunk.finish_reason or "stop",
                    logprobs=tuple(self.logprobs),
                    matched_stop=chunk.matched_stop,
                    timings=chunk.timings or Timings(),
                )
        return out

    def abort(self) -> None:
        """The engine failed mid-stream: what was generated so far becomes an aborted result (for the record)."""
        if self.result is not None:
            return
        req = self.prep.engine_reqs[self.index]
        self.finish = "abort"
        self.result = GenerateResult(
            request_id=req.request_id,
            prompt_ids=req.input_ids,
            output_ids=tuple(self.token_ids),
            text=self.text,
            finish_reason="abort",
            logprobs=tuple(self.logprobs),
        )

    def _deltas(self, chunk: StreamChunk, want_logprobs: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self.text += chunk.text
        lps = ChoiceLogprobs(content=self.svc._logprobs(chunk.logprobs, chunk.matched_stop)).model_dump() if want_logprobs else None
        if self.prep.tool_names is None:
            upto = len(self.text)
        elif self.prep.forced_tool or self.in_call:
            upto = self.shown
        else:
            upto = self.svc.parser.stream_hold_index(self.text)
            self.in_call = upto < len(self.text) and self.svc.parser.detect(self.text[upto:])
        if upto > self.shown or (lps and lps["content"]):
            out.append(
                {
                    "index": self.index,
                    "delta": {"content": self.text[self.shown : upto]} if upto > self.shown else {},
                    "logprobs": lps,
                    "finish_reason": None,
                }
            )
            self.shown = max(self.shown, upto)
        if chunk.finish_reason is None:
            return out
        finish = chunk.finish_reason
        rest = self.text[self.shown :]
        if self.prep.tool_names is not None and rest:
            parsed = self.svc.parser.parse(rest, self.prep.tool_names)
            if parsed.tool_calls:
                if parsed.content:
                    out.append({"index": self.index, "delta": {"content": parsed.content}, "logprobs": None, "finish_reason": None})
                calls = [
                    {"index": k, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for k, c in enumerate(parsed.tool_calls)
                ]
                out.append({"index": self.index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None})
                finish = "tool_calls" if finish == "stop" else finish
                rest = ""
        if rest:
            out.append({"index": self.index, "delta": {"content": rest}, "logprobs": None, "finish_reason": None})
        self.shown = len(self.text)
        out.append({"index": self.index, "delta": {}, "logprobs": None, "finish_reason": _openai_finish(finish)})
        return out


def _tool_call(call_id: str, name: str, arguments: str) -> ToolCall:
    return ToolCall(id=call_id, type="function", function=FunctionCall(name=name, arguments=arguments))


def _openai_finish(reason: str) -> Any:
    return "stop" if reason == "abort" else reason


def _sse_raw(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
