"""The logprob objects of ``POST /v1/completions``: OpenAI's legacy ``logprobs`` (an echoed prompt's included) and vLLM's ``prompt_logprobs``.

OpenAI's legacy format (its Completions API reference; vLLM's server writes the same) is four parallel
lists over the returned tokens: ``tokens`` (each token's text), ``token_logprobs``, ``top_logprobs``
(per token a dict of the top ``logprobs`` alternatives' text → logprob) and ``text_offset`` (each
token's character offset: the lengths of the token texts before it, summed). With ``echo`` the
prompt's tokens come first; the first prompt token has no logprob and no alternatives (``null`` in
both lists), as in OpenAI's and vLLM's answers. Evaluation harnesses (lm-evaluation-harness's
loglikelihood) read exactly this: ``echo``, ``logprobs``, ``max_tokens`` 0 or 1.

vLLM's ``prompt_logprobs`` (a field of each choice, when the request sends ``prompt_logprobs: k``) is one
entry per prompt token: ``null`` for the first, else ``{"<token id>": {"logprob", "rank",
"decoded_token"}}`` holding the prompt token (first) and the top k alternatives.

Logprobs below -9999 (a masked token's -inf) are written as -9999.0, as vLLM does: JSON has no infinity.

Not here: computing the values (the engines; ``runtime/engine.py`` says which distribution), the request's
fields and limits (``runtime/api/completions.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from runtime.engine import TokenLogprob

FLOOR = -9999.0  # vLLM's JSON stand-in for -inf

TokenText = Callable[[int], str]


def token_texts(tokenizer: Any) -> TokenText:
    """Each token id's text (``tokenizer.decode([id])``, as generated tokens' entries have it), decoded once per id."""
    cache: dict[int, str] = {}

    def text(tid: int) -> str:
        s = cache.get(tid)
        if s is None:
            s = cache[tid] = tokenizer.decode([tid])
        return s

    return text


def _num(value: float) -> float:
    return max(value, FLOOR)


def prompt_entries(prompt_ids: Sequence[int], scores: Sequence[TokenLogprob], k: int, text: TokenText) -> list[dict[str, Any]]:
    """The prompt's tokens as per-token entries (the shape ``Generation.token_logprobs`` gives generated ones): the first
    with ``logprob`` and ``top_logprobs`` None, the others with their logprob and top ``k`` alternatives."""
    if len(scores) != len(prompt_ids) - 1:
        raise ValueError(f"{len(prompt_ids)} prompt tokens but {len(scores)} prompt logprobs")
    out: list[dict[str, Any]] = [{"token": text(prompt_ids[0]), "logprob": None, "top_logprobs": None}]
    for s in scores:
        out.append({"token": text(s.token_id), "logprob": s.logprob, "top_logprobs": [{"token": text(t), "logprob": v} for t, v in s.top[:k]]})
    return out


def legacy_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """Per-token entries → the legacy ``logprobs`` object (parallel lists, ``text_offset`` in characters from ``offset``)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [None if e["logprob"] is None else _num(e["logprob"]) for e in entries],
        "top_logprobs": [None if e["top_logprobs"] is None else {t["token"]: _num(t["logprob"]) for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def text_end(logprobs: dict[str, Any], offset: int = 0) -> int:
    """The ``text_offset`` after the last token of a legacy ``logprobs`` object that started at ``offset``."""
    return offset + sum(len(t) for t in logprobs["tokens"])


def vllm_prompt_logprobs(scores: Sequence[TokenLogprob], k: int, text: TokenText) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` list: ``None`` for the first prompt token, then the token and its top ``k`` alternatives."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for s in scores:
        top = s.top[:k]
        rank = s.rank if s.rank is not None else next((r for r, (t, _) in enumerate(top, 1) if t == s.token_id), None)
        entry = {str(s.token_id): {"logprob": _num(s.logprob), "rank": rank, "decoded_token": text(s.token_id)}}
        for r, (t, v) in enumerate(top, 1):
            entry.setdefault(str(t), {"logprob": _num(v), "rank": r, "decoded_token": text(t)})
        out.append(entry)
    return out
