"""DeepSeek-V3.2's chat format. The checkpoint ships no Jinja template; DeepSeek's Python
encoder (``encoding/encoding_dsv32.py`` of the release, copied into transformers under
``models/deepseek_v32/deepseek_files/``) defines it, and this module produces the same text
(tests/tokenizer/dsv32_golden.json holds the encoder's outputs).

A user turn opens the assistant's: ``<｜User｜>{content}<｜Assistant｜>``, then ``<think>`` when
the model is to reason (thinking mode, after the last user turn) or ``</think>`` when it is not.
An assistant turn is ``{reasoning</think>}{content}{tool calls}<｜end▁of▁sentence｜>``, its
reasoning shown only after the last user turn. Tool calls are DSML blocks; tool results follow
as ``<function_results>``. Tools are listed in the system (or developer) message that carries
them (``tools``, OpenAI's format), a required reply schema likewise (``response_format``).

Messages are OpenAI-style mappings: ``role`` (system, developer, user, assistant, tool),
``content`` (a string; None renders as empty), and on assistant turns ``reasoning_content`` and
``tool_calls`` (``[{"type": "function", "function": {"name", "arguments"}}]``, ``arguments`` a
JSON object or its text). A chat the format cannot express is a ``ChatTemplateError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from dhisparse.tokenizer.chat import ChatTemplateError
from dhisparse.tokenizer.dsml import (
    ASSISTANT,
    BOS,
    EOS,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    USER,
    V32_BLOCK,
    call_block,
    function_of,
    message_text,
    to_json,
)

ThinkingMode = Literal["chat", "thinking"]
Message = Mapping[str, Any]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALLS_OPEN = V32_BLOCK.open
CALLS_CLOSE = V32_BLOCK.close

# The prompt the model was trained with to read tool schemas, word for word; the schemas
# follow, one JSON object per line.
_TOOLS_HEADER = f"""## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "{CALLS_OPEN}" block like the following as part of your reply to the user:
{CALLS_OPEN}
{INVOKE_OPEN} name="$FUNCTION_NAME">
{PARAM_OPEN} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}
...
{INVOKE_CLOSE}>
{INVOKE_OPEN} name="$FUNCTION_NAME2">
...
{INVOKE_CLOSE}>
{CALLS_CLOSE}

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

{CALLS_OPEN}
...
{CALLS_CLOSE}

<function_results>
...
</function_results>

{THINK_OPEN}...thinking about results{THINK_CLOSE}

Here are the functions available in JSONSchema format:
<functions>
"""
_TOOLS_FOOTER = "\n</functions>\n"
_RESPONSE_FORMAT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)


def _tools_and_format(message: Message) -> str:
    """The tool list and reply schema a system or developer message carries."""
    out = ""
    tools = message.get("tools")
    if tools:
        schemas = "\n".join(to_json(function_of(t, "tool")) for t in tools)
        out += "\n\n" + _TOOLS_HEADER + schemas + _TOOLS_FOOTER
    if message.get("response_format"):
        out += "\n\n" + _RESPONSE_FORMAT + to_json(message["response_format"])
    return out


def _arguments(arguments: Any) -> Mapping[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            raise ChatTemplateError(f"tool call arguments are not JSON: {e}") from e
    if not isinstance(arguments, Mapping):
        raise ChatTemplateError("tool call arguments must be a JSON object")
    return arguments


def _tool_calls(calls: Sequence[Any]) -> str:
    named = []
    for call in calls:
        fn = function_of(call, "tool call")
        named.append((fn.get("name"), _arguments(fn.get("arguments"))))
    return call_block(V32_BLOCK, named)


def last_user_index(messages: Sequence[Message]) -> int:
    """The last user (or developer) turn, -1 when there is none."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in ("user", "developer"):
            return i
    return -1


def _opening(thinks: bool) -> str:
    return THINK_OPEN if thinks else THINK_CLOSE


def _render(i: int, messages: Sequence[Message], mode: ThinkingMode, last_user: int) -> str:
    m = messages[i]
    role = m.get("role")
    thinking = mode == "thinking"
    if role == "system":
        return message_text(m) + _tools_and_format(m)
    if role == "developer":
        if not m.get("content"):
            raise ChatTemplateError("a developer message needs content")
        body = _tools_and_format(m) + f"\n\n# The user's message is: {message_text(m)}"
        return USER + body + ASSISTANT + _opening(i == last_user and thinking)
    if role == "user":
        return USER + message_text(m) + ASSISTANT + _opening(i == last_user and thinking)
    if role == "tool":
        caller = i - 1
        while caller >= 0 and messages[caller].get("role") == "tool":
            caller -= 1
        asker = messages[caller] if caller >= 0 else {}
        calls = asker.get("tool_calls") if asker.get("role") == "assistant" else None
        order = i - caller  # this result answers the order-th call
        if not calls or len(calls) < order:
            raise ChatTemplateError("a tool message must answer a tool call of the assistant")
        out = "\n\n<function_results>" if order == 1 else ""
        out += f"\n<result>{message_text(m)}</result>"
        if order == len(calls):
            out += "\n</function_results>\n\n" + _opening(i >= last_user and thinking)
        return out
    if role == "assistant":
        calls = m.get("tool_calls")
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ChatTemplateError("reasoning_content must be a string")
        shown = ""
        if thinking and i > last_user:
            if not (reasoning or calls):
                raise ChatTemplateError(
                    "in thinking mode an assistant turn after the last user turn needs "
                    "reasoning_content or tool_calls"
                )
            shown = (reasoning or "") + THINK_CLOSE
        return shown + message_text(m) + (_tool_calls(calls) if calls else "") + EOS
    raise ChatTemplateError(f"unsupported role: {role}")


def _drop_reasoning(messages: Sequence[Message]) -> list[Message]:
    """The chat without the reasoning of assistant turns before the last user turn (the
    format never shows it)."""
    last_user = last_user_index(messages)
    return [
        {k: v for k, v in m.items() if k != "reasoning_content"}
        if i < last_user and m.get("role") == "assistant"
        else m
        for i, m in enumerate(messages)
    ]


def encode_messages(
    messages: Sequence[Message],
    thinking_mode: ThinkingMode,
    *,
    context: Sequence[Message] = (),
    drop_thinking: bool = True,
    add_bos: bool = True,
) -> str:
    """The text of ``messages`` following ``context`` (already encoded, so not repeated; it
    decides which turn is the last user turn). The BOS leads a chat without context.

    DeepSeek's encoder gives the same text wherever it gives one. Where it fails on a chat,
    this one renders it (a developer turn before the last user turn in thinking mode, which it
    drops and then loses count of) or refuses it (a tool result that answers no call)."""
    if thinking_mode not in ("chat", "thinking"):
        raise ChatTemplateError(f"thinking mode must be chat or thinking, got {thinking_mode!r}")
    full: list[Message] = [*context, *messages]
    if any(not isinstance(m, Mapping) for m in full):
        raise ChatTemplateError("each message must be an object")
    if thinking_mode == "thinking" and drop_thinking:
        full = _drop_reasoning(full)
    last_user = last_user_index(full)
    prompt = BOS if add_bos and not context else ""
    for i in range(len(context), len(full)):
        prompt += _render(i, full, thinking_mode, last_user)
    return prompt
