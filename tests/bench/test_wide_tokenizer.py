"""The real-vocabulary-size tokenizer of the benchmarks (``bench.wide_tokenizer``): trained on
the standard library's texts to exactly the ids asked for, read back from its cache, and a
tokenizer the engine's grammars compile against (few special ids, unlike the byte tokenizer
padded to a real model's logits)."""

from __future__ import annotations

from bench.wide_tokenizer import stdlib_texts, wide_tokenizer
from services.worker.request.grammar_vocab import tokenizer_info

IDS = 4096


def test_trained_to_the_size_asked_and_cached(tmp_path) -> None:
    tok = wide_tokenizer(IDS, tmp_path)
    assert tok.vocab_size == IDS
    text = "def f(x):\n    return {'a': [1, 2.5]}\n"
    assert tok.decode(tok.encode(text)) == text
    (made,) = list(tmp_path.iterdir())
    again = wide_tokenizer(IDS, tmp_path)  # read from the cache: the same vocabulary
    assert list(tmp_path.iterdir()) == [made]
    assert again.encode(text) == tok.encode(text)


def test_its_grammar_vocabulary_has_few_special_ids(tmp_path) -> None:
    tok = wide_tokenizer(IDS, tmp_path)
    info = tokenizer_info(tok, IDS + 64, [tok.eos_token_id])
    # the tokenizer's own specials and the logits' padding past it, nothing else
    assert len(info.special_token_ids) <= 64 + 16
    assert len(stdlib_texts()) > 100
