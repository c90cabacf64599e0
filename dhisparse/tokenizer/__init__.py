"""Tokenizers and chat templates shared by the gateway (prompts) and the worker (detokenizing)."""

from dhisparse.tokenizer.base import Tokenizer
from dhisparse.tokenizer.byte_level import ByteTokenizer
from dhisparse.tokenizer.chat import ChatTemplateError, render_chat
from dhisparse.tokenizer.detokenize import IncrementalDetokenizer
from dhisparse.tokenizer.hf import HFTokenizer
from dhisparse.tokenizer.loader import load_tokenizer

__all__ = [
    "ByteTokenizer",
    "ChatTemplateError",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Tokenizer",
    "load_tokenizer",
    "render_chat",
]
