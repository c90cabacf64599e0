"""A tokenizer of a real model's vocabulary size for the real-dimension presets, whose random
weights come without one (the worker serves them with the byte tokenizer, 256 byte ids and the
rest of the logits' width as padding): byte-level BPE (``training.corpus.bpe``) trained on this
interpreter's standard library, every file of it that reads as UTF-8 text, to ``VOCAB`` tokens.

Grammar work depends on the vocabulary: xgrammar takes every id without text for a special
token, and a matcher's accept looks through the special ids, so the byte tokenizer's 129,024
padding ids make each accept about twenty times dearer than a 128K vocabulary's (and the masks'
fill dearer too). ``bench grammar-cost`` measures a preset's constrained step with this one."""

from __future__ import annotations

import platform
import sysconfig
from pathlib import Path

from dhisparse.tokenizer.hf import HFTokenizer
from training.corpus.bpe import train_bpe, write_tokenizer_dir

VOCAB = 128_000  # DeepSeek-V3's vocabulary ("128K tokens"); the logits' other ids are padding
MAX_FILE_BYTES = 2_000_000
CACHE = Path.home() / ".cache" / "dhisparse" / "bench-tokenizers"


def stdlib_texts() -> list[str]:
    """Every file of this interpreter's standard library (site-packages and caches left out)
    that reads as UTF-8 text, in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for p in sorted(root.rglob("*")):
        skip = {"site-packages", "dist-packages", "__pycache__"} & set(p.parts)
        if skip or not p.is_file() or p.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            texts.append(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def wide_tokenizer(vocab: int = VOCAB, cache: Path = CACHE) -> HFTokenizer:
    """The BPE tokenizer of ``vocab`` ids (trained once per interpreter version, then read
    from ``cache``); raises ValueError when the standard library yields fewer merges."""
    out = cache / f"stdlib-bpe-{vocab}-py{platform.python_version()}"
    if not (out / "tokenizer.json").exists():
        write_tokenizer_dir(train_bpe(stdlib_texts(), vocab), out)
    return HFTokenizer(out)
