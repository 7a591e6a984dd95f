"""Decoding constraints for ``response_format`` and forced tool calls, as engine :class:`Grammar` values.

``tool_choice`` ``required`` or a named function is enforced by a grammar that admits exactly one tool
call in the format the tool-call parser reads back, also when the token limit cuts it (the parser's
:class:`~runtime.tool_parsers.CallFormat`: Hermes ``<tool_call>`` JSON for ``qwen25``, bare JSON with
``parameters`` for ``llama3``), whose ``arguments`` match the tool's JSON schema. The grammar is
built with xgrammar and handed to the engine as EBNF text, which the SGLang backend can forward as-is.
JSON is generated compactly (no free whitespace), so a sampling model cannot pad it forever. xgrammar is imported
by the first request that needs a grammar, not at start-up.

``tool_choice: auto`` together with an output format (``response_format`` / ``text.format``) admits
either one tool call or an answer in the format (the union of both grammars), which is what agent
frameworks with tools and a structured result ask for.

Not here: ``tool_choice: auto`` alone (the model decides; the parser extracts calls afterwards) and
parallel forced calls (a forced choice yields exactly one call).
"""

from __future__ import annotations

import json
from typing import Any

from runtime.engine import Grammar, InvalidRequest
from runtime.gen_request import GenRequest
from runtime.tool_parsers import PARSERS


def grammar_for(req: GenRequest, parser_name: str) -> Grammar | None:
    """The constraint an internal request asks for, or None when decoding is free."""
    if req.forced_tool:
        tools = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}} for t in req.tools}
        name = getattr(req.tool_choice, "name", None)
        if name is not None:
            tools = {name: tools[name]}
        return Grammar("ebnf", tool_call_ebnf(tools, parser_name))
    fmt = req.output_format
    if fmt is None:
        return None
    if req.tools_on:  # tool_choice auto with a structured answer: either one tool call, or the answer in the format
        import xgrammar as xgr

        tools = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}} for t in req.tools}
        calls = xgr.Grammar.from_ebnf(tool_call_ebnf(tools, parser_name))
        return Grammar("ebnf", str(xgr.Grammar.union(calls, _format_grammar(fmt.kind, fmt.schema))))
    if fmt.kind == "json_object":
        return Grammar("json_object")
    return Grammar("json_schema", json.dumps(fmt.schema or {}))


# xgrammar 0.2.9 writes a length-bounded string (maxLength / minLength) as repeats of this class, which admits raw
# control characters (a tab, \x01, ...) that JSON forbids inside strings: a strict parser (the tool-call parser, the
# client's json.loads) then refuses the call. Its unbounded strings exclude them; the bounded class is made the same.
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def json_schema_grammar(schema: dict[str, Any]) -> Any:
    """xgrammar's compact grammar of a JSON schema, with bounded strings that admit only characters JSON allows raw."""
    import xgrammar as xgr

    g = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    text = str(g)
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)) if _BOUNDED_STRING_CHAR in text else g


def _format_grammar(kind: str, schema: dict[str, Any] | None) -> Any:
    if kind == "json_object":
        import xgrammar as xgr

        return xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
    try:
        return json_schema_grammar(schema or {})
    except (RuntimeError, ValueError) as exc:
        raise InvalidRequest(f"cannot build a grammar for the output schema: {exc}", param="response_format") from exc


def tool_call_ebnf(tools: dict[str, dict[str, Any]], parser_name: str) -> str:
    """EBNF admitting exactly one call to one of ``tools`` (name → parameters schema)."""
    parser = PARSERS.get(parser_name)
    call = parser.forced if parser is not None else None  # the text the parser reads back, cut calls included
    if call is None:
        raise InvalidRequest(
            f"tool_choice 'required' or a named function is not supported with the {parser_name!r} tool-call parser",
            param="tool_choice",
        )
    import xgrammar as xgr

    alternatives = []
    for name, params in tools.items():
        # `{"name": <name>, "<args_key>": <arguments>}` with the arguments grammar built from the tool's own
        # schema, so its local `$ref`s (`#/$defs/...`) resolve against that schema's root
        head, tail = call.head(name), call.tail()
        try:
            arguments = json_schema_grammar(params)
        except (RuntimeError, ValueError) as exc:
            raise InvalidRequest(f"cannot build a grammar for the parameters of tool {name!r}: {exc}", param="tools") from exc
        alternatives.append(
            xgr.Grammar.concat(
                xgr.Grammar.from_ebnf(f"root ::= {json.dumps(head)}"),
                arguments,
                xgr.Grammar.from_ebnf(f"root ::= {json.dumps(tail)}"),
            )
        )
    grammar = xgr.Grammar.union(*alternatives) if len(alternatives) > 1 else alternatives[0]
    return str(grammar)
