"""Re-apply a recorded decoding constraint to a turn's output tokens, so trained and behaviour logprobs are one distribution.

    masks = GrammarMasks(base_model_dir, vocab_size=49152, eos_token_ids=(2,))
    bits = masks.bitmask({"kind": "json_schema", "spec": "{...}"}, output_ids)   # (T, ceil(V/32)) int32
    allowed = unpack_bitmask(bits, vocab_size)                                    # (T, V) bool

Why. The engine samples a constrained turn (``response_format``, a forced tool call, the SVR / SVR-R1
formats, MemoPilot's JSON rewrite) from the grammar-masked distribution and records the logprobs of
``log_softmax(masked logits / T)`` (``runtime/engine.py``'s convention; xgrammar's mask sets the
disallowed logits to -inf). A trainer that scores the same tokens without the mask computes
``log_softmax(logits / T)``, which is lower by the log of the allowed tokens' mass at every position.
The PPO ratio ``pi_theta / pi_behaviour`` is then below 1 on an unchanged policy, so the clip removes the
negative-advantage tokens first and only wins update the policy. The trainer therefore replays the
recorded constraint with xgrammar over the recorded output ids and masks its logits the same way: the
policy it trains is the policy that was sampled (the grammar is part of it), and the ratio is exactly 1
before any step.

The constraint comes from the turn's ``sampling["grammar"]`` = ``{"kind", "spec"}`` (what the runtime and
the agent loop record). :func:`compile_grammar` is the same rule as ``runtime/engines/embedded.py``'s
``_compile`` (a test holds them together: the learner may not import the runtime). The tokenizer info is
built as the embedded engine builds it (the model's ``vocab_size``, its generation config's eos ids).

Not here: which turns are constrained (``learner.samples``), the forward pass (``learner.trainer``).
Engines whose recorded logprobs are of the unmasked distribution are not handled (the embedded engine's
are masked; see ``runtime/engines/sglang.py`` for SGLang's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["GrammarMasks", "GrammarReplayError", "compile_grammar", "unpack_bitmask"]

KINDS = ("json_object", "json_schema", "ebnf")


class GrammarReplayError(ValueError):
    """The recorded output does not follow its recorded grammar (or the grammar is unreadable): the turn cannot be scored exactly."""


def compile_grammar(compiler: Any, kind: str, spec: str) -> Any:
    """Compile a recorded constraint exactly as the embedded engine does (``runtime/engines/embedded.py: _compile``)."""
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "json_schema":
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "ebnf":
        return compiler.compile_grammar(spec)
    raise GrammarReplayError(f"unknown grammar kind {kind!r}; known: {', '.join(KINDS)}")


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed int32 bitmask (N, ceil(V/32)) → a bool mask (N, V), True = allowed (bit j of word w is token 32w + j)."""
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bits.to(torch.int32)[..., None] >> shifts) & 1).bool()  # (N, W, 32)
    return allowed.reshape(bits.shape[0], -1)[:, :vocab_size]


CACHE_BYTES = 256 << 20  # the compiled-grammar cache's bound (the runtime's --grammar-cache-mb default)


class GrammarMasks:
    """Compiles recorded grammars (cached by xgrammar) and replays them over output ids; one per trainer."""

    def __init__(self, base_model_dir: Path, *, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr  # here, not at import: a learner whose turns carry no grammar never loads it
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self.vocab_size = vocab_size
        # bounded, as the runtime's: every client grammar recorded with a rewarded turn is compiled here, and
        # xgrammar keeps each compiled one (three 1000-branch anyOf schemas held about 1 GB unbounded)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_BYTES)

    def bitmask(self, grammar: Mapping[str, Any], output_ids: Sequence[int]) -> torch.Tensor:
        """The packed mask before each output token, shape (len(output_ids), ceil(V/32)) int32.

        Raises :class:`GrammarReplayError` when a token is not allowed where it was sampled (the recording
        does not match this model's tokenizer or the grammar), so the caller can leave the turn out."""
        kind, spec = str(grammar.get("kind")), str(grammar.get("spec") or "")
        try:
            compiled = compile_grammar(self._compiler, kind, spec)
        except (RuntimeError, ValueError) as exc:
            raise GrammarReplayError(f"cannot compile the recorded {kind} grammar: {exc}") from exc
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        bits = xgr.allocate_token_bitmask(len(output_ids), self.vocab_size)  # (T, W), all allowed
        for j, tok in enumerate(output_ids):
            if matcher.is_terminated():
                raise GrammarReplayError(f"the grammar ended before output token {j} of {len(output_ids)}")
            matcher.fill_next_token_bitmask(bits, j)
            if not matcher.accept_token(int(tok)):
                raise GrammarReplayError(f"output token {j} (id {tok}) is not allowed by the recorded grammar there")
        return bits
