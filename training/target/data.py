"""Training data: the train / held-out token streams, random training crops and the fixed
held-out windows, from either corpus a run can train on:

- a byte corpus file (``corpus.py``): bytes are tokens (the byte tokenizer maps byte b to id
  b), except the file separator, which reads as ``<eos>``; the held-out part is the shortest
  run of whole files at the end holding at least ``HELDOUT_FRAC`` of its bytes;
- a token directory (``python -m training.corpus``): BPE tokens of whole documents, held-out
  files apart from the start.

Either way a ``TokenData`` holds int32 ids and the UTF-8 bytes each id stands for, so that a
held-out loss reads in bits per byte whatever the tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from dhisparse.tokenizer import ByteTokenizer
from training.corpus.bpe import token_byte_lengths
from training.corpus.tokens import TOKENIZER_DIR, load_tokens
from training.target.corpus import SEPARATOR, meta_path

HELDOUT_FRAC = 0.01
EOS = ByteTokenizer().eos_token_id


class TokenData(NamedTuple):
    train: torch.Tensor  # [N] int32 token ids
    heldout: torch.Tensor  # [M] int32, whole held-out files
    byte_lengths: torch.Tensor  # [V] float32: the UTF-8 bytes each id stands for
    sha256: str  # of the corpus (a resumed run must see the same)
    heldout_files: int


def load_token_data(path: str | Path) -> TokenData:
    """A token directory (its ``tokens.json``) or a byte corpus file."""
    path = Path(path)
    if path.is_dir():
        tokens = load_tokens(path)
        splits = tokens.meta["splits"]
        return TokenData(
            tokens.train,
            tokens.heldout,
            torch.as_tensor(token_byte_lengths(path / TOKENIZER_DIR), dtype=torch.float32),
            hashlib.sha256(
                f"{splits['train']['sha256']}:{splits['heldout']['sha256']}".encode()
            ).hexdigest(),
            len(tokens.meta["heldout_files"]),
        )
    corpus = load_corpus(path)
    ones = torch.ones(ByteTokenizer().vocab_size, dtype=torch.float32)  # the separator too
    return TokenData(
        to_tokens(corpus.train).to(torch.int32),
        to_tokens(corpus.heldout).to(torch.int32),
        ones,
        corpus.sha256,
        corpus.heldout_files,
    )


class Corpus(NamedTuple):
    train: torch.Tensor  # [N] uint8
    heldout: torch.Tensor  # [M] uint8, whole files after train
    sha256: str
    heldout_files: int


def load_corpus(path: str | Path, heldout_frac: float = HELDOUT_FRAC) -> Corpus:
    """Reads a corpus file written by ``corpus.build_corpus``, checking it against its JSON."""
    path = Path(path)
    data = np.fromfile(path, dtype=np.uint8)
    sha = hashlib.sha256(data.tobytes()).hexdigest()
    meta = json.loads(meta_path(path).read_text())
    if sha != meta["sha256"] or len(data) != meta["bytes"]:
        raise ValueError(f"{path} does not match {meta_path(path)} (sha256 or size differ)")
    ends = np.flatnonzero(data == SEPARATOR) + 1  # one past each file's separator
    split, files = heldout_start(ends, heldout_frac)
    stream = torch.from_numpy(data)
    return Corpus(stream[:split].clone(), stream[split:].clone(), sha, files)


def heldout_start(ends: np.ndarray, frac: float) -> tuple[int, int]:
    """The byte offset where held-out files begin and how many there are. ``ends``: [F] the
    offset one past each file (the last is the corpus size). At least one file stays in train."""
    total = int(ends[-1])
    starts = np.concatenate([[0], ends[:-1]])
    n = 1
    while n < len(ends) - 1 and total - starts[len(ends) - n] < frac * total:
        n += 1
    return int(starts[len(ends) - n]), n


def to_tokens(raw: torch.Tensor) -> torch.Tensor:
    """uint8 corpus bytes -> int64 token ids (the separator becomes ``<eos>``)."""
    ids = raw.long()
    return ids.masked_fill(raw == SEPARATOR, EOS)


def sample_crops(
    stream: torch.Tensor, batch: int, length: int, gen: torch.Generator
) -> torch.Tensor:
    """[batch, length] int64 tokens: random crops of ``stream`` (token ids, any device), their
    starts drawn from ``gen`` (a CPU generator: the same draws on every device)."""
    if len(stream) < length:
        raise ValueError(f"the training stream ({len(stream)} tokens) is shorter than {length}")
    starts = torch.randint(0, len(stream) - length + 1, (batch,), generator=gen)
    offs = torch.arange(length)
    idx = (starts.unsqueeze(1) + offs).to(stream.device)
    return stream[idx].long()


def heldout_windows(stream: torch.Tensor, length: int, max_tokens: int) -> torch.Tensor:
    """[N, length] consecutive windows overlapping by one token (the last input of one is the
    first target of the next), so every held-out byte after the first is predicted once; at
    most ``max_tokens`` predictions. The tail shorter than a window is dropped."""
    step = length - 1
    n = min((len(stream) - 1) // step, max(1, max_tokens // step))
    if n < 1:
        raise ValueError(f"held-out part ({len(stream)} tokens) is shorter than one window")
    idx = torch.arange(n).unsqueeze(1) * step + torch.arange(length)
    return stream[idx.to(stream.device)].long()
