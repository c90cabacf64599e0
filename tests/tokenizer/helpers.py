"""A small byte-level BPE tokenizer with a model's special tokens, written to a directory as
a Hugging Face checkpoint writes it (tokenizer.json, tokenizer_config.json, and optionally
chat_template.jinja, config.json, generation_config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).parent
GLM46_TEMPLATE = (HERE / "glm46_chat_template.jinja").read_text(encoding="utf-8")
FEATURES_TEMPLATE = (HERE / "features_chat_template.jinja").read_text(encoding="utf-8")
TOOL_USE_TEMPLATE = (HERE / "tool_use_chat_template.jinja").read_text(encoding="utf-8")

GLM_SPECIALS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
    "/nothink",
)
DSV32_SPECIALS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
)
# DeepSeek-V4 adds the latest-reminder role's token to V3.2's.
DSV4_SPECIALS = (*DSV32_SPECIALS, "<｜latest_reminder｜>")
DSV41_SPECIALS = (*DSV4_SPECIALS, "<｜System｜>", "<｜deepseek_image｜>")
CORPUS = [
    "Hello, world! The weather in Paris tomorrow is sunny; Beijing: 晴, 多云, 小雨.",
    "You are a helpful assistant. What is 2+2? It is 4. function_calls invoke parameter",
    '{"location": "Hangzhou", "date": "2024-01-16", "temperature": -2} <result></result>',
    "tool_call arg_key arg_value tool_response observation system user assistant think",
] * 4


def train_tokenizer(specials: tuple[str, ...], vocab_size: int = 420) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_model_dir(
    path: Path,
    specials: tuple[str, ...],
    tokenizer_config: dict[str, Any],
    *,
    chat_template_file: str | None = None,
    config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    train_tokenizer(specials).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, ensure_ascii=False))
    if chat_template_file is not None:
        (path / "chat_template.jinja").write_text(chat_template_file, encoding="utf-8")
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def glm_tokenizer_config(**extra: Any) -> dict[str, Any]:
    """GLM-4.5/4.6/5's shape: eos and pad <|endoftext|>, no BOS (the template writes
    [gMASK]<sop>)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        **extra,
    }


def added_token(content: str, special: bool = True) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def dsv32_tokenizer_config() -> dict[str, Any]:
    """DeepSeek-V3.2's shape (its tokenizer_config.json): specials as AddedToken objects, no
    chat template."""

    def token(content: str) -> dict[str, Any]:
        return {
            "__type": "AddedToken",
            "content": content,
            "lstrip": False,
            "normalized": True,
            "rstrip": False,
            "single_word": False,
        }

    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": token("<｜begin▁of▁sentence｜>"),
        "eos_token": token("<｜end▁of▁sentence｜>"),
        "pad_token": token("<｜end▁of▁sentence｜>"),
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 131072,
        "unk_token": None,
        "tokenizer_class": "LlamaTokenizerFast",
    }


def golden_id(case: dict[str, Any]) -> str:
    """A golden case's test id: its chat, mode and whatever it sets besides the defaults."""
    parts = [case["chat"], case["thinking_mode"]]
    if "encoded_last" in case:
        parts.append(f"last{case['encoded_last']}")
    if not case["drop_thinking"]:
        parts.append("keep")
    if not case["add_bos"]:
        parts.append("nobos")
    if case.get("reasoning_effort") is not None:
        parts.append(str(case["reasoning_effort"]))
    return "-".join(parts)


def encode_golden(
    encode: Any, chats: dict[str, list[dict[str, Any]]], case: dict[str, Any], **kwargs: Any
) -> str:
    """A golden case encoded as the reference encoded it: with ``encoded_last`` k, the chat's
    last k messages after the rest as context; its reasoning effort where it names one."""
    chat = chats[case["chat"]]
    k = case.get("encoded_last", len(chat))
    if "reasoning_effort" in case:
        kwargs["reasoning_effort"] = case["reasoning_effort"]
    return encode(
        chat[len(chat) - k :], case["thinking_mode"], context=chat[: len(chat) - k],
        drop_thinking=case["drop_thinking"], add_bos=case["add_bos"], **kwargs,
    )  # fmt: skip
