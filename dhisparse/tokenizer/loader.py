from __future__ import annotations

from pathlib import Path

from dhisparse.tokenizer.base import Tokenizer
from dhisparse.tokenizer.byte_level import ByteTokenizer
from dhisparse.tokenizer.hf import HFTokenizer


def load_tokenizer(model_dir: str | Path | None) -> Tokenizer:
    """The model's tokenizer.json when it ships one, else the built-in byte tokenizer."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").exists():
        return HFTokenizer(model_dir)
    return ByteTokenizer()
