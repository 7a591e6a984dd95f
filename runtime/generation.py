"""The one generation path under every API: an internal request → engine requests → choices or stream events.

Chat Completions, Responses, Anthropic Messages and Completions are thin translations of their wire
formats into a ``GenRequest`` (``runtime/gen_request.py``: chat-template messages, tools, tool choice, output
format, sampling) and back from :class:`ChoiceOut` values or :class:`StreamEvent` values. Everything that must
behave the same whichever API a client speaks happens here: rendering the prompt (``chat_format``),
the context-length check, the decoding constraint (``constraints``), the logit bias's vocabulary check,
one :class:`GenerateRequest` per choice, tool-call parsing (``tool_parsers``; in a stream,
``tool_stream`` sends the arguments as they decode), logprobs, prompt logprobs (asked of the engine for
choice 0 only, as the choices share the prompt; a 400 where the engine does not compute them), and
recording each choice as a turn with the recorder's stitching (its sampling parameters, penalties and
logit bias included).

Streams: every choice's engine stream is opened before the first byte is sent (so 429/400 still
arrive as HTTP errors); events of all choices are merged in arrival order; the turns are recorded
before any :class:`ChoiceDone` is yielded (so ``sync`` durability holds for streams too). An engine
failure mid-stream yields :class:`StreamFailed` and records that choice with ``finish_reason: "abort"``.

Not here: HTTP, authentication, adapter routing (``runtime/serving.py``), or any wire format.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from learner.records import PUBLIC_OWNER, ToolCallRecord, Turn, TurnTimings
from runtime.chat_format import ChatFormatter, is_prefill
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
from runtime.gen_request import GenRequest
from runtime.metrics import Metrics
from runtime.recorder import ANONYMOUS, Recorder, TurnSlot, messages_key
from runtime.token_bytes import token_bytes_fn
from runtime.tool_parsers import ParsedToolCall, get_parser
from runtime.tool_stream import ToolCallStreamer

log = logging.getLogger(__name__)


# ---- what comes back -----------------------------------------------------------------------------


@dataclass
class ChoiceOut:
    """One finished choice, in API-neutral terms."""

    index: int
    content: str | None  # the reply text shown to the client (without tool-call markup)
    tool_calls: list[ParsedToolCall]
    finish_reason: str  # "stop" | "length" | "tool_calls"
    text: str = ""  # the whole decoded text (tool-call markup included)
    output_ids: tuple[int, ...] = ()
    completion_tokens: int = 0
    logprobs: list[dict[str, Any]] | None = None  # OpenAI's per-token entries, when asked for
    ids: dict[str, Any] | None = None  # this choice's trajectory and turn ids
    matched_stop: str | int | None = None  # the stop string or token id that ended it


@dataclass(frozen=True)
class TextDelta:
    index: int
    text: str
    logprobs: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    call_index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolArgsDelta:
    index: int
    call_index: int
    delta: str


@dataclass(frozen=True)
class ChoiceDone:
    """A choice finished and is recorded: its finish reason and the whole choice."""

    index: int
    choice: ChoiceOut


@dataclass(frozen=True)
class StreamFailed:
    index: int
    message: str = "generation failed"


StreamEvent = TextDelta | ToolCallStart | ToolArgsDelta | ChoiceDone | StreamFailed


@dataclass
class Prepared:
    """A request made ready for the engine, with the ids its response will carry."""

    id: str
    created: int
    model: str
    prompt_ids: tuple[int, ...]
    engine_reqs: list[GenerateRequest]
    tool_names: set[str] | None  # None: tool calls are not parsed (no tools, or tool_choice none)
    forced_names: set[str] | None  # tool_choice required / named: the whole output is one call, to one of these
    messages: list[dict[str, Any]]  # the request's messages as chat-template dicts
    adapter: str | None  # the adapter version serving every choice (None = the base model)
    slots: list[TurnSlot] | None  # recorded turn ids per choice; None when recording is off
    want_logprobs: bool = False
    logprobs_with_stop: bool = False
    api: str = "chat.completions"
    completion_tokens: int = 0  # filled in as the choices finish
    tag: str | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # prompt tokens 1.. (choice 0's engine request), once it answered
    owner: str = PUBLIC_OWNER  # the API key's identity: the embedded engine shares its batch fairly between owners

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

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

    def choice_ids(self, i: int) -> dict[str, Any] | None:
        if self.slots is None:
            return None
        return {"trajectory_id": self.slots[i].trajectory_id, "turn_id": self.slots[i].turn_id}


# ---- the service -----------------------------------------------------------------------------------


class Generation:
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
        self.tokenizer = formatter.tokenizer
        self._bytes = token_bytes_fn(formatter.tokenizer)

    # ---- preparation -----------------------------------------------------------------------
    def prepare(
        self,
        req: GenRequest,
        request_id: str,
        session_id: str = ANONYMOUS,
        adapter: str | None = None,
        id_prefix: str = "chatcmpl-",
        owner: str = PUBLIC_OWNER,
    ) -> Prepared:
        """Render, check lengths, build the constraint and one engine request per choice, assign turn ids."""
        prompt_ids, messages = self._prompt(req)
        max_new = self._max_new_tokens(req, len(prompt_ids))
        session = None if session_id == ANONYMOUS else session_id  # keeps a conversation on one replica of an external engine
        engine_reqs = [
            GenerateRequest(f"{request_id}-{i}", prompt_ids, sampling, adapter=adapter, session=session, owner=owner)
            for i, sampling in enumerate(self._sampling(req, max_new))
        ]
        self.metrics.prompt_tokens.inc(len(prompt_ids) * req.n)
        return Prepared(
            id=f"{id_prefix}{uuid.uuid4().hex[:24]}",
            created=int(time.time()),
            model=req.model,
            prompt_ids=prompt_ids,
            engine_reqs=engine_reqs,
            tool_names=req.tool_names() if req.tools_on else None,
            forced_names=req.forced_names(),
            messages=messages,
            adapter=adapter,
            slots=self.recorder.assign(session_id, messages, req.n, owner) if self.recorder is not None else None,
            want_logprobs=req.logprobs,
            logprobs_with_stop=req.logprobs_with_stop,
            api=req.api,
            tag=req.tag,
            owner=owner,
        )

    def _prompt(self, req: GenRequest) -> tuple[tuple[int, ...], list[dict[str, Any]]]:
        """The prompt's token ids and the messages a turn records: a raw prompt as one ``prompt`` message, else the rendered chat."""
        if req.prompt_ids is not None:
            return req.prompt_ids, [{"role": "prompt", "content": req.prompt_text or ""}]
        return self.formatter.render_plain(req.messages, req.tools if req.tools_on else None).token_ids, req.messages

    def _max_new_tokens(self, req: GenRequest, prompt_len: int) -> int:
        """The completion's token limit: ``max_tokens``, or the default within the context left; a 400 when the prompt, or the
        prompt with the asked completion, does not fit the model's context."""
        max_len = self.engine.info.max_model_len
        if prompt_len >= max_len:
            raise InvalidRequest(
                f"This model's maximum context length is {max_len} tokens. However, your {req.messages_param} resulted in "
                f"{prompt_len} tokens. Please reduce the length of the {req.messages_param}.",
                param=req.messages_param,
                code="context_length_exceeded",
            )
        asked = req.max_tokens
        if asked is not None and prompt_len + asked > max_len:
            raise InvalidRequest(
                f"This model's maximum context length is {max_len} tokens. However, you requested {prompt_len + asked} "
                f"tokens ({prompt_len} in the {req.messages_param}, {asked} in the completion). Please reduce the length of the "
                f"{req.messages_param} or completion.",
                param=req.max_tokens_param,
                code="context_length_exceeded",
            )
        return asked if asked is not None else min(self.default_max_tokens, max_len - prompt_len)

    def _sampling(self, req: GenRequest, max_new: int) -> list[SamplingParams]:
        """Each choice's sampling parameters (choice i seeded ``seed + i``; prompt logprobs asked for choice 0 only), after the
        checks that make a request invalid here: prompt logprobs the engine cannot compute, the constraint, the logit bias."""
        if req.prompt_logprobs is not None and not self.engine.info.prompt_logprobs:
            raise InvalidRequest(
                f"this server's {self.engine.info.backend} engine does not compute prompt logprobs (asked for by '{req.prompt_logprobs_param}')",
                param=req.prompt_logprobs_param,
            )
        grammar = grammar_for(req, self.formatter.parser_name)
        logit_bias = self._logit_bias(req.logit_bias)
        temperature = 1.0 if req.temperature is None else req.temperature
        return [
            SamplingParams(
                max_new_tokens=max_new,
                temperature=temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=None if req.seed is None else _choice_seed(req.seed, i),
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                logprobs=req.logprobs or self.recorder is not None,  # recorded turns always keep logprobs
                top_logprobs=req.top_logprobs,
                grammar=grammar,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                logit_bias=logit_bias,
                prompt_logprobs=req.prompt_logprobs if i == 0 else None,
            )
            for i in range(req.n)
        ]

    def _logit_bias(self, bias: dict[int, float]) -> tuple[tuple[int, float], ...]:
        """The request's logit bias as the engine takes it, sorted; a token id outside the vocabulary is a 400 on ``logit_bias``."""
        vocab = self.engine.info.vocab_size
        bad = next((t for t in bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"logit_bias names token id {bad}, outside this model's vocabulary (0 to {vocab - 1})", param="logit_bias")
        return tuple(sorted(bias.items()))

    # ---- non-streamed ----------------------------------------------------------------------
    async def complete(self, prep: Prepared) -> list[ChoiceOut]:
        """Generate every choice, parse tool calls, record the turns; the choices in index order."""
        tasks = [asyncio.ensure_future(self.engine.generate(r)) for r in prep.engine_reqs]
        try:
            results: list[GenerateResult] = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:  # one choice failed or the client left: stop the others too
                t.cancel()
            raise
        choices = []
        for i, res in enumerate(results):
            self.metrics.ttft.observe(res.timings.ttft_s)
            content, calls = self._parse(prep, res)
            finish = _finish(res.finish_reason, bool(calls))
            choices.append(self._choice(prep, i, res, content, calls, finish))
        await self._record(prep, [(c, r) for c, r in zip(choices, results, strict=True)])
        self._take_prompt_logprobs(prep, results[0].prompt_logprobs)
        return choices

    def _parse(self, prep: Prepared, res: GenerateResult) -> tuple[str | None, list[ParsedToolCall]]:
        """A finished choice's content and tool calls; a forced call cut by the token limit is still a call."""
        if prep.tool_names is None:
            return res.text, []
        if prep.forced_names is not None and res.finish_reason == "length":
            cut = self.parser.parse_cut(res.text, prep.forced_names)
            return cut.content, cut.tool_calls
        parsed = self.parser.parse(res.text, prep.tool_names)
        return (parsed.content, parsed.tool_calls) if parsed.tool_calls else (res.text, [])

    def _choice(self, prep: Prepared, i: int, res: GenerateResult, content: str | None, calls: list[ParsedToolCall], finish: str) -> ChoiceOut:
        prep.completion_tokens += len(res.output_ids)
        return ChoiceOut(
            index=i,
            content=content,
            tool_calls=calls,
            finish_reason=finish,
            text=res.text,
            output_ids=res.output_ids,
            completion_tokens=len(res.output_ids),
            logprobs=self.token_logprobs(res.logprobs, None if prep.logprobs_with_stop else res.matched_stop) if prep.want_logprobs else None,
            ids=prep.choice_ids(i),
            matched_stop=res.matched_stop,
        )

    def settle(self, prep: Prepared) -> None:
        """``prep``'s request has ended (answered, failed or abandoned): its turn ids not recorded by now never will be."""
        if self.recorder is not None and prep.slots is not None:
            self.recorder.settle(s.turn_id for s in prep.slots)

    async def _record(self, prep: Prepared, done: list[tuple[ChoiceOut, GenerateResult]]) -> None:
        if self.recorder is not None and done:
            await self.recorder.record([self._turn(prep, c, res) for c, res in done])

    def _turn(self, prep: Prepared, choice: ChoiceOut, res: GenerateResult) -> Turn:
        """The record of one choice: exact prompt ids, output ids and logprobs as the engine gave them."""
        assert prep.slots is not None
        i = choice.index
        slot = prep.slots[i]
        sp = prep.engine_reqs[i].sampling
        reply: dict[str, Any] = {"role": "assistant", "content": choice.content or ""}
        if choice.tool_calls:
            reply["tool_calls"] = [_call_dict(c) for c in choice.tool_calls]
        prior = prep.messages
        if is_prefill(prior) and isinstance(prior[-1].get("content"), str):  # the client sends prefill + continuation back as one message
            reply["content"] = prior[-1]["content"] + reply["content"]
            prior = prior[:-1]
        return Turn(
            turn_id=slot.turn_id,
            trajectory_id=slot.trajectory_id,
            session_id=slot.session_id,
            index=slot.index,
            parent_turn_id=slot.parent_turn_id,
            completion_id=prep.id,
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
                # kind and spec: the learner re-applies the mask, so its logprobs are of the distribution that was sampled
                "grammar": {"kind": sp.grammar.kind, "spec": sp.grammar.spec} if sp.grammar else None,
                # the logprobs are of the penalized, biased distribution (runtime/engine.py): the learner leaves such turns out
                "presence_penalty": sp.presence_penalty,
                "frequency_penalty": sp.frequency_penalty,
                "logit_bias": {str(t): b for t, b in sp.logit_bias} or None,
                "api": prep.api,
                "model": prep.model,  # the name the client asked for (base, alias, family@N); learners' traffic filters read it
                "tag": prep.tag,
            },
            tool_calls=[ToolCallRecord(id=c.id, name=c.name, arguments=c.arguments) for c in choice.tool_calls],
            finish_reason=choice.finish_reason if res.finish_reason != "abort" else "abort",
            timings=TurnTimings(queued_s=res.timings.queued_s, ttft_s=res.timings.ttft_s, total_s=res.timings.total_s),
            messages=prep.messages,
            output_text=res.text,
            prefix_key=messages_key(prep.messages),
            continuation_key=messages_key([*prior, reply]),
            owner=slot.owner,
        )

    # ---- streamed --------------------------------------------------------------------------
    async def open_streams(self, prep: Prepared) -> list[tuple[AsyncIterator[StreamChunk], StreamChunk]]:
        """Start every choice's stream and wait for its first chunk, so that 429/400 happen before any byte is sent."""
        opened: list[tuple[AsyncIterator[StreamChunk], StreamChunk]] = []
        try:
            for r in prep.engine_reqs:
                it = aiter(self.engine.stream(r))
                first = await anext(it)
                opened.append((it, first))
            self._take_prompt_logprobs(prep, opened[0][1].prompt_logprobs)
        except BaseException:
            for it, _ in opened:
                await it.aclose()  # type: ignore[attr-defined]
            raise
        return opened

    async def events(self, prep: Prepared, opened: list[tuple[AsyncIterator[StreamChunk], StreamChunk]]) -> AsyncIterator[StreamEvent]:
        """The merged events of every choice; the turns are recorded before the first :class:`ChoiceDone`."""
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
        try:
            live = len(tasks)
            while live:
                index, item = await queue.get()
                if item is None:
                    live -= 1
                    continue
                if isinstance(item, BaseException):
                    log.error("stream failed: %s", item)
                    states[index].abort()  # recorded below as an aborted turn, with the tokens it got
                    yield StreamFailed(index)
                    continue
                for event in states[index].feed(item):
                    yield event
            done = [st for st in states if st.result is not None and st.choice is not None]
            if len(done) == len(states):
                await self._record(prep, [(st.choice, st.result) for st in done])  # type: ignore[misc]
            for st in states:
                if st.choice is not None and not st.aborted:
                    yield ChoiceDone(st.index, st.choice)
        finally:
            for t in tasks:
                t.cancel()
            for it, _ in opened:
                # a stream still inside its pump's anext() cannot be closed from here ("already running");
                # cancelling that pump closes it (and so cancels its generation)
                with contextlib.suppress(RuntimeError):
                    await it.aclose()  # type: ignore[attr-defined]

    # ---- shared ----------------------------------------------------------------------------
    def _take_prompt_logprobs(self, prep: Prepared, scores: tuple[TokenLogprob, ...] | None) -> None:
        """Keep choice 0's prompt logprobs on ``prep`` when they were asked for; an engine that did not send them is at fault."""
        if prep.engine_reqs[0].sampling.prompt_logprobs is None:
            return
        if scores is None:
            raise EngineError(f"the {self.engine.info.backend} engine answered without the prompt logprobs it was asked for")
        prep.prompt_logprobs = scores

    def token_logprobs(self, lps: tuple[TokenLogprob, ...], matched_stop: str | int | None) -> list[dict[str, Any]]:
        """OpenAI's per-token logprob entries (``token``, ``logprob``, ``bytes``, ``top_logprobs``); a final stop token is left out."""
        out = []
        tok = self.tokenizer
        for lp in lps:
            if isinstance(matched_stop, int) and lp.token_id == matched_stop and lp is lps[-1]:
                continue  # the stop token is not part of the content
            top = [{"token": tok.decode([tid]), "logprob": v, "bytes": list(self._bytes(tid))} for tid, v in lp.top]
            out.append({"token": tok.decode([lp.token_id]), "logprob": lp.logprob, "bytes": list(self._bytes(lp.token_id)), "top_logprobs": top})
        return out


class _ChoiceStream:
    """Per-choice streaming state: the text so far, what was shown, the tool-call streamer."""

    def __init__(self, index: int, prep: Prepared, svc: Generation) -> None:
        self.index = index
        self.prep = prep
        self.svc = svc
        self.text = ""  # all text generated so far
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.result: GenerateResult | None = None  # set at the end, for recording
        self.choice: ChoiceOut | None = None
        self.aborted = False
        self.tools = ToolCallStreamer(svc.parser, prep.tool_names, prep.forced_names) if prep.tool_names is not None else None

    def feed(self, chunk: StreamChunk) -> list[StreamEvent]:
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.text += chunk.text
        stop = None if self.prep.logprobs_with_stop else chunk.matched_stop
        lps = self.svc.token_logprobs(chunk.logprobs, stop) if self.prep.want_logprobs else None
        out: list[StreamEvent] = []
        if self.tools is None:
            if chunk.text or lps:
                out.append(TextDelta(self.index, chunk.text, lps))
        else:
            pieces = self.tools.feed(chunk.text)
            if chunk.finish_reason is not None:
                pieces += self.tools.finish(cut=chunk.finish_reason == "length")
            out += self._events(pieces, lps)
        if chunk.finish_reason is None:
            return out
        req = self.prep.engine_reqs[self.index]
        self.result = GenerateResult(
            request_id=req.request_id,
            prompt_ids=req.input_ids,
            output_ids=tuple(self.token_ids),
            text=self.text,
            finish_reason=chunk.finish_reason,
            logprobs=tuple(self.logprobs),
            matched_stop=chunk.matched_stop,
            timings=chunk.timings or Timings(),
        )
        if self.tools is not None:
            content, calls = self.tools.content(), self.tools.calls()
        else:
            content, calls = self.text, []
        self.choice = self.svc._choice(self.prep, self.index, self.result, content, calls, _finish(chunk.finish_reason, bool(calls)))
        self.choice.logprobs = None  # already streamed
        return out

    def _events(self, pieces: list[tuple[Any, ...]], lps: list[dict[str, Any]] | None) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        for piece in pieces:
            if piece[0] == "text":
                out.append(TextDelta(self.index, piece[1], lps))
                lps = None
            elif piece[0] == "start":
                out.append(ToolCallStart(self.index, piece[1], piece[2], piece[3]))
            else:
                out.append(ToolArgsDelta(self.index, piece[1], piece[2]))
        if lps:
            out.append(TextDelta(self.index, "", lps))
        return out

    def abort(self) -> None:
        """The engine failed mid-stream: what was generated so far becomes an aborted result (for the record)."""
        if self.result is not None:
            return
        req = self.prep.engine_reqs[self.index]
        self.aborted = True
        self.result = GenerateResult(
            request_id=req.request_id,
            prompt_ids=req.input_ids,
            output_ids=tuple(self.token_ids),
            text=self.text,
            finish_reason="abort",
            logprobs=tuple(self.logprobs),
        )
        self.choice = self.svc._choice(self.prep, self.index, self.result, self.text, [], "stop")


def _finish(reason: str, has_calls: bool) -> str:
    if reason == "abort":
        return "stop"
    return "tool_calls" if has_calls and reason == "stop" else reason


def _call_dict(c: ParsedToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _choice_seed(seed: int, i: int) -> int:
    """Choice ``i``'s seed: ``seed + i``, wrapped into int64 (a request's seed may be 2**63 - 1; the engines take int64)."""
    return (seed + i + 2**63) % 2**64 - 2**63
