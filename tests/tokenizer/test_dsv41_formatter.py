"""A DeepSeek-V4.1 checkpoint without a chat template gets DeepSeek-V4.1's format: the
checkpoint is told apart as SGLang tells it (``model_type`` deepseek_v41, or a first
architecture naming DeepseekV41), the request's efforts reach the encoder as SGLang's API maps
them, and the prompt tokenizes as transformers tokenizes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from dhisparse.tokenizer import (
    ChatTemplateError,
    DeepseekV4Formatter,
    DeepseekV41Formatter,
    chat_formatter,
)
from dhisparse.tokenizer.encoding_dsv41 import encode_messages
from dhisparse.tokenizer.hf_files import chat_family
from dhisparse.tokenizer.loader import load_tokenizer
from dhisparse.tokenizer.reply import reply_style

from .helpers import DSV41_SPECIALS, dsv32_tokenizer_config, write_model_dir

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
]
BOS = "<｜begin▁of▁sentence｜>"


def _dir(root: Path, config: dict[str, Any]) -> Path:
    return write_model_dir(root, DSV41_SPECIALS, dsv32_tokenizer_config(), config=config)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _dir(tmp_path_factory.mktemp("dsv41"), {"model_type": "deepseek_v41"})


@pytest.fixture(scope="module")
def fmt(model_dir: Path) -> DeepseekV41Formatter:
    formatter = chat_formatter(load_tokenizer(model_dir), model_dir)
    assert isinstance(formatter, DeepseekV41Formatter)
    return formatter


@pytest.mark.parametrize(
    ("config", "family"),
    [({"model_type": "deepseek_v41"}, "deepseek_v41"),
     ({"model_type": "deepseek_v4", "architectures": ["DeepseekV41ForCausalLM"]}, "deepseek_v41"),
     ({"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]}, "deepseek_v4"),
     ({"model_type": "deepseek_v4", "kv_source_layer_ids": [0]}, "deepseek_v4")],
    ids=["model-type", "architecture", "v4", "v4.1-fields-alone"],
)  # fmt: skip
def test_a_v41_checkpoint_is_told_apart(
    tmp_path: Path, config: dict[str, Any], family: str
) -> None:
    model_dir = _dir(tmp_path, config)
    assert chat_family(model_dir) == family
    formatter = chat_formatter(load_tokenizer(model_dir), model_dir)
    v41 = family == "deepseek_v41"
    assert isinstance(formatter, DeepseekV41Formatter if v41 else DeepseekV4Formatter)
    assert reply_style(family) == ("deepseek_v4_1" if v41 else "deepseek_v4")


def test_the_prompt_tokenizes_as_transformers_does(
    fmt: DeepseekV41Formatter, model_dir: Path
) -> None:
    prompt = fmt.render(CHAT, tools=[WEATHER])
    assert prompt == encode_messages([{**CHAT[0], "tools": [WEATHER]}, CHAT[1]], "thinking")
    want = PreTrainedTokenizerFast.from_pretrained(model_dir).encode(
        prompt, add_special_tokens=False
    )
    assert fmt.encode(CHAT, tools=[WEATHER]) == want
    assert want[0] == fmt.tokenizer.bos_token_id


def test_tools_get_a_system_message_only_when_the_chat_has_none(
    fmt: DeepseekV41Formatter,
) -> None:
    alone = fmt.render(CHAT[1:], tools=[WEATHER], thinking=False)
    assert alone.startswith(BOS + "<｜System｜>\n\n## Tools\n")
    assert (
        fmt.render(CHAT[1:], thinking=False)
        == BOS + "<｜User｜>Weather in Paris?<｜Assistant｜></think>"
    )


@pytest.mark.parametrize(
    ("effort", "budget"),
    [(None, 75), ("minimal", 75), ("low", 50), ("medium", 75), ("high", 75), ("xhigh", 75),
     ("max", 100), (1, 1), (37, 37), (100, 100)],
)  # fmt: skip
def test_efforts_map_as_sglangs_api_maps_them(
    fmt: DeepseekV41Formatter, effort: Any, budget: int
) -> None:
    prompt = fmt.render(CHAT, reasoning_effort=effort)
    assert prompt.startswith(f"{BOS}<｜System｜>Reasoning Effort: {budget} (range 1-100")
    assert prompt == encode_messages(CHAT, "thinking", reasoning_effort=budget)
    # The effort is a thinking prompt's: without thinking it adds nothing.
    assert fmt.render(CHAT, reasoning_effort=effort, thinking=False) == encode_messages(
        CHAT, "chat"
    )


def test_none_turns_thinking_off(fmt: DeepseekV41Formatter) -> None:
    assert fmt.render(CHAT, reasoning_effort="none") == encode_messages(CHAT, "chat")
    assert fmt.render(CHAT, reasoning_effort="none", thinking=True) == encode_messages(
        CHAT, "thinking"
    )


@pytest.mark.parametrize("bad", ["extreme", 0, 101, True, 0.5, "50"])
def test_a_bad_effort_names_the_accepted_ones(fmt: DeepseekV41Formatter, bad: Any) -> None:
    with pytest.raises(ChatTemplateError) as e:
        fmt.render(CHAT, reasoning_effort=bad)
    assert "none, minimal, low, medium, high, xhigh, max or an integer from 1 to 100" in str(
        e.value
    )


def test_an_image_is_a_template_error(fmt: DeepseekV41Formatter) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(ChatTemplateError, match="no vision encoder"):
        fmt.render([{"role": "user", "content": [image]}])
