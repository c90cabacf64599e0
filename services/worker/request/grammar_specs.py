"""A request's grammar (``Grammar``) as the xgrammar structural tag or JSON schema the worker
compiles: the gateway sends what the reply must follow (a JSON schema, the tools of a tool call,
whether the prompt left a reasoning block open), and the tags of the family's format are built
here, beside the tokenizer, so the gateway never imports xgrammar (nor torch with it).

- ``json_object`` / ``json_schema``: that JSON; after the rest of the reasoning block and its
  ``</think>`` when the prompt left one open.
- ``tool_calls``: spec ``{"style", "tools", "tool_choice", "parallel_tool_calls"}`` — xgrammar's
  built-in format of the family (``style``: ``deepseek_v3_2``, ``deepseek_v4`` and
  ``deepseek_v4_1`` DSML,
  ``glm_4_7`` GLM-4.7/GLM-5)
  under ``tool_choice`` "auto" (free text, a started call constrained), "required" (one call or
  more) or a named function (that call alone).
- ``structural_tag``: an xgrammar structural tag as given.

Formatting whitespace is bounded (``GRAMMAR_MAX_WHITESPACE``)."""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr
from xgrammar import structural_tag as st

from dhisparse.tokenizer.reasoning import THINK_CLOSE, THINK_OPEN
from dhisparse.tokenizer.reply import GRAMMAR_MAX_WHITESPACE, STYLES
from services.worker.request.request import Grammar

KINDS = ("json_object", "json_schema", "tool_calls", "structural_tag")
_ANY_OBJECT = '{"type": "object"}'


def _json(kind: str, spec: str) -> Any:
    try:
        return json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"{kind} spec is not valid JSON: {e}") from None


def _reasoning_then(content: st.Format) -> str:
    """The rest of an open reasoning block (any text but the think tags, then ``</think>``),
    then ``content``: a structural tag as JSON text."""
    reasoning = st.TagFormat(
        begin="", content=st.AnyTextFormat(excludes=[THINK_OPEN, THINK_CLOSE]), end=THINK_CLOSE
    )
    return st.StructuralTag(
        format=st.SequenceFormat(elements=[reasoning, content])
    ).model_dump_json()


def _tool_calls(spec: str, reasoning_open: bool) -> str:
    fields = _json("tool_calls", spec)
    if not isinstance(fields, dict) or fields.get("style") not in STYLES:
        raise ValueError(f"tool_calls spec needs a style among {list(STYLES)}")
    try:
        tag = xgr.get_model_structural_tag(
            fields["style"],
            fields.get("tools") or [],
            fields.get("tool_choice", "auto"),
            reasoning="enabled" if reasoning_open else "disabled",
            parallel_tool_calls=bool(fields.get("parallel_tool_calls", True)),
            max_whitespace_cnt=GRAMMAR_MAX_WHITESPACE,
        )
    except (ValueError, TypeError, KeyError, AssertionError) as e:
        raise ValueError(f"invalid tools: {e}") from None
    return tag.model_dump_json()


def grammar_of(grammar: Grammar) -> xgr.Grammar:
    """``grammar`` as an xgrammar grammar (free of any tokenizer); ValueError (the client's)
    when it is none of ``KINDS`` or its spec is not valid JSON. xgrammar's own failures
    (RuntimeError: a schema or tag it cannot read) pass."""
    kind, spec = grammar.kind, grammar.spec
    if kind not in KINDS:
        raise ValueError(f"grammar kind must be one of {list(KINDS)}, got {kind!r}")
    if kind == "tool_calls":
        return xgr.Grammar.from_structural_tag(_tool_calls(spec, grammar.reasoning_open))
    if kind == "structural_tag":
        _json(kind, spec)
        return xgr.Grammar.from_structural_tag(spec)
    schema = _ANY_OBJECT if kind == "json_object" else spec
    parsed = _json(kind, schema)
    if grammar.reasoning_open:
        fmt = st.JSONSchemaFormat(json_schema=parsed, max_whitespace_cnt=GRAMMAR_MAX_WHITESPACE)
        return xgr.Grammar.from_structural_tag(_reasoning_then(fmt))
    return xgr.Grammar.from_json_schema(
        schema, strict_mode=kind == "json_schema", max_whitespace_cnt=GRAMMAR_MAX_WHITESPACE
    )
