"""Parsing a DeepSeek-V3.2 or DeepSeek-V4 completion back into an assistant message: the inverse
of ``encoding_dsv32``'s and ``encoding_dsv4``'s assistant turn (reasoning, content, DSML tool
calls), as strict as DeepSeek's reference parsers about the turn's frame; the reasoning and the
DSML calls are read by the reply parser the gateway streams with (``reply``, ``reply_dsml``)."""

from __future__ import annotations

from typing import Any

from dhisparse.tokenizer.dsml import BOS, DSML, EOS, V32_BLOCK, CallBlock
from dhisparse.tokenizer.encoding_dsv32 import THINK_CLOSE, THINK_OPEN, ThinkingMode
from dhisparse.tokenizer.reply import ReplyParser, read_reply
from dhisparse.tokenizer.reply_dsml import DsmlAnswer


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"not a DeepSeek completion: {what}")


def parse_completion(
    text: str, thinking_mode: ThinkingMode, block: CallBlock = V32_BLOCK
) -> dict[str, Any]:
    """The assistant message of a completion (generated text up to and with its EOS) whose
    calls are in ``block``s (V3.2's by default, ``V4_BLOCK`` for V4's): role,
    content, reasoning_content and OpenAI-style tool_calls (``arguments`` as JSON text; a
    string parameter's value as written, any other as the JSON it was written as). Only
    well-formed completions parse; anything else is a ValueError."""
    _expect(text.endswith(EOS), "no end of sentence")
    body = text[: -len(EOS)]
    _expect(EOS not in body, "text after the end of sentence")
    thinking = thinking_mode == "thinking"
    _expect(not thinking or THINK_CLOSE in body, "the reasoning does not end with </think>")
    reply = read_reply(
        ReplyParser(reasoning_open=thinking, answer=DsmlAnswer(block, calls=True)), body
    )
    blocks = body.count(block.open)
    _expect(blocks == (1 if reply.tool_calls else 0), "a tool call block without calls or twice")
    if reply.tool_calls:
        _expect("\n\n" + block.open in body, "no blank line before the tool calls")
        _expect(body.endswith(block.close), "text after the tool calls")
    for special in (BOS, EOS, THINK_OPEN, THINK_CLOSE, DSML):
        _expect(
            special not in reply.content and special not in reply.reasoning,
            f"{special} in the text",
        )
    return {
        "role": "assistant",
        "content": reply.content,
        "reasoning_content": reply.reasoning,
        "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.tool_calls
        ],
    }
