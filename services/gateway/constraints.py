"""The grammar a chat reply must follow, from the request's ``tools``, ``tool_choice`` and
``response_format`` and from the prompt as rendered (``GrammarSpec``). The worker builds the
family's tags from it and compiles it with xgrammar against the model's vocabulary
(``services/worker/request/grammar_specs.py``), so the gateway imports neither xgrammar nor
torch; a spec the worker cannot compile comes back as the client's 400.

A model family writes tool calls in its own format (``dhisparse.tokenizer.reply.reply_style``:
DeepSeek-V3.2's, DeepSeek-V4's and DeepSeek-V4.1's DSML, GLM-4.7/GLM-5's ``<tool_call>`` XML, also xgrammar's
names of them). The reasoning follows the prompt: a prompt that ends in an open ``<think>``
(every family's generation prompt in thinking mode) makes the reply end its reasoning (``</think>``) before the
constrained part; a prompt that closes the block (``</think>``, thinking off) or has none
leaves no reasoning to the reply.
"""

from __future__ import annotations

import json
from typing import Any

from dhisparse.tokenizer.reasoning import THINK_OPEN
from services.gateway.errors import bad_request
from services.gateway.generation import GrammarSpec
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.protocol_tools import JsonObjectFormat, JsonSchemaFormat, NamedToolChoice

Style = str  # a reply style (``reply_style``), which is also xgrammar's model style

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def reasoning_open(prompt_text: str, style: Style | None) -> bool:
    """Whether the reply starts inside a reasoning block the prompt opened (and so its text
    up to ``</think>`` is reasoning). Every family opens the block with ``<think>`` as the
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
    - ``response_format`` json_object / json_schema (without tools in play): that JSON, after
      the reasoning when the prompt leaves it open.
    - Tools given to a model without a tool-call format (``style`` None), or a JSON format
      beside tools under "auto": a 400.
    """
    choice = req.effective_tool_choice()
    thinking = reasoning_open(prompt_text, style)
    if req.tools and choice != "none":
        if style is None:
            raise bad_request("this model has no tool-call format", "tools")
        if choice == "auto" and _json_format(req) is not None:
            raise bad_request(
                'a JSON response_format beside tools is supported only with tool_choice "none", '
                '"required" or a named function',
                "response_format",
            )
        calls = {
            "style": style,
            "tools": req.template_tools(),
            "tool_choice": choice.model_dump() if isinstance(choice, NamedToolChoice) else choice,
            "parallel_tool_calls": req.parallel_tool_calls,
        }
        return GrammarSpec("tool_calls", json.dumps(calls), thinking)
    schema = _json_format(req)
    if schema is None:
        return None
    if schema is _ANY_OBJECT:
        return GrammarSpec("json_object", "", thinking)
    return GrammarSpec("json_schema", json.dumps(schema), thinking)


def _json_format(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema the response format asks for; None for text."""
    fmt = req.response_format
    if isinstance(fmt, JsonObjectFormat):
        return _ANY_OBJECT
    if isinstance(fmt, JsonSchemaFormat):
        return fmt.json_schema.json_schema or _ANY_OBJECT
    return None
