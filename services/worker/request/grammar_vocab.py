"""A tokenizer's vocabulary as xgrammar reads it (``xgrammar.TokenizerInfo``): the text each
token adds to the output, the stop tokens, and the width of the model's logits."""

from __future__ import annotations

from collections.abc import Collection

import xgrammar as xgr

from dhisparse.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def tokenizer_info(
    tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Collection[int]
) -> xgr.TokenizerInfo:
    """``tokenizer``'s vocabulary for masks of ``vocab_size`` tokens (the model's logits width,
    at least the tokenizer's). Special tokens are given no text, so xgrammar never allows them
    except the ``stop_token_ids``, which it allows once the grammar is complete; ids past the
    tokenizer's vocabulary are never allowed. Raises ValueError for a tokenizer it cannot read."""
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"logits of {vocab_size} tokens cannot cover the tokenizer's {tokenizer.vocab_size}"
        )
    stops = sorted(stop_token_ids)
    if isinstance(tokenizer, ByteTokenizer):
        raw: list[bytes | str] = [bytes([i]) for i in range(256)]
        raw += [""] * (vocab_size - 256)
        return xgr.TokenizerInfo(
            raw, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops
        )
    if isinstance(tokenizer, HFTokenizer):
        backend = tokenizer.backend
        # the encoded vocabulary, as transformers' fast tokenizers give it to xgrammar
        # (``TokenizerInfo.from_huggingface``), with the special tokens' text taken out
        encoded: list[bytes | str] = [""] * vocab_size
        for text, i in backend.get_vocab(with_added_tokens=True).items():
            if i < vocab_size and not tokenizer.is_special(i):
                encoded[i] = text
        # vocab type and prefix space read from tokenizer.json by xgrammar's own detector, the
        # one from_huggingface uses (that entry point wants a transformers tokenizer)
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())  # noqa: SLF001
        return xgr.TokenizerInfo(
            encoded, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=stops,
            add_prefix_space=meta["add_prefix_space"],
        )  # fmt: skip
    raise ValueError(f"grammars are not supported with a {type(tokenizer).__name__} tokenizer")
