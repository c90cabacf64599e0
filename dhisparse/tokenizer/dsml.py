"""DSML, the tool-call markup of DeepSeek's chat formats (DeepSeek-V3.2, DeepSeek-V4 and
DeepSeek-V4.1), and the special tokens those formats share.

A call block is ``<｜DSML｜NAME>`` holding one ``<｜DSML｜invoke name="F">`` element per call,
each holding one ``<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`` line
per argument: ``string="true"`` marks a raw text value, ``"false"`` a JSON one. The families
differ in the tag names only (``CallBlock``): V3.2's block is ``function_calls``, V4's
``tool_calls``; V4.1 names its block `` calls`` and its elements `` invoke`` and `` parameter``,
each with a leading space (``<｜DSML｜ invoke name="F">``). An assistant turn writes its block
after two newlines.
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

# V3.2's and V4's element tags (``CallBlock``'s defaults).
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"


@dataclass(frozen=True)
class CallBlock:
    """The element that holds an assistant turn's calls, by its name, and the names of the
    elements inside it (one ``invoke`` per call, one ``parameter`` per argument)."""

    name: str
    invoke: str = "invoke"
    parameter: str = "parameter"

    @property
    def open(self) -> str:
        return f"<{DSML}{self.name}>"

    @property
    def close(self) -> str:
        return f"</{DSML}{self.name}>"

    @property
    def invoke_open(self) -> str:
        """An invoke's opening tag up to its attributes."""
        return f"<{DSML}{self.invoke}"

    @property
    def invoke_close(self) -> str:
        """An invoke's closing tag but its final ``>``."""
        return f"</{DSML}{self.invoke}"

    @property
    def param_open(self) -> str:
        """A parameter's opening tag up to its attributes."""
        return f"<{DSML}{self.parameter}"

    @property
    def param_close(self) -> str:
        return f"</{DSML}{self.parameter}>"


V32_BLOCK = CallBlock("function_calls")
V4_BLOCK = CallBlock("tool_calls")
V41_BLOCK = CallBlock(" calls", " invoke", " parameter")


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


def parameters(block: CallBlock, arguments: Mapping[str, Any]) -> str:
    """A call's arguments as its parameter lines: a string as written, any other value as
    its JSON."""
    return "\n".join(
        f'{block.param_open} name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
        f"{value if isinstance(value, str) else to_json(value)}{block.param_close}"
        for key, value in arguments.items()
    )


def call_block(block: CallBlock, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """The block of ``calls`` (name, arguments) as an assistant turn writes it, with the two
    newlines before it."""
    invokes = "\n".join(
        f'{block.invoke_open} name="{name}">\n{parameters(block, arguments)}\n{block.invoke_close}>'
        for name, arguments in calls
    )
    return f"\n\n{block.open}\n{invokes}\n{block.close}"
