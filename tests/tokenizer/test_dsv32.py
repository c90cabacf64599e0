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

GOLDEN = json.loads((Path(__file__).parent / "dsv32_golden.json").read_text(encoding="utf-8"))
CHATS: dict[str, list[dict[str, Any]]] = GOLDEN["chats"]


def _case_id(case: dict[str, Any]) -> str:
    parts = [case["chat"], case["thinking_mode"]]
    if "encoded_last" in case:
        parts.append(f"last{case['encoded_last']}")
    if not case["drop_thinking"]:
        parts.append("keep")
    if not case["add_bos"]:
        parts.append("nobos")
    return "-".join(parts)


def _encode(case: dict[str, Any]) -> str:
    chat = CHATS[case["chat"]]
    k = case.get("encoded_last", len(chat))
    return encode_messages(
        chat[len(chat) - k :],
        case["thinking_mode"],
        context=chat[: len(chat) - k],
        drop_thinking=case["drop_thinking"],
        add_bos=case["add_bos"],
    )


def test_upstream_golden_prompt() -> None:
    g = GOLDEN["upstream_golden"]
    assert encode_messages(CHATS[g["chat"]], g["thinking_mode"]) == g["prompt"]


@pytest.mark.parametrize("case", [c for c in GOLDEN["cases"] if "prompt" in c], ids=_case_id)
def test_prompt_equals_the_reference(case: dict[str, Any]) -> None:
    assert _encode(case) == case["prompt"]


@pytest.mark.parametrize("case", [c for c in GOLDEN["cases"] if "error" in c], ids=_case_id)
def test_chats_the_reference_refuses_are_template_errors(case: dict[str, Any]) -> None:
    with pytest.raises(ChatTemplateError):
        _encode(case)


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
