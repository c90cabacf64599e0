"""The model's tokenizer: byte-level BPE trained on the training documents, written as a
Hugging Face tokenizer directory that transformers and ``dhisparse.tokenizer`` both read.

The directory: ``tokenizer.json`` (BPE over GPT-2's byte alphabet, ByteLevel pre-tokenizer
without a prefix space and its decoder, no normalizer), ``tokenizer_config.json``
(``PreTrainedTokenizerFast``, eos and pad ``<|endoftext|>``, no BOS, ``added_tokens_decoder``)
and ``chat_template.jinja`` (this package's copy of GLM-4.7's, which thinks only when
``enable_thinking`` is true: the model is trained on code, not on reasoning). The special
tokens are GLM's and take the last ids, after the 256 bytes and the merges, as in GLM's
vocabularies.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from dhisparse.tokenizer import hf_files
from training.corpus.chunks import cut
from training.corpus.documents import Document

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (
    EOS_TOKEN,
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
)
VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 4096
# GLM-4.7's released chat template (GLM-5's family: tools, reasoning, [gMASK]<sop>); with this
# vocabulary its <think>, <tool_call> and the like are plain text.
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text(encoding="utf-8")


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte -> the byte.
    Printable Latin-1 bytes stand for themselves; the rest map to 256 and up, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def train_bpe(
    texts: Sequence[str], vocab_size: int = VOCAB_SIZE, progress: bool = False
) -> Tokenizer:
    """A BPE tokenizer of exactly ``vocab_size`` ids (specials included) trained on
    ``texts``; a corpus too small to yield that many merges is an error."""
    n_merged = vocab_size - len(SPECIAL_TOKENS)
    if n_merged <= 256:
        raise ValueError(f"vocab size {vocab_size} leaves no room for merges")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_merged,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=progress,
    )
    pieces = [p for text in texts for p in cut(text)]
    tok.train_from_iterator(pieces, trainer, length=len(pieces))
    got = tok.get_vocab_size()
    if got != n_merged:
        raise ValueError(
            f"the training texts yield {got} tokens, not {n_merged}: the corpus is too small "
            f"for vocab size {vocab_size}"
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _added_token(content: str) -> dict[str, object]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def write_tokenizer_dir(
    tok: Tokenizer, out: str | Path, model_max_length: int = MODEL_MAX_LENGTH
) -> Path:
    """Writes ``tok`` with its config and chat template to the directory ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(tok.token_to_id(t)): _added_token(t) for t in SPECIAL_TOKENS},
    }
    (out / hf_files.TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (out / hf_files.CHAT_TEMPLATE_FILE).write_text(CHAT_TEMPLATE, encoding="utf-8")
    return out


def train_tokenizer(
    documents: Sequence[Document],
    out: str | Path,
    vocab_size: int = VOCAB_SIZE,
    model_max_length: int = MODEL_MAX_LENGTH,
    progress: bool = False,
) -> Path:
    """The tokenizer directory ``out``, trained on ``documents``' texts."""
    tok = train_bpe([d.text for d in documents], vocab_size, progress)
    return write_tokenizer_dir(tok, out, model_max_length)


def corpus_encoder(tokenizer_dir: str | Path) -> Tokenizer:
    """The directory's tokenizer for corpus text: special-token strings in the text (source
    code quotes ``<|endoftext|>``) are encoded as the text they are, never as specials."""
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    tok.encode_special_tokens = True
    return tok


def eos_id(tokenizer_dir: str | Path) -> int:
    """The id of the config's ``eos_token``."""
    tokenizer_dir = Path(tokenizer_dir)
    text = hf_files.special_tokens(hf_files.tokenizer_config(tokenizer_dir)).get("eos_token")
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    found = tok.token_to_id(text) if text else None
    if found is None:
        raise ValueError(f"{tokenizer_dir}: no eos_token in the vocabulary")
    return found


def token_byte_lengths(tokenizer_dir: str | Path) -> np.ndarray:
    """[vocab] int64: how many UTF-8 bytes of text each id stands for. A byte-level token is
    as many bytes as characters; a special token counts 0, except the eos (1: the separator
    between documents, so that a split's lengths sum to its recorded bytes); an added token
    that is not special is its content's bytes."""
    tokenizer_dir = Path(tokenizer_dir)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = eos_id(tokenizer_dir)
    alphabet = byte_alphabet()
    added = tok.get_added_tokens_decoder()
    vocab = tok.get_vocab(with_added_tokens=True)
    lengths = np.full(tok.get_vocab_size(with_added_tokens=True), -1, dtype=np.int64)
    for token, i in vocab.items():
        if i in added:
            special = added[i].special
            lengths[i] = (1 if i == eos else 0) if special else len(token.encode("utf-8"))
            continue
        if any(c not in alphabet for c in token):
            raise ValueError(f"{tokenizer_dir}: token {i} {token!r} is not byte-level")
        lengths[i] = len(token)
    if (lengths < 0).any():
        raise ValueError(f"{tokenizer_dir}: ids {np.flatnonzero(lengths < 0)[:8]} have no token")
    return lengths
