"""Training data from a corpus file: the train/held-out split, random training crops and the
fixed held-out windows.

The held-out part is the shortest run of whole files at the end of the corpus holding at
least ``HELDOUT_FRAC`` of its bytes. Bytes are tokens (the byte tokenizer maps byte b to id b),
except the file separator, which reads as ``<eos>``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from dhisparse.tokenizer import ByteTokenizer
from training.target.corpus import SEPARATOR, meta_path

HELDOUT_FRAC = 0.01
EOS = ByteTokenizer().eos_token_id


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
    """[batch, length] int64 tokens: random crops of ``stream`` (uint8, any device), their
    starts drawn from ``gen`` (a CPU generator: the same draws on every device)."""
    starts = torch.randint(0, len(stream) - length + 1, (batch,), generator=gen)
    offs = torch.arange(length)
    idx = (starts.unsqueeze(1) + offs).to(stream.device)
    return to_tokens(stream[idx])


def heldout_windows(stream: torch.Tensor, length: int, max_tokens: int) -> torch.Tensor:
    """[N, length] consecutive windows overlapping by one token (the last input of one is the
    first target of the next), so every held-out byte after the first is predicted once; at
    most ``max_tokens`` predictions. The tail shorter than a window is dropped."""
    step = length - 1
    n = min((len(stream) - 1) // step, max(1, max_tokens // step))
    if n < 1:
        raise ValueError(f"held-out part ({len(stream)} bytes) is shorter than one window")
    idx = torch.arange(n).unsqueeze(1) * step + torch.arange(length)
    return to_tokens(stream[idx.to(stream.device)])
