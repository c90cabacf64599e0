"""The output's incremental text keeps or skips special tokens as the request asks (a reply
format whose markers are special tokens needs them kept)."""

from __future__ import annotations

import pytest

from dhisparse.tokenizer import load_tokenizer
from services.worker.request.request import SamplingParams

MODEL_DIR = "models/glm-dsa-mini"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(skip: bool) -> None:
    tok = load_tokenizer(MODEL_DIR)
    special = next(i for i in range(tok.vocab_size) if tok.is_special(i))
    ids = [*tok.encode("def f"), special, *tok.encode("(x):")]
    stream = SamplingParams(skip_special_tokens=skip).text_stream(tok, tok.encode("# a"))
    text = "".join(stream.push(t)[0] for t in ids) + stream.finish()
    marker = tok.token_text(special)
    assert text == ("def f(x):" if skip else f"def f{marker}(x):")
