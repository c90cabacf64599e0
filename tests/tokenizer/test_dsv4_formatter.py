"""A DeepSeek-V4 checkpoint without a chat template gets DeepSeek-V4's format: the request's
thinking switches, reasoning effort and tools reach the encoder as DeepSeek's API reads them,
and the prompt tokenizes as transformers tokenizes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from dhisparse.tokenizer import ChatTemplateError, DeepseekV4Formatter, chat_formatter
from dhisparse.tokenizer.encoding_dsv4 import (
    ABSOLUTE_MAXIMUM,
    BEYOND_MAXIMUM,
    EFFORTS_0731,
    PREVIEW_EFFORTS,
    encode_messages,
)
from dhisparse.tokenizer.formatter import V4_ENCODER, v4_efforts
from dhisparse.tokenizer.loader import load_tokenizer
from dhisparse.tokenizer.reply import reply_style

from .helpers import DSV4_SPECIALS, dsv32_tokenizer_config, write_model_dir

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Call it.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(
        tmp_path_factory.mktemp("dsv4"),
        DSV4_SPECIALS,
        dsv32_tokenizer_config(),
        config={"model_type": "deepseek_v4", "eos_token_id": 1},
    )


@pytest.fixture(scope="module")
def fmt(model_dir: Path) -> DeepseekV4Formatter:
    formatter = chat_formatter(load_tokenizer(model_dir), model_dir)
    assert isinstance(formatter, DeepseekV4Formatter)
    return formatter


def test_the_checkpoint_picks_v4s_format_and_reply_style(
    fmt: DeepseekV4Formatter, model_dir: Path
) -> None:
    assert reply_style("deepseek_v4") == "deepseek_v4"
    prompt = fmt.render(CHAT, tools=[WEATHER])
    want = PreTrainedTokenizerFast.from_pretrained(model_dir).encode(
        prompt, add_special_tokens=False
    )
    assert fmt.encode(CHAT, tools=[WEATHER]) == want
    assert want[0] == fmt.tokenizer.bos_token_id


def test_thinking_is_on_unless_turned_off(fmt: DeepseekV4Formatter) -> None:
    on = encode_messages(CHAT[:2], "thinking")
    off = encode_messages(CHAT[:2], "chat")
    assert on.endswith("<｜Assistant｜><think>") and off.endswith("<｜Assistant｜></think>")
    assert fmt.render(CHAT[:2]) == on
    for kw in ({"thinking": True}, {"enable_thinking": True}, {"thinking_mode": "thinking"}):
        assert fmt.render(CHAT[:2], **kw) == on
    for kw in (
        {"thinking": False},
        {"enable_thinking": False},
        {"thinking_mode": "chat"},
        {"reasoning_effort": "none"},
    ):
        assert fmt.render(CHAT[:2], **kw) == off
    with pytest.raises(ChatTemplateError, match="thinking must be true or false"):
        fmt.render(CHAT[:2], thinking="yes")


@pytest.mark.parametrize(
    ("effort", "prefixed"),
    [(None, False), ("low", False), ("medium", False), ("high", False), ("xhigh", True),
     ("max", True)],
)  # fmt: skip
def test_reasoning_effort_maps_as_deepseeks_api_maps_it(
    fmt: DeepseekV4Formatter, effort: str | None, prefixed: bool
) -> None:
    prompt = fmt.render(CHAT[:2], reasoning_effort=effort)
    assert prompt.startswith("<｜begin▁of▁sentence｜>" + ABSOLUTE_MAXIMUM) == prefixed
    assert prompt.removeprefix("<｜begin▁of▁sentence｜>").removeprefix(
        ABSOLUTE_MAXIMUM
    ) == encode_messages(CHAT[:2], "thinking").removeprefix("<｜begin▁of▁sentence｜>")
    # Think Max is a thinking prompt's: without thinking the effort adds nothing.
    assert fmt.render(CHAT[:2], reasoning_effort=effort, thinking=False) == encode_messages(
        CHAT[:2], "chat"
    )


def test_an_unknown_effort_is_a_template_error(fmt: DeepseekV4Formatter) -> None:
    with pytest.raises(ChatTemplateError, match="reasoning_effort must be one of"):
        fmt.render(CHAT[:2], reasoning_effort="extreme")


def test_tools_join_the_leading_system_message(fmt: DeepseekV4Formatter) -> None:
    assert fmt.render(CHAT, tools=[WEATHER]) == encode_messages(
        [{**CHAT[0], "tools": [WEATHER]}, *CHAT[1:]], "thinking"
    )
    alone = fmt.render(CHAT[1:], tools=[WEATHER])
    assert alone.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n")
    assert alone.endswith("<｜User｜><tool_result>sunny</tool_result><｜Assistant｜><think>")


def test_drop_thinking_follows_the_kwarg(fmt: DeepseekV4Formatter) -> None:
    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "r"},
        {"role": "user", "content": "c"},
    ]
    assert "r</think>" not in fmt.render(chat)
    assert fmt.render(chat, drop_thinking=False) == encode_messages(
        chat, "thinking", drop_thinking=False
    )
    assert "r</think>b" in fmt.render(chat, drop_thinking=False)


BOS = "<｜begin▁of▁sentence｜>"
# A V4 checkpoint's encoder as data: the release's effort table among code that never runs.
ENCODER_0731 = f"""
import json
def render_message(index, messages):
    raise RuntimeError("never run")
REASONING_EFFORT_PROMPTS = {{"low": "", "high": {ABSOLUTE_MAXIMUM!r}, "max": {BEYOND_MAXIMUM!r}}}
DEFAULT_REASONING_EFFORT: str = "low"
"""
ENCODER_PREVIEW = f"REASONING_EFFORT_MAX = ({ABSOLUTE_MAXIMUM!r})\n"


def _v4_dir(root: Path, config: dict[str, Any], encoder: str | None = None) -> Path:
    model_dir = write_model_dir(
        root, DSV4_SPECIALS, dsv32_tokenizer_config(),
        config={"model_type": "deepseek_v4", "eos_token_id": 1, **config},
    )  # fmt: skip
    if encoder is not None:
        (model_dir / V4_ENCODER).parent.mkdir(exist_ok=True)
        (model_dir / V4_ENCODER).write_text(encoder, encoding="utf-8")
    return model_dir


@pytest.mark.parametrize(
    ("config", "encoder", "table"),
    [({}, None, PREVIEW_EFFORTS), ({"dspark_num_layers": 1}, None, EFFORTS_0731),
     ({}, ENCODER_0731, EFFORTS_0731), ({"dspark_num_layers": 1}, ENCODER_PREVIEW,
     PREVIEW_EFFORTS)],
    ids=["first-release", "dspark-config", "0731-encoder", "the-encoder-wins"],
)  # fmt: skip
def test_the_checkpoint_names_its_effort_table(
    tmp_path: Path, config: dict[str, Any], encoder: str | None, table: Any
) -> None:
    model_dir = _v4_dir(tmp_path, config, encoder)
    assert v4_efforts(model_dir) == table
    formatter = chat_formatter(load_tokenizer(model_dir), model_dir)
    assert isinstance(formatter, DeepseekV4Formatter) and formatter.efforts == table


def test_an_encoder_of_other_texts_is_read_word_for_word(tmp_path: Path) -> None:
    encoder = 'REASONING_EFFORT_PROMPTS = {"low": "", "high": "Think hard.\\n\\n"}\n'
    encoder += 'DEFAULT_REASONING_EFFORT = "high"\n'
    model_dir = _v4_dir(tmp_path, {}, encoder)
    fmt = chat_formatter(load_tokenizer(model_dir), model_dir)
    assert fmt.render(CHAT[:2]).startswith(BOS + "Think hard.\n\nBe terse.")
    assert fmt.render(CHAT[:2], reasoning_effort="low") == encode_messages(CHAT[:2], "thinking")


@pytest.mark.parametrize(
    ("encoder", "match"),
    [("REASONING_EFFORT_PROMPTS = {", "does not parse"),
     ("X = 1\n", "defines no effort table"),
     ('REASONING_EFFORT_PROMPTS = {"low": 1}\nDEFAULT_REASONING_EFFORT = "low"\n',
      "maps names to texts"),
     ('REASONING_EFFORT_PROMPTS = {"low": ""}\nDEFAULT_REASONING_EFFORT = "max"\n',
      "default effort 'max' is not one of")],
)  # fmt: skip
def test_an_encoder_without_a_readable_table_is_a_start_up_error(
    tmp_path: Path, encoder: str, match: str
) -> None:
    model_dir = _v4_dir(tmp_path, {}, encoder)
    with pytest.raises(ValueError, match=match) as e:
        chat_formatter(load_tokenizer(model_dir), model_dir)
    assert "encoding_dsv4.py" in str(e.value)


@pytest.mark.parametrize(
    ("effort", "text"),
    [(None, ""), ("none", None), ("minimal", ""), ("low", ""), ("medium", ""),
     ("high", ABSOLUTE_MAXIMUM), ("xhigh", BEYOND_MAXIMUM), ("max", BEYOND_MAXIMUM)],
)  # fmt: skip
def test_0731s_efforts_from_openais(model_dir: Path, effort: str | None, text: str | None) -> None:
    fmt = DeepseekV4Formatter(load_tokenizer(model_dir), EFFORTS_0731)
    prompt = fmt.render(CHAT[:2], reasoning_effort=effort)
    if text is None:  # "none": thinking off
        assert prompt == encode_messages(CHAT[:2], "chat")
        return
    assert prompt == BOS + text + encode_messages(CHAT[:2], "thinking").removeprefix(BOS)
    assert fmt.render(CHAT[:2], reasoning_effort=effort, thinking=False) == encode_messages(
        CHAT[:2], "chat"
    )
    with pytest.raises(ChatTemplateError, match="none, minimal, low, medium, high, xhigh, max"):
        fmt.render(CHAT[:2], reasoning_effort="extreme")
