"""A raw prompt (``/v1/completions``, ``dhisparse generate``) gets the special tokens the
checkpoint's own rule adds, as transformers' ``AutoTokenizer`` on the same files gives them:
the post-processor of tokenizer.json (transformers 5 reads ``add_bos_token`` /
``add_eos_token`` of tokenizer_config.json only for a checkpoint without tokenizer.json). A
tokenizer that has a BOS token does not add it unless that rule says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from dhisparse.tokenizer import ByteTokenizer, HFTokenizer
from tests.tokenizer.helpers import DSV32_SPECIALS, train_tokenizer

BOS, EOS = DSV32_SPECIALS[0], DSV32_SPECIALS[1]
TEXTS = ("Hello, world!", "The weather in Paris", " leading space", "")

# name -> (tokenizer_config.json beyond the special tokens, tokenizer.json's post-processor)
CHECKPOINTS = {
    "add_bos_token false, no post-processor": ({"add_bos_token": False}, None),
    "a post-processor adding BOS": ({}, "bos"),
    "add_bos_token true, no post-processor": ({"add_bos_token": True}, None),
    "add_bos_token false, a post-processor adding BOS": ({"add_bos_token": False}, "bos"),
    "a post-processor adding BOS and EOS": ({"add_eos_token": False}, "bos+eos"),
}


def write_checkpoint(path: Path, config: dict, post: str | None) -> Path:
    """A tokenizer.json with ``post`` (None, "bos", "bos+eos") as its TemplateProcessing and a
    tokenizer_config.json naming BOS and EOS, plus ``config``."""
    path.mkdir()
    tok = train_tokenizer(DSV32_SPECIALS)
    if post is not None:
        tail = f" {EOS}" if post == "bos+eos" else ""
        specials = [(BOS, tok.token_to_id(BOS)), (EOS, tok.token_to_id(EOS))]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A{tail}", pair=f"{BOS} $A {BOS} $B{tail}",
            special_tokens=specials[: 1 + bool(tail)],
        )  # fmt: skip
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg | config, ensure_ascii=False))
    return path


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_raw_prompt_gets_what_transformers_adds(tmp_path: Path, name: str) -> None:
    config, post = CHECKPOINTS[name]
    path = write_checkpoint(tmp_path / "ckpt", config, post)
    theirs = AutoTokenizer.from_pretrained(path)
    ours = HFTokenizer(path)
    assert ours.bos_token_id is not None
    for text in TEXTS:
        assert ours.encode_prompt(text) == theirs(text)["input_ids"], text
    first = ours.encode_prompt(TEXTS[0])[0]
    assert (first == ours.bos_token_id) == (post is not None)


def test_the_byte_tokenizer_keeps_its_bos() -> None:
    tok = ByteTokenizer()
    assert tok.encode_prompt("ab") == [tok.bos_token_id, 97, 98]
