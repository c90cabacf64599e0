"""DeepSeek-V4's chat format against golden strings of DeepSeek's reference encoder
(dsv4_golden.json names the file and how the strings were made; its upstream_golden are the
release's own test outputs), and V4 completions parsed as the reference parses them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dhisparse.tokenizer import ChatTemplateError
from dhisparse.tokenizer.dsml import EOS, V4_BLOCK
from dhisparse.tokenizer.encoding_dsv4 import EFFORTS_0731, encode_messages
from dhisparse.tokenizer.parsing_dsv32 import parse_completion
from tests.tokenizer.helpers import encode_golden, golden_id

GOLDEN = json.loads((Path(__file__).parent / "dsv4_golden.json").read_text(encoding="utf-8"))
GOLDEN_0731 = json.loads(
    (Path(__file__).parent / "dsv4_0731_golden.json").read_text(encoding="utf-8")
)
CHATS: dict[str, list[dict[str, Any]]] = GOLDEN["chats"]


@pytest.mark.parametrize("case", GOLDEN["upstream_golden"], ids=lambda c: c["chat"])
def test_the_releases_own_golden_prompts(case: dict[str, Any]) -> None:
    assert encode_messages(CHATS[case["chat"]], case["thinking_mode"]) == case["prompt"]


@pytest.mark.parametrize("case", [c for c in GOLDEN["cases"] if "prompt" in c], ids=golden_id)
def test_prompt_equals_the_reference(case: dict[str, Any]) -> None:
    assert encode_golden(encode_messages, CHATS, case) == case["prompt"]


@pytest.mark.parametrize("case", [c for c in GOLDEN["cases"] if "error" in c], ids=golden_id)
def test_chats_the_reference_refuses_are_template_errors(case: dict[str, Any]) -> None:
    with pytest.raises(ChatTemplateError):
        encode_golden(encode_messages, CHATS, case)


@pytest.mark.parametrize("case", [c for c in GOLDEN_0731["cases"] if "prompt" in c], ids=golden_id)
def test_0731_prompt_equals_the_reference(case: dict[str, Any]) -> None:
    assert encode_golden(encode_messages, CHATS, case, efforts=EFFORTS_0731) == case["prompt"]


@pytest.mark.parametrize("case", [c for c in GOLDEN_0731["cases"] if "error" in c], ids=golden_id)
def test_chats_0731s_reference_refuses_are_template_errors(case: dict[str, Any]) -> None:
    with pytest.raises(ChatTemplateError):
        encode_golden(encode_messages, CHATS, case, efforts=EFFORTS_0731)


def test_the_first_release_refuses_0731s_low_effort() -> None:
    with pytest.raises(ChatTemplateError, match="must be one of high, max"):
        encode_messages(CHATS["user_only"], "thinking", reasoning_effort="low")


def test_the_inputs_are_left_as_they_were() -> None:
    chat = CHATS["tool_round_trip"]
    copy = json.loads(json.dumps(chat))
    encode_messages(copy, "thinking")
    assert copy == chat


def test_arguments_given_as_an_object_render_as_their_json_text() -> None:
    # The reference nests an object it is given ({"arguments": {...}}); here it renders as
    # the JSON text the API carries renders.
    chat = CHATS["tool_round_trip"]
    as_objects = [
        {**m, "tool_calls": [
            {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in m["tool_calls"]
        ]} if m.get("tool_calls") else m
        for m in chat
    ]  # fmt: skip
    assert encode_messages(as_objects, "thinking") == encode_messages(chat, "thinking")


@pytest.mark.parametrize("bad", ["low", "medium", "none", 3])
def test_a_reasoning_effort_the_reference_refuses_is_a_template_error(bad: Any) -> None:
    with pytest.raises(ChatTemplateError, match="effort"):
        encode_messages(CHATS["user_only"], "thinking", reasoning_effort=bad)


@pytest.mark.parametrize(
    "case",
    GOLDEN["completions"],
    ids=[f"{i}-{c['thinking_mode']}" for i, c in enumerate(GOLDEN["completions"])],
)
def test_completions_parse_as_the_reference_parses_them(case: dict[str, Any]) -> None:
    if case.get("error"):
        with pytest.raises(ValueError):
            parse_completion(case["text"], case["thinking_mode"], V4_BLOCK)
    else:
        got = parse_completion(case["text"], case["thinking_mode"], V4_BLOCK)
        assert got == case["message"]


def test_a_parsed_turn_encodes_to_its_text() -> None:
    chat = CHATS["tool_argument_types"]
    turn = 2  # the assistant's call
    text = encode_messages(chat[turn : turn + 1], "thinking", context=chat[:turn])
    assert text.endswith(EOS)
    parsed = parse_completion(text, "thinking", V4_BLOCK)
    assert encode_messages([parsed], "thinking", context=chat[:turn]) == text
