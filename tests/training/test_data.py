"""The corpus file is deterministic and self-checking; the held-out part is whole files at
the end; crops and held-out windows read it as byte tokens with <eos> between files."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.training.helpers import small_corpus
from training.target.corpus import SEPARATOR, build_corpus, meta_path, source_files
from training.target.data import (
    EOS,
    heldout_start,
    heldout_windows,
    load_corpus,
    sample_crops,
    to_tokens,
)


def test_stdlib_corpus_is_deterministic_and_excludes_third_party_code(tmp_path: Path) -> None:
    a = build_corpus(tmp_path / "a.u8")
    b = build_corpus(tmp_path / "b.u8")
    assert a == b
    assert (tmp_path / "a.u8").read_bytes() == (tmp_path / "b.u8").read_bytes()
    data = (tmp_path / "a.u8").read_bytes()
    assert a["sha256"] == hashlib.sha256(data).hexdigest() and a["bytes"] == len(data)
    assert data.count(bytes([SEPARATOR])) == a["files"] > 500
    assert json.loads(meta_path(tmp_path / "a.u8").read_text()) == a
    names = source_files(Path(sysconfig.get_paths()["stdlib"]))
    assert names == sorted(names) and len(names) == a["files"]
    assert not any(n.startswith(("site-packages/", "encodings/")) for n in names)
    assert "os.py" in names and "json/decoder.py" in names


def test_corpus_split_holds_out_whole_files_at_the_end(tmp_path: Path) -> None:
    path = small_corpus(tmp_path)
    corpus = load_corpus(path)
    raw = path.read_bytes()
    assert bytes(corpus.train.numpy()) + bytes(corpus.heldout.numpy()) == raw
    assert corpus.train[-1] == SEPARATOR and corpus.heldout[-1] == SEPARATOR
    assert corpus.heldout_files >= 1 and len(corpus.heldout) >= 0.01 * len(raw)
    ends = np.array([10, 50, 60, 100, 1000])
    assert heldout_start(ends, 0.01) == (100, 1)
    assert heldout_start(ends, 0.95) == (50, 3)
    assert heldout_start(ends, 0.999) == (10, 4)  # at least one file stays in train


def test_a_corpus_that_does_not_match_its_json_is_refused(tmp_path: Path) -> None:
    path = small_corpus(tmp_path)
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match"):
        load_corpus(path)


def test_crops_and_windows_are_byte_tokens_with_eos_between_files() -> None:
    stream = to_tokens(torch.tensor(list(b"ab\0cde\0fgh\0"), dtype=torch.uint8)).int()
    crops = sample_crops(stream, 6, 4, torch.Generator().manual_seed(0))
    again = sample_crops(stream, 6, 4, torch.Generator().manual_seed(0))
    assert torch.equal(crops, again) and crops.shape == (6, 4) and crops.dtype == torch.int64
    assert set(crops.flatten().tolist()) <= {*b"abcdefgh", EOS}
    win = heldout_windows(stream, 4, max_tokens=100)
    assert win.tolist() == [
        [97, 98, EOS, 99],
        [99, 100, 101, EOS],
        [EOS, 102, 103, 104],
    ]  # windows overlap by one: every byte after the first is a target once
    assert heldout_windows(stream, 4, max_tokens=3).shape == (1, 4)
