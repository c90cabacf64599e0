"""DeepSeek-V4's chat format (DeepSeek-V4-Flash and -Pro). The checkpoints ship no Jinja template;
DeepSeek's Python encoder (``encoding/encoding_dsv4.py`` of the release) defines it, and this
module produces the same text (tests/tokenizer/dsv4_golden.json holds the encoder's outputs).

It is DeepSeek-V3.2's format (``encoding_dsv32``) with these differences:

- Tool calls are DSML in a ``<｜DSML｜tool_calls>`` block (V3.2: ``function_calls``), and the
  tool list the system (or developer) message carries is worded anew.
- Tool results are user turns: each ``tool`` message is a ``<tool_result>…</tool_result>``, and
  results and user messages in a row make one user turn, their texts joined by a blank line;
  the results follow the order of the calls they answer (by ``tool_call_id``).
- A user turn opens the assistant's (``<｜Assistant｜>`` then ``<think>`` when the model is to
  reason, ``</think>`` when not) only where an assistant turn or the end follows it.
- ``drop_thinking`` (earlier turns' reasoning left out) holds only in a chat without tools; with
  tools every assistant turn shows its reasoning and every user turn opens thinking.
- ``reasoning_effort`` "max" (Think Max) puts an instruction at the very start of a thinking
  chat; "high" and None (Think High) add nothing.
- A ``latest_reminder`` message (date, place) is ``<｜latest_reminder｜>{content}``.

Messages are OpenAI-style mappings: ``role`` (system, developer, user, assistant, tool,
latest_reminder), ``content`` (a string; None renders as empty), on assistant turns
``reasoning_content`` and ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
"arguments"}}]``, ``arguments`` the JSON text of an object, or the object itself), on tool
messages ``tool_call_id``. A chat the format cannot express is a ``ChatTemplateError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dhisparse.tokenizer.chat import ChatTemplateError
from dhisparse.tokenizer.dsml import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    USER,
    V4_BLOCK,
    call_block,
    function_of,
    message_text,
    to_json,
)
from dhisparse.tokenizer.encoding_dsv32 import THINK_CLOSE, THINK_OPEN, ThinkingMode

ReasoningEffort = Literal["high", "max"]
Message = Mapping[str, Any]

LATEST_REMINDER = "<｜latest_reminder｜>"
RESULT_OPEN = "<tool_result>"
RESULT_CLOSE = "</tool_result>"

# The prompts the model was trained with, word for word.
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)
_INVOKE = f"<{DSML}invoke"
_PARAM = f"<{DSML}parameter"
_TOOLS_HEADER = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{V4_BLOCK.open}" block like the following:

{V4_BLOCK.open}
{_INVOKE} name="$TOOL_NAME">
{_PARAM} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
{_INVOKE} name="$TOOL_NAME2">
...
</{DSML}invoke>
{V4_BLOCK.close}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_OPEN}), you MUST output your complete reasoning inside {THINK_OPEN}...{THINK_CLOSE} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_CLOSE} with tool calls or final response.

### Available Tool Schemas

"""
_TOOLS_FOOTER = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)
_RESPONSE_FORMAT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)
_USER_ROLES = ("user", "developer")
# Roles an assistant turn may follow without the user turn before it opening one.
_OPENERS = ("assistant", "latest_reminder")
# Roles that survive drop_thinking wherever they stand.
_KEPT = ("user", "system", "latest_reminder")


@dataclass(frozen=True)
class _Turn:
    """A message as the format renders it. A user turn holds ``parts`` (user texts and tool
    results, in order); ``result_ids`` names the call each result answers (None for text)."""

    message: Message
    parts: tuple[str, ...] = ()
    result_ids: tuple[str | None, ...] = ()

    @property
    def role(self) -> Any:
        return self.message.get("role")


def _merge_results(messages: Sequence[Message]) -> list[_Turn]:
    """Tool results and user messages in a row as one user turn each."""
    turns: list[_Turn] = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            answers = m.get("tool_call_id") or ""
            part = RESULT_OPEN + message_text(m) + RESULT_CLOSE
        elif role == "user":
            part, answers = message_text(m), None
        else:
            turns.append(_Turn(m))
            continue
        last = turns[-1] if turns else None
        if last is not None and last.role == "user":
            turns[-1] = _Turn(last.message, (*last.parts, part), (*last.result_ids, answers))
        else:
            turns.append(_Turn({"role": "user"}, (part,), (answers,)))
    return turns


def _call_order(calls: Sequence[Any]) -> dict[str, int]:
    order: dict[str, int] = {}
    for i, call in enumerate(calls):
        if not isinstance(call, Mapping):
            continue
        function = call.get("function")
        call_id = call.get("id") or (function.get("id") if isinstance(function, Mapping) else None)
        if call_id:
            order[call_id] = i
    return order


def _sort_results(turns: list[_Turn]) -> list[_Turn]:
    """Each user turn's results in the order of the calls of the last assistant turn that made
    calls (a result naming none of them counts as the first call); its texts stay in place."""
    order: dict[str, int] = {}
    out: list[_Turn] = []
    for t in turns:
        if t.role == "assistant" and t.message.get("tool_calls"):
            order = _call_order(t.message["tool_calls"])
        slots = [i for i, answers in enumerate(t.result_ids) if answers is not None]
        if t.role == "user" and len(slots) > 1 and order:
            ranked = sorted(slots, key=lambda i: order.get(t.result_ids[i] or "", 0))
            parts, ids = list(t.parts), list(t.result_ids)
            for slot, i in zip(slots, ranked, strict=True):
                parts[slot], ids[slot] = t.parts[i], t.result_ids[i]
            t = _Turn(t.message, tuple(parts), tuple(ids))
        out.append(t)
    return out


def _last_user(turns: Sequence[_Turn]) -> int:
    for i in range(len(turns) - 1, -1, -1):
        if turns[i].role in _USER_ROLES:
            return i
    return -1


def _drop_reasoning(turns: Sequence[_Turn]) -> list[_Turn]:
    """The turns before the last user turn without assistant reasoning, and without developer
    turns (which the format then leaves out)."""
    last_user = _last_user(turns)
    out: list[_Turn] = []
    for i, t in enumerate(turns):
        if t.role in _KEPT or i >= last_user:
            out.append(t)
        elif t.role == "assistant":
            kept = {k: v for k, v in t.message.items() if k != "reasoning_content"}
            out.append(_Turn(kept))
    return out


def _tools_and_format(message: Message) -> str:
    out = ""
    tools = message.get("tools")
    if tools:
        schemas = "\n".join(to_json(function_of(t, "tool")) for t in tools)
        out += "\n\n" + _TOOLS_HEADER + schemas + _TOOLS_FOOTER
    if message.get("response_format"):
        out += "\n\n" + _RESPONSE_FORMAT + to_json(message["response_format"])
    return out


def _arguments(arguments: Any) -> Mapping[str, Any]:
    """A call's arguments: JSON text of an object (text that is not JSON is the one argument
    ``arguments``, as DeepSeek's encoder writes it) or the object itself."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return {"arguments": arguments}
    if not isinstance(arguments, Mapping):
        raise ChatTemplateError("tool call arguments must be a JSON object")
    return arguments


def _tool_calls(calls: Sequence[Any]) -> str:
    named = []
    for call in calls:
        fn = function_of(call, "tool call")
        named.append((fn.get("name"), _arguments(fn.get("arguments"))))
    return call_block(V4_BLOCK, named)


def _assistant(m: Message, shows_reasoning: bool) -> str:
    reasoning = m.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatTemplateError("reasoning_content must be a string")
    shown = (reasoning or "") + THINK_CLOSE if shows_reasoning else ""
    calls = m.get("tool_calls")
    return shown + message_text(m) + (_tool_calls(calls) if calls else "") + EOS


@dataclass(frozen=True)
class _Mode:
    thinking: bool
    drop_thinking: bool
    reasoning_effort: ReasoningEffort | None


def _render(i: int, turns: Sequence[_Turn], mode: _Mode, last_user: int) -> str:
    t = turns[i]
    m, role = t.message, t.role
    out = (
        REASONING_EFFORT_MAX if i == 0 and mode.thinking and mode.reasoning_effort == "max" else ""
    )
    if role == "system":
        out += message_text(m) + _tools_and_format(m)
    elif role == "developer":
        if not m.get("content"):
            raise ChatTemplateError("a developer message needs content")
        out += USER + message_text(m) + _tools_and_format(m)
    elif role == "user":
        out += USER + "\n\n".join(t.parts)
    elif role == "latest_reminder":
        out += LATEST_REMINDER + message_text(m)
    elif role == "assistant":
        shows = mode.thinking and (not mode.drop_thinking or i > last_user)
        out += _assistant(m, shows)
    else:
        raise ChatTemplateError(f"unsupported role: {role}")
    if i + 1 < len(turns) and turns[i + 1].role not in _OPENERS:
        return out
    if role in _USER_ROLES:
        thinks = mode.thinking and (not mode.drop_thinking or i >= last_user)
        out += ASSISTANT + (THINK_OPEN if thinks else THINK_CLOSE)
    return out


def encode_messages(
    messages: Sequence[Message],
    thinking_mode: ThinkingMode,
    *,
    context: Sequence[Message] = (),
    drop_thinking: bool = True,
    add_bos: bool = True,
    reasoning_effort: ReasoningEffort | None = None,
) -> str:
    """The text of ``messages`` following ``context`` (already encoded, so not repeated; it
    decides which turn is the last user turn). The BOS leads a chat without context.

    DeepSeek's encoder gives the same text wherever it gives one. Where it fails on a chat,
    this one renders it (content None) or refuses it (arguments that are JSON but not an
    object); where it nests an arguments object given as an object rather than as JSON text
    (``{"arguments": {...}}``), this one renders what that object's JSON text renders."""
    if thinking_mode not in ("chat", "thinking"):
        raise ChatTemplateError(f"thinking mode must be chat or thinking, got {thinking_mode!r}")
    if reasoning_effort not in (None, "high", "max"):
        raise ChatTemplateError(f"reasoning effort must be high or max, got {reasoning_effort!r}")
    if any(not isinstance(m, Mapping) for m in [*context, *messages]):
        raise ChatTemplateError("each message must be an object")
    before = _merge_results(context)
    turns = _sort_results(before + _merge_results(messages))
    drop = drop_thinking and not any(t.message.get("tools") for t in turns)
    thinking = thinking_mode == "thinking"
    start = len(before)
    if thinking and drop:
        turns = _drop_reasoning(turns)
        start = len(_drop_reasoning(before))
    mode = _Mode(thinking, drop, reasoning_effort)
    last_user = _last_user(turns)
    prompt = BOS if add_bos and not context else ""
    for i in range(start, len(turns)):
        prompt += _render(i, turns, mode, last_user)
    return prompt
