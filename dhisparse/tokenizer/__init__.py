"""Tokenizers and chat formats shared by the gateway (prompts) and the worker (detokenizing)."""

from dhisparse.tokenizer.base import Tokenizer
from dhisparse.tokenizer.byte_level import ByteTokenizer
from dhisparse.tokenizer.chat import ChatTemplateError, render_chat
from dhisparse.tokenizer.detokenize import IncrementalDetokenizer
from dhisparse.tokenizer.formatter import (
    ChatFormatter,
    DeepseekV4Formatter,
    DeepseekV32Formatter,
    DeepseekV41Formatter,
    TemplateFormatter,
    chat_formatter,
)
from dhisparse.tokenizer.hf import HFTokenizer
from dhisparse.tokenizer.loader import load_tokenizer

__all__ = [
    "ByteTokenizer",
    "ChatFormatter",
    "ChatTemplateError",
    "DeepseekV4Formatter",
    "DeepseekV32Formatter",
    "DeepseekV41Formatter",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "TemplateFormatter",
    "Tokenizer",
    "chat_formatter",
    "load_tokenizer",
    "render_chat",
]
