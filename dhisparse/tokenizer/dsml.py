"""DSML, the tool-call markup of DeepSeek's chat formats (DeepSeek-V3.2 and DeepSeek-V4), and the
special tokens those formats share.

A call block is ``<｜DSML｜NAME>`` holding one ``<｜DSML｜invoke name="F">`` element per call,
each holding one ``<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`` line
per argument: ``string="true"`` marks a raw text value, ``"false"`` a JSON one. The block's name
is the one thing the two families write differently (``CallBlock``): V3.2's is
``function_calls``, V4's ``tool_calls``. An assistant turn writes its block after two newlines.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dhisparse.tokenizer.chat import ChatTemplateError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
DSML = "｜DSML｜"

INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"


@dataclass(frozen=True)
class CallBlock:
    """The element that holds an assistant turn's calls, by its name."""

    name: str

    @property
    def open(self) -> str:
        return f"<{DSML}{self.name}>"

    @property
    def close(self) -> str:
        return f"</{DSML}{self.name}>"


V32_BLOCK = CallBlock("function_calls")
V4_BLOCK = CallBlock("tool_calls")


def to_json(value: Any) -> str:
    """JSON as DeepSeek's encoders write it (``json.dumps`` keeping non-ASCII text)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ChatTemplateError(f"not JSON: {e}") from e


def function_of(item: Any, what: str) -> Mapping[str, Any]:
    """The ``function`` member of an OpenAI tool or tool call."""
    fn = item.get("function") if isinstance(item, Mapping) else None
    if not isinstance(fn, Mapping):
        raise ChatTemplateError(f"each {what} needs a 'function' object")
    return fn


def message_text(message: Mapping[str, Any]) -> str:
    """A message's ``content``: a string, None read as empty."""
    content = message.get("content")
    if content is None:
        return ""
    if not isinstance(content, str):
        raise ChatTemplateError(f"{message.get('role')} content must be a string")
    return content


def parameters(arguments: Mapping[str, Any]) -> str:
    """A call's arguments as its parameter lines: a string as written, any other value as
    its JSON."""
    return "\n".join(
        f'{PARAM_OPEN} name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
        f"{value if isinstance(value, str) else to_json(value)}{PARAM_CLOSE}"
        for key, value in arguments.items()
    )


def call_block(block: CallBlock, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """The block of ``calls`` (name, arguments) as an assistant turn writes it, with the two
    newlines before it."""
    invokes = "\n".join(
        f'{INVOKE_OPEN} name="{name}">\n{parameters(arguments)}\n{INVOKE_CLOSE}>'
        for name, arguments in calls
    )
    return f"\n\n{block.open}\n{invokes}\n{block.close}"
