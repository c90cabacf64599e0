"""DeepSeek-V3.2's chat format against golden strings of DeepSeek's reference encoder
(dsv32_golden.json names the file, its commit and how the strings were made)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dhisparse.tokenizer import ChatTemplateError
from dhisparse.tokenizer.encoding_dsv32 import EOS, encode_messages
from dhisparse.tokenizer.parsing_dsv32 import parse_completion
from tests.tokenizer.helpers import encode_golden, golden_id

GOLDEN = json.loads((Path(__file__).parent / "dsv32_golden.json").read_text(encoding="utf-8"))
CHATS: dict[str, list[dict[str, Any]]] = GOLDEN["chats"]


def test_upstream_golden_prompt() -> None:
    g = GOLDEN["upstream_golden"]
    assert encode_messages(CHATS[g["chat"]], g["thinking_mode"]) == g["prompt"]


@pytest.mark.parametrize("case", [c for c in GOLDEN["cases"] if "prompt" in c], ids=golden_id)
def test_prompt_equals_the_reference(case: dict[str, Any]) -> None:
    assert encode_golden(encode_messages, CHATS, case) == case["prompt"]


@pytest.mark.parametrize("case", [c for c in GOLDEN["cases"] if "error" in c], ids=golden_id)
def test_chats_the_reference_refuses_are_template_errors(case: dict[str, Any]) -> None:
    with pytest.raises(ChatTemplateError):
        encode_golden(encode_messages, CHATS, case)


def test_the_inputs_are_left_as_they_were() -> None:
    chat = json.loads(json.dumps(CHATS["multi_turn"]))
    encode_messages(chat, "thinking")
    assert chat == CHATS["multi_turn"]


@pytest.mark.parametrize(
    "case",
    GOLDEN["completions"],
    ids=[f"{c['name']}-{c['thinking_mode']}" for c in GOLDEN["completions"]],
)
def test_completions_parse_as_the_reference_parses_them(case: dict[str, Any]) -> None:
    if case.get("error"):
        with pytest.raises(ValueError):
            parse_completion(case["text"], case["thinking_mode"])
    else:
        assert parse_completion(case["text"], case["thinking_mode"]) == case["message"]


def test_a_parsed_turn_encodes_to_its_text() -> None:
    chat = CHATS["tool_argument_types"]
    text = encode_messages(chat[-1:], "thinking", context=chat[:-1])
    parsed = parse_completion(text, "thinking")
    assert encode_messages([parsed], "thinking", context=chat[:-1]) == text
    assert text.endswith(EOS)


def test_a_developer_turn_before_the_last_user_turn_renders_in_thinking_mode() -> None:
    # DeepSeek's encoder drops it from the chat and then fails; here it renders as in chat mode.
    chat = [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]
    assert encode_messages(chat, "thinking") == encode_messages(chat, "chat")[
        : -len("</think>")
    ] + ("<think>")
