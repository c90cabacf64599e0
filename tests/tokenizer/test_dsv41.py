"""DeepSeek-V4.1's chat format against golden strings of DeepSeek's reference encoder as SGLang
carries it (dsv41_golden.json names the file, its version and how the strings were made), and
V4.1 completions parsed back into the turns they encode."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dhisparse.tokenizer import ChatTemplateError
from dhisparse.tokenizer.dsml import EOS, V41_BLOCK
from dhisparse.tokenizer.encoding_dsv41 import (
    IMAGE_PLACEHOLDER,
    SYSTEM,
    effort_budget,
    encode_messages,
)
from dhisparse.tokenizer.parsing_dsv32 import parse_completion
from tests.tokenizer.helpers import encode_golden, golden_id

GOLDEN = json.loads((Path(__file__).parent / "dsv41_golden.json").read_text(encoding="utf-8"))
# V4.1's own chats, beside V4's golden chats it renders too
CHATS: dict[str, list[dict[str, Any]]] = (
    json.loads((Path(__file__).parent / "dsv4_golden.json").read_text(encoding="utf-8"))["chats"]
    | GOLDEN["chats"]
)
# Chats the reference renders with an image placeholder for its vision encoder; refused here.
IMAGE_CHATS = ("image_block",)


RENDERED = [c for c in GOLDEN["cases"] if "prompt" in c and c["chat"] not in IMAGE_CHATS]
REFUSED = [c for c in GOLDEN["cases"] if "error" in c or c["chat"] in IMAGE_CHATS]


@pytest.mark.parametrize("case", RENDERED, ids=golden_id)
def test_prompt_equals_the_reference(case: dict[str, Any]) -> None:
    assert encode_golden(encode_messages, CHATS, case) == case["prompt"]


@pytest.mark.parametrize("case", REFUSED, ids=golden_id)
def test_chats_the_reference_refuses_are_template_errors(case: dict[str, Any]) -> None:
    with pytest.raises(ChatTemplateError):
        encode_golden(encode_messages, CHATS, case)


def test_the_golden_cases_cover_what_sets_v41_apart() -> None:
    prompts = [c["prompt"] for c in RENDERED]
    assert any("<｜DSML｜ calls>" in p and "<｜DSML｜ invoke" in p for p in prompts)
    assert any("<｜User｜>Hello<｜Assistant｜></think>Hi!<｜end▁of▁sentence｜><｜System｜>" in p
               for p in prompts)  # fmt: skip
    efforts = {c["reasoning_effort"] for c in RENDERED}
    assert {1, 37, 100, "low", "high", "xhigh", "max", None} <= efforts


def test_an_image_is_refused_naming_why() -> None:
    with pytest.raises(ChatTemplateError, match="no vision encoder"):
        encode_messages(CHATS["image_block"], "chat")
    with pytest.raises(ChatTemplateError, match="image placeholder"):
        encode_messages([{"role": "user", "content": f"a {IMAGE_PLACEHOLDER}"}], "chat")


@pytest.mark.parametrize(
    ("effort", "budget"),
    [(None, 75), ("low", 50), ("high", 75), ("xhigh", 75), ("max", 100), (1, 1), (100, 100)],
)
def test_effort_budgets(effort: Any, budget: int) -> None:
    assert effort_budget(effort) == budget
    text = encode_messages([{"role": "user", "content": "Q"}], "thinking", reasoning_effort=effort)
    assert text.startswith(f"<｜begin▁of▁sentence｜>{SYSTEM}Reasoning Effort: {budget} (range")


@pytest.mark.parametrize("bad", [0, 101, "medium", "none", True, 2.5, "50"])
def test_a_bad_effort_names_the_accepted_ones(bad: Any) -> None:
    with pytest.raises(ChatTemplateError, match="from 1 to 100 or one of low, high, xhigh, max"):
        encode_messages(CHATS["user_only"], "chat", reasoning_effort=bad)


def test_the_inputs_are_left_as_they_were() -> None:
    chat = CHATS["tool_round_trip"]
    copy = json.loads(json.dumps(chat))
    encode_messages(copy, "thinking")
    assert copy == chat


@pytest.mark.parametrize("mode", ["chat", "thinking"])
def test_a_parsed_turn_encodes_to_its_text(mode: str) -> None:
    chat = CHATS["tool_argument_types"]
    turn = 2  # the assistant's call
    text = encode_messages(chat[turn : turn + 1], mode, context=chat[:turn])
    assert text.endswith(EOS) and "<｜DSML｜ parameter" in text
    parsed = parse_completion(text, mode, V41_BLOCK)
    assert parsed["tool_calls"]
    assert encode_messages([parsed], mode, context=chat[:turn]) == text
