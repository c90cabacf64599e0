"""The held-out files of a shipped model's corpus as this machine's Python ships them, through
the model's own tokenizer: the prompts of the acceptance benchmark and the text of the
held-out bits-per-byte measurement.

The model's ``corpus.json`` names the held-out files (standard-library paths, kept out of
training); each is read from this interpreter's standard library, written as the corpus
writes a document (``document_text``) and encoded as the corpus encodes one (special-token
strings as text, the eos after it). This Python's copies may differ from the ones the corpus
was built from (its ``python`` field); ``HeldOut.python`` says which was read."""

from __future__ import annotations

import json
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from dhisparse.family.presets import PRESETS
from training.corpus.bpe import corpus_encoder, eos_id, token_byte_lengths
from training.corpus.chunks import cut
from training.corpus.documents import document_text

CORPUS_META = "corpus.json"
# the shipped model: its held-out ids are the prompts of a model without a corpus (a preset)
SHIPPED = "models/glm-dsa-mini"


@dataclass(frozen=True)
class HeldOut:
    stream: torch.Tensor  # [N] int64: the documents' ids, each followed by the eos
    byte_lengths: torch.Tensor  # [V] float32: the UTF-8 bytes each id stands for
    files: tuple[str, ...]
    bytes: int
    python: str  # the interpreter whose standard library was read
    corpus_python: str  # the one the corpus was built from


def heldout_of(model_dir: str | Path) -> HeldOut:
    """The held-out stream of ``model_dir`` (a release directory with ``corpus.json``)."""
    model_dir = Path(model_dir)
    meta_path = model_dir / CORPUS_META
    if not meta_path.exists():
        raise ValueError(f"{model_dir}: no {CORPUS_META} (not a trained release)")
    meta = json.loads(meta_path.read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    missing = [f for f in meta["heldout_files"] if not (root / f).is_file()]
    if missing:
        raise ValueError(f"{root}: the held-out files {missing} are not in this standard library")
    tok = corpus_encoder(model_dir)
    eos = eos_id(model_dir)
    ids: list[int] = []
    size = 0
    for name in meta["heldout_files"]:
        text = document_text([(name, (root / name).read_text(encoding="utf-8"))])
        for piece in cut(text):
            ids.extend(tok.encode(piece).ids)
        ids.append(eos)
        size += len(text.encode()) + 1
    return HeldOut(
        stream=torch.tensor(ids, dtype=torch.int64),
        byte_lengths=torch.as_tensor(token_byte_lengths(model_dir), dtype=torch.float32),
        files=tuple(meta["heldout_files"]),
        bytes=size,
        python=platform.python_version(),
        corpus_python=meta.get("python", "unknown"),
    )


def heldout_prompts(model_dir: str | Path, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` windows of ``length`` ids at seeded random offsets of the held-out stream."""
    held = heldout_of(model_dir).stream
    if len(held) <= length:
        raise ValueError(f"the held-out stream ({len(held)} ids) is not longer than {length}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(held) - length, (n,), generator=g).tolist()
    return [held[s : s + length].tolist() for s in starts]


def prompt_source(model: str, asked: str | None) -> str:
    """The model directory whose held-out ids a benchmark's prompts are: ``asked``, else
    ``model``, else (``model`` a preset, random weights without a corpus) the shipped model."""
    return asked or (SHIPPED if model in PRESETS else model)
