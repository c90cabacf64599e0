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
- A reasoning effort puts its instruction at the very start of a thinking chat. The efforts
  and their texts are the release's (``EffortTable``): DeepSeek-V4-Flash and -Pro take "high"
  (Think High, the default, no text) and "max" (Think Max); DeepSeek-V4-Flash-0731 takes
  "low" (the default, no text), "high" (the first release's Think Max text) and "max" (a
  text of its own).
- A ``latest_reminder`` message (date, place) is ``<｜latest_reminder｜>{content}``.

DeepSeek-V4.1's format (``encoding_dsv41``) is this one in another ``Dialect``: its own call
tags, a ``<｜System｜>`` token, system messages past the first that ask like user turns, and
arguments that must be JSON.

Messages are OpenAI-style mappings: ``role`` (system, developer, user, assistant, tool,
latest_reminder), ``content`` (a string; None renders as empty), on assistant turns
``reasoning_content`` and ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
"arguments"}}]``, ``arguments`` the JSON text of an object, or the object itself), on tool
messages ``tool_call_id``. A chat the format cannot express is a ``ChatTemplateError``.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dhisparse.tokenizer.chat import ChatTemplateError
from dhisparse.tokenizer.dsml import (
    ASSISTANT,
    BOS,
    EOS,
    USER,
    V4_BLOCK,
    CallBlock,
    call_block,
    function_of,
    message_text,
    to_json,
)
from dhisparse.tokenizer.encoding_dsv32 import THINK_CLOSE, THINK_OPEN, ThinkingMode

Message = Mapping[str, Any]

LATEST_REMINDER = "<｜latest_reminder｜>"
RESULT_OPEN = "<tool_result>"
RESULT_CLOSE = "</tool_result>"

# The effort prompts the models were trained with, word for word.
ABSOLUTE_MAXIMUM = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)
BEYOND_MAXIMUM = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every "
    "causal chain to its root, and resolve the underlying cause rather than any surface "
    "symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple "
    "angles and are certain that no assumption remains unchecked and no error remains "
    "undiscovered.\n\n"
)


@dataclass(frozen=True)
class EffortTable:
    """A release's reasoning efforts: each one's name and the text it puts at the very start
    of a thinking chat (``prompts``, least effort first), and the effort of a chat that names
    none (``default``)."""

    name: str
    prompts: tuple[tuple[str, str], ...]
    default: str

    def __post_init__(self) -> None:
        if self.default not in self.efforts:
            raise ValueError(f"{self.name}: the default effort {self.default!r} is not one of "
                             f"{list(self.efforts)}")  # fmt: skip

    @property
    def efforts(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.prompts)

    def text(self, effort: str | None) -> str:
        """The instruction ``effort`` (None: the default) puts first."""
        name = self.default if effort is None else effort
        for key, text in self.prompts:
            if key == name:
                return text
        raise ChatTemplateError(
            f"reasoning effort must be one of {', '.join(self.efforts)}, got {effort!r}"
        )


# DeepSeek-V4-Flash and -Pro as first released (revision 60d8d70 of V4-Flash).
PREVIEW_EFFORTS = EffortTable("preview", (("high", ""), ("max", ABSOLUTE_MAXIMUM)), "high")
# DeepSeek-V4-Flash-0731: ``REASONING_EFFORT_PROMPTS`` and ``DEFAULT_REASONING_EFFORT``.
EFFORTS_0731 = EffortTable(
    "0731", (("low", ""), ("high", ABSOLUTE_MAXIMUM), ("max", BEYOND_MAXIMUM)), "low"
)


def release_efforts(encoder: str | None, config: Mapping[str, Any]) -> EffortTable:
    """The effort table of a V4 checkpoint: the one its own encoder defines
    (``encoding/encoding_dsv4.py``'s text, read as data and never run:
    ``REASONING_EFFORT_PROMPTS`` with ``DEFAULT_REASONING_EFFORT``, or the first release's
    ``REASONING_EFFORT_MAX``); without an encoder, 0731's where ``config.json`` has the
    ``dspark_*`` fields only 0731 and later releases have, else the first release's. An
    encoder that defines neither table is a ``ValueError`` naming what is missing."""
    if encoder is None:
        dspark = any(str(k).startswith("dspark_") for k in config)
        return EFFORTS_0731 if dspark else PREVIEW_EFFORTS
    try:
        tree = ast.parse(encoder)
    except SyntaxError as e:
        raise ValueError(f"the checkpoint's encoder does not parse: {e}") from e
    found = _literals(tree, ("REASONING_EFFORT_PROMPTS", "DEFAULT_REASONING_EFFORT",
                             "REASONING_EFFORT_MAX"))  # fmt: skip
    prompts, default = found.get("REASONING_EFFORT_PROMPTS"), found.get("DEFAULT_REASONING_EFFORT")
    if isinstance(prompts, dict) and isinstance(default, str):
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
            raise ValueError("the checkpoint's REASONING_EFFORT_PROMPTS maps names to texts")
        table = tuple(prompts.items())
        return EFFORTS_0731 if table == EFFORTS_0731.prompts and default == "low" else (
            EffortTable("the checkpoint's", table, default))  # fmt: skip
    if isinstance(found.get("REASONING_EFFORT_MAX"), str):
        text = found["REASONING_EFFORT_MAX"]
        return PREVIEW_EFFORTS if text == ABSOLUTE_MAXIMUM else (
            EffortTable("the checkpoint's", (("high", ""), ("max", text)), "high"))  # fmt: skip
    raise ValueError(
        "the checkpoint's encoder defines no effort table (REASONING_EFFORT_PROMPTS with "
        "DEFAULT_REASONING_EFFORT, or REASONING_EFFORT_MAX, as literals)"
    )


def _literals(tree: ast.Module, names: tuple[str, ...]) -> dict[str, Any]:
    """The module-level assignments of ``names`` whose values are literals."""
    out: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name) and target.id in names:
                try:
                    out[target.id] = ast.literal_eval(value)
                except (ValueError, TypeError):
                    continue
    return out


@dataclass(frozen=True)
class Dialect:
    """What sets a release's format apart from V4's. ``block``: the call tags.
    ``system_token``: what opens the chat's first turn when it is a system message or an
    effort text stands before it, and every later system message (V4 has none). ``system_asks``:
    a system message past the first is a user turn (it may open the assistant's turn and counts
    as the last user turn). ``text_arguments``: arguments text that is not JSON is the one
    argument ``arguments`` rather than an error. ``keeps_user_fields``: a user turn keeps its
    first user message's fields (``tools`` there keep the reasoning of earlier turns)."""

    block: CallBlock
    system_token: str = ""
    system_asks: bool = False
    text_arguments: bool = True
    keeps_user_fields: bool = False


V4 = Dialect(V4_BLOCK)


def _tools_header(block: CallBlock) -> str:
    return f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{block.open}" block like the following:

{block.open}
{block.invoke_open} name="$TOOL_NAME">
{block.param_open} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{block.param_close}
...
{block.invoke_close}>
{block.invoke_open} name="$TOOL_NAME2">
...
{block.invoke_close}>
{block.close}

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


def _merge_results(messages: Sequence[Message], dialect: Dialect) -> list[_Turn]:
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
            kept = m if role == "user" and dialect.keeps_user_fields else {"role": "user"}
            turns.append(_Turn(kept, (part,), (answers,)))
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


def _asks(i: int, role: Any, dialect: Dialect) -> bool:
    """Whether turn ``i`` is a user turn: one that may open the assistant's."""
    return role in _USER_ROLES or (dialect.system_asks and role == "system" and i > 0)


def _last_user(turns: Sequence[_Turn], dialect: Dialect) -> int:
    for i in range(len(turns) - 1, -1, -1):
        if _asks(i, turns[i].role, dialect):
            return i
    return -1


def _drop_reasoning(turns: Sequence[_Turn], dialect: Dialect) -> list[_Turn]:
    """The turns before the last user turn without assistant reasoning, and without developer
    turns (which the format then leaves out)."""
    last_user = _last_user(turns, dialect)
    out: list[_Turn] = []
    for i, t in enumerate(turns):
        if t.role in _KEPT or i >= last_user:
            out.append(t)
        elif t.role == "assistant":
            kept = {k: v for k, v in t.message.items() if k != "reasoning_content"}
            out.append(_Turn(kept))
    return out


def _tools_and_format(message: Message, block: CallBlock) -> str:
    out = ""
    tools = message.get("tools")
    if tools:
        schemas = "\n".join(to_json(function_of(t, "tool")) for t in tools)
        out += "\n\n" + _tools_header(block) + schemas + _TOOLS_FOOTER
    if message.get("response_format"):
        out += "\n\n" + _RESPONSE_FORMAT + to_json(message["response_format"])
    return out


def _arguments(arguments: Any, dialect: Dialect) -> Mapping[str, Any]:
    """A call's arguments: JSON text of an object (text that is not JSON is the one argument
    ``arguments`` where the dialect says so, as DeepSeek's V4 encoder writes it) or the object
    itself."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            if dialect.text_arguments:
                return {"arguments": arguments}
            raise ChatTemplateError(f"tool call arguments are not JSON: {e}") from e
    if not isinstance(arguments, Mapping):
        raise ChatTemplateError("tool call arguments must be a JSON object")
    return arguments


def _tool_calls(calls: Sequence[Any], dialect: Dialect) -> str:
    named = []
    for call in calls:
        fn = function_of(call, "tool call")
        named.append((fn.get("name"), _arguments(fn.get("arguments"), dialect)))
    return call_block(dialect.block, named)


def _assistant(m: Message, shows_reasoning: bool, dialect: Dialect) -> str:
    reasoning = m.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatTemplateError("reasoning_content must be a string")
    shown = (reasoning or "") + THINK_CLOSE if shows_reasoning else ""
    calls = m.get("tool_calls")
    return shown + message_text(m) + (_tool_calls(calls, dialect) if calls else "") + EOS


@dataclass(frozen=True)
class _Mode:
    thinking: bool
    drop_thinking: bool
    effort_text: str
    dialect: Dialect


def _lead(i: int, role: Any, mode: _Mode) -> str:
    """What opens turn ``i``: the first turn's effort text in thinking mode, after the
    dialect's system token where it is a system message or there is such a text; every later
    system message's system token."""
    system = mode.dialect.system_token
    if i > 0:
        return system if role == "system" else ""
    effort = mode.effort_text if mode.thinking else ""
    return (system if effort or role == "system" else "") + effort


def _render(i: int, turns: Sequence[_Turn], mode: _Mode, last_user: int) -> str:
    t = turns[i]
    m, role, block = t.message, t.role, mode.dialect.block
    out = _lead(i, role, mode)
    if role == "system":
        out += message_text(m) + _tools_and_format(m, block)
    elif role == "developer":
        if not m.get("content"):
            raise ChatTemplateError("a developer message needs content")
        out += USER + message_text(m) + _tools_and_format(m, block)
    elif role == "user":
        out += USER + "\n\n".join(t.parts)
    elif role == "latest_reminder":
        out += LATEST_REMINDER + message_text(m)
    elif role == "assistant":
        shows = mode.thinking and (not mode.drop_thinking or i > last_user)
        out += _assistant(m, shows, mode.dialect)
    else:
        raise ChatTemplateError(f"unsupported role: {role}")
    if i + 1 < len(turns) and turns[i + 1].role not in _OPENERS:
        return out
    if _asks(i, role, mode.dialect):
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
    reasoning_effort: str | None = None,
    efforts: EffortTable = PREVIEW_EFFORTS,
) -> str:
    """The text of ``messages`` following ``context`` (already encoded, so not repeated; it
    decides which turn is the last user turn). The BOS leads a chat without context.

    DeepSeek's encoder gives the same text wherever it gives one. Where it fails on a chat,
    this one renders it (content None) or refuses it (arguments that are JSON but not an
    object); where it nests an arguments object given as an object rather than as JSON text
    (``{"arguments": {...}}``), this one renders what that object's JSON text renders.
    ``reasoning_effort`` is one of ``efforts``' (the release's table; None its default)."""
    return encode_dialect(
        messages,
        thinking_mode,
        context=context,
        drop_thinking=drop_thinking,
        add_bos=add_bos,
        effort_text=efforts.text(reasoning_effort),
        dialect=V4,
    )


def encode_dialect(
    messages: Sequence[Message],
    thinking_mode: ThinkingMode,
    *,
    context: Sequence[Message],
    drop_thinking: bool,
    add_bos: bool,
    effort_text: str,
    dialect: Dialect,
) -> str:
    """``encode_messages`` in ``dialect``, ``effort_text`` put first in a thinking chat."""
    if thinking_mode not in ("chat", "thinking"):
        raise ChatTemplateError(f"thinking mode must be chat or thinking, got {thinking_mode!r}")
    if any(not isinstance(m, Mapping) for m in [*context, *messages]):
        raise ChatTemplateError("each message must be an object")
    before = _merge_results(context, dialect)
    turns = _sort_results(before + _merge_results(messages, dialect))
    drop = drop_thinking and not any(t.message.get("tools") for t in turns)
    thinking = thinking_mode == "thinking"
    start = len(before)
    if thinking and drop:
        turns = _drop_reasoning(turns, dialect)
        start = len(_drop_reasoning(before, dialect))
    mode = _Mode(thinking, drop, effort_text, dialect)
    last_user = _last_user(turns, dialect)
    prompt = BOS if add_bos and not context else ""
    for i in range(start, len(turns)):
        prompt += _render(i, turns, mode, last_user)
    return prompt
