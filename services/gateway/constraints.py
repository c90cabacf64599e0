"""The grammar a chat reply must follow, built from the request's ``tools``, ``tool_choice`` and
``response_format`` and from the prompt as rendered (``GrammarSpec``, which the worker compiles
with xgrammar against the model's vocabulary).

A model family writes tool calls in its own format: the xgrammar "model style" names it
(``dhisparse.tokenizer.reply.reply_style``: DeepSeek-V3.2's DSML, GLM-4.7/GLM-5's
``<tool_call>`` XML). The reasoning
mode follows the prompt: a prompt that ends in an open ``<think>`` (both families' generation
prompt in thinking mode) makes the reply continue its reasoning up to ``</think>`` before the
constrained part; a prompt that closes the block (``</think>``, thinking off) or has none
leaves no reasoning to the reply.

Each spec is compiled here once, without a tokenizer, so that a schema xgrammar cannot compile
is the client's 400 (param ``response_format`` or ``tools``) rather than a worker failure.
xgrammar (which imports torch) is imported inside the functions, never with the gateway.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from dhisparse.tokenizer.reply import GRAMMAR_MAX_WHITESPACE
from services.gateway.errors import APIError, bad_request
from services.gateway.generation import GrammarSpec
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.protocol_tools import JsonObjectFormat, JsonSchemaFormat, NamedToolChoice

Style = str  # a reply style (``reply_style``), which is also xgrammar's model style
ReasoningMode = Literal["enabled", "disabled"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def reasoning_open(prompt_text: str, style: Style | None) -> bool:
    """Whether the reply starts inside a reasoning block the prompt opened (and so its text
    up to ``</think>`` is reasoning). Both families open the block with ``<think>`` as the
    last thing of a thinking-mode generation prompt and close it at once (``</think>``) with
    thinking off; a model without a tool format is read as having no reasoning format."""
    return style is not None and prompt_text.endswith(THINK_OPEN)


def grammar_for(
    req: ChatCompletionRequest, prompt_text: str, style: Style | None
) -> GrammarSpec | None:
    """The reply's grammar, or None when it is free text.

    - ``tools`` under ``tool_choice`` "auto": free text in which a started call follows the
      format and a tool's parameters; "required": one call or more; a named function: that
      call alone. ``parallel_tool_calls: false`` allows one call. "none" (or no tools): the
      tools constrain nothing.
    - ``response_format`` json_object / json_schema (without tools in play): that JSON; after
      the reasoning when the prompt leaves it open (a structural tag of two parts).
    - Tools given to a model without a tool-call format (``style`` None), a JSON format beside
      tools under "auto", or a spec xgrammar cannot compile: a 400.
    """
    choice = req.effective_tool_choice()
    reasoning: ReasoningMode = "enabled" if reasoning_open(prompt_text, style) else "disabled"
    if req.tools and choice != "none":
        if style is None:
            raise bad_request("this model has no tool-call format", "tools")
        if choice == "auto" and _json_format(req) is not None:
            raise bad_request(
                'a JSON response_format beside tools is supported only with tool_choice "none", '
                '"required" or a named function',
                "response_format",
            )
        return _tools_grammar(req, style, reasoning)
    schema = _json_format(req)
    if schema is None:
        return None
    if reasoning == "enabled":
        return _reasoning_then_json(schema)
    if schema is _ANY_OBJECT:
        return GrammarSpec("json_object")
    return _compiled_json_schema(schema)


def _json_format(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema the response format asks for; None for text."""
    fmt = req.response_format
    if isinstance(fmt, JsonObjectFormat):
        return _ANY_OBJECT
    if isinstance(fmt, JsonSchemaFormat):
        return fmt.json_schema.json_schema or _ANY_OBJECT
    return None


def _tools_grammar(
    req: ChatCompletionRequest, style: Style, reasoning: ReasoningMode
) -> GrammarSpec:
    import xgrammar

    choice = req.effective_tool_choice()
    tool_choice: Any = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
    try:
        tag = xgrammar.get_model_structural_tag(
            style,
            [t.as_template_tool() for t in req.tools or ()],
            tool_choice,
            reasoning=reasoning,
            parallel_tool_calls=req.parallel_tool_calls,
            max_whitespace_cnt=GRAMMAR_MAX_WHITESPACE,
        )
        spec = tag.model_dump_json()
        xgrammar.Grammar.from_structural_tag(spec)
    except Exception as e:  # any failure is the tools' (a schema xgrammar cannot compile)
        raise _refused("tools", e) from e
    return GrammarSpec("structural_tag", spec)


def _compiled_json_schema(schema: dict[str, Any]) -> GrammarSpec:
    import xgrammar

    spec = json.dumps(schema)
    try:
        xgrammar.Grammar.from_json_schema(spec)
    except Exception as e:  # any failure is the schema's
        raise _refused("response_format", e) from e
    return GrammarSpec("json_schema", spec)


def _reasoning_then_json(schema: dict[str, Any]) -> GrammarSpec:
    """The rest of the open reasoning block (any text but the think tags, then
    ``</think>``), then the JSON."""
    import xgrammar
    from xgrammar import structural_tag as st

    tag = st.StructuralTag(
        format=st.SequenceFormat(
            elements=[
                st.TagFormat(
                    begin="",
                    content=st.AnyTextFormat(excludes=[THINK_OPEN, THINK_CLOSE]),
                    end=THINK_CLOSE,
                ),
                st.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=GRAMMAR_MAX_WHITESPACE),
            ]
        )
    )
    spec = tag.model_dump_json()
    try:
        xgrammar.Grammar.from_structural_tag(spec)
    except Exception as e:  # any failure is the schema's
        raise _refused("response_format", e) from e
    return GrammarSpec("structural_tag", spec)


def _refused(param: str, e: Exception) -> APIError:
    return bad_request(f"{param} cannot be enforced: {type(e).__name__}: {e}", param)
