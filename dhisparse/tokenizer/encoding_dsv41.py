"""DeepSeek-V4.1's chat format. The checkpoints ship no Jinja template; DeepSeek's Python encoder
defines it (SGLang carries it as ``encoding_dsv41.py``, "adapted from the DeepSeek-V4.1 release
reference implementation"), and this module produces the same text
(tests/tokenizer/dsv41_golden.json holds that encoder's outputs).

It is DeepSeek-V4's format (``encoding_dsv4``) in V4.1's ``Dialect``:

- Tool calls are DSML in a ``<｜DSML｜ calls>`` block of ``<｜DSML｜ invoke>`` and
  ``<｜DSML｜ parameter>`` elements: each tag name has a leading space (``V41_BLOCK``).
- The reasoning effort is a budget from 1 to 100, put first in a thinking chat as
  ``Reasoning Effort: {budget} (range 1-100, ...)``: an int, or a name (``NAMED_EFFORTS``:
  low 50, high 75, xhigh 75, max 100); "high" when none is named.
- ``<｜System｜>`` opens the first turn when it is a system message or the effort text stands
  before it, and opens every later system message; a system message past the first is a user
  turn (it opens the assistant's turn when an assistant turn or the end follows it).
- Call arguments must be JSON text of an object (or the object): other text is an error.
- Content may be a list of text parts, joined by a blank line.

Images are not: DeepSeek's encoder renders an image part as ``<｜deepseek_image｜>`` for the
vision encoder this server does not have, so an image part, and the placeholder written into
any text, is a ``ChatTemplateError``. So is any other part that is not text (the reference
writes ``[Unsupported TYPE]`` for it) and an empty part list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dhisparse.tokenizer.chat import ChatTemplateError
from dhisparse.tokenizer.dsml import V41_BLOCK
from dhisparse.tokenizer.encoding_dsv4 import Dialect, Message, encode_dialect
from dhisparse.tokenizer.encoding_dsv32 import ThinkingMode

SYSTEM = "<｜System｜>"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
V41 = Dialect(
    V41_BLOCK, system_token=SYSTEM, system_asks=True, text_arguments=False, keeps_user_fields=True
)

# The effort names and their budgets, and the effort of a chat that names none.
NAMED_EFFORTS: tuple[tuple[str, int], ...] = (
    ("low", 50),
    ("high", 75),
    ("xhigh", 75),
    ("max", 100),
)
DEFAULT_EFFORT = "high"
MIN_BUDGET, MAX_BUDGET = 1, 100
_EFFORT_TEXT = (
    "Reasoning Effort: {budget} "
    "(range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
_IMAGE_PARTS = ("image_url", "image")

Effort = str | int | None


def effort_budget(effort: Effort) -> int:
    """The budget of ``effort``: an int from 1 to 100 as it is, a name of ``NAMED_EFFORTS`` its
    budget, None the default's; anything else a ``ChatTemplateError`` naming what is accepted."""
    name = DEFAULT_EFFORT if effort is None else effort
    if isinstance(name, int) and not isinstance(name, bool) and MIN_BUDGET <= name <= MAX_BUDGET:
        return name
    for key, budget in NAMED_EFFORTS:
        if isinstance(name, str) and key == name:
            return budget
    names = ", ".join(key for key, _ in NAMED_EFFORTS)
    raise ChatTemplateError(
        f"reasoning effort must be an integer from {MIN_BUDGET} to {MAX_BUDGET} or one of "
        f"{names}, got {effort!r}"
    )


def effort_text(effort: Effort) -> str:
    """The instruction ``effort`` puts first in a thinking chat."""
    return _EFFORT_TEXT.format(budget=effort_budget(effort))


def _refuse_placeholder(text: Any, where: str) -> None:
    if isinstance(text, str) and IMAGE_PLACEHOLDER in text:
        raise ChatTemplateError(
            f"{where} contains the image placeholder {IMAGE_PLACEHOLDER}; this model reads no "
            "images"
        )


def _part_text(part: Any) -> str:
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind in _IMAGE_PARTS:
        raise ChatTemplateError("image content is not supported: this server has no vision encoder")
    if kind != "text" or not isinstance(part.get("text"), str):
        raise ChatTemplateError(f"content parts must be text parts, got {kind!r}")
    _refuse_placeholder(part["text"], "a text part")
    return part["text"]


def text_only(message: Message) -> Message:
    """``message`` with its content as one string (text parts joined by a blank line, as the
    reference joins them), refused where it holds an image or the image placeholder."""
    if not isinstance(message, Mapping):
        raise ChatTemplateError("each message must be an object")
    _refuse_placeholder(message.get("content"), "message content")
    _refuse_placeholder(message.get("reasoning_content"), "reasoning_content")
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if not content:
        raise ChatTemplateError("content must be a string or a nonempty list of text parts")
    return {**message, "content": "\n\n".join(_part_text(p) for p in content)}


def encode_messages(
    messages: Sequence[Message],
    thinking_mode: ThinkingMode,
    *,
    context: Sequence[Message] = (),
    drop_thinking: bool = True,
    add_bos: bool = True,
    reasoning_effort: Effort = None,
) -> str:
    """The text of ``messages`` following ``context`` (already encoded, so not repeated; it
    decides which turn is the last user turn). The BOS leads a chat without context.

    DeepSeek's encoder gives the same text wherever it gives one; where it fails on a chat,
    this one renders it (content None) or refuses it (``ChatTemplateError``), and it refuses
    what the module's docstring says besides. ``reasoning_effort``: see ``effort_budget``."""
    text = effort_text(reasoning_effort)
    return encode_dialect(
        [text_only(m) for m in messages],
        thinking_mode,
        context=[text_only(m) for m in context],
        drop_thinking=drop_thinking,
        add_bos=add_bos,
        effort_text=text,
        dialect=V41,
    )
