"""The split encoded into token files, and their loader.

Layout of the output directory:

- ``train.bin`` / ``heldout.bin``: uint16 ids, the split's documents concatenated, each
  followed by the eos id;
- ``train_docs.npy`` / ``heldout_docs.npy``: [documents] int64, where each document starts;
- ``documents.json``: per split, each document's name, files, start, tokens and bytes;
- ``tokens.json``: vocab size, eos id, the tokenizer's sha256, per split its tokens,
  documents, bytes (UTF-8 bytes of the texts plus one per document for the separator) and the
  .bin's sha256; the held-out modules and files, the roots and the Python version.

Corpus text is encoded with special-token strings taken literally (``bpe.corpus_encoder``),
so the only special id in a .bin is the eos after each document.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from training.corpus.bpe import corpus_encoder, eos_id
from training.corpus.chunks import cut
from training.corpus.documents import HELDOUT_MODULES, Document, Split

DTYPE = np.uint16
SPLITS = ("train", "heldout")
BATCH_CHARS = 32 << 20  # text per encode_batch call: all cores busy, bounded memory
META = "tokens.json"
TOKENIZER_DIR = "tokenizer"  # beside the token files, where the build writes it
DOCUMENTS = "documents.json"


class TokenCorpus(NamedTuple):
    train: torch.Tensor  # [N] int32 token ids
    heldout: torch.Tensor  # [M] int32
    train_doc_starts: torch.Tensor  # [D] int64
    heldout_doc_starts: torch.Tensor  # [H] int64
    meta: dict[str, Any]


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def _batches(docs: Sequence[Document]) -> Iterator[list[Document]]:
    """Consecutive documents holding about ``BATCH_CHARS`` of text each."""
    batch: list[Document] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc.text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode_split(
    docs: Sequence[Document], tokenizer_dir: Path, out: Path, name: str, progress: bool
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Writes ``<name>.bin`` and ``<name>_docs.npy``; returns the split's entry of tokens.json
    and its documents' entries."""
    tok = corpus_encoder(tokenizer_dir)
    eos = eos_id(tokenizer_dir)
    if tok.get_vocab_size() > np.iinfo(DTYPE).max + 1:
        raise ValueError(f"vocab size {tok.get_vocab_size()} does not fit {DTYPE.__name__}")
    sha = hashlib.sha256()
    starts: list[int] = []
    entries: list[dict[str, Any]] = []
    total = 0
    bar = tqdm(
        total=sum(len(d.text) for d in docs),
        desc=f"encode {name}",
        unit="char",
        unit_scale=True,
        disable=not progress,
    )
    tmp = out / f"{name}.bin.tmp"
    with tmp.open("wb") as f:
        for batch in _batches(docs):
            pieces = [cut(d.text) for d in batch]
            encoded = iter(tok.encode_batch_fast([p for ps in pieces for p in ps]))
            for doc, ps in zip(batch, pieces, strict=True):
                parts = [np.asarray(next(encoded).ids, dtype=DTYPE) for _ in ps]
                ids = np.concatenate([*parts, np.asarray([eos], dtype=DTYPE)])
                data = ids.tobytes()
                f.write(data)
                sha.update(data)
                starts.append(total)
                entries.append(
                    {
                        "name": doc.name,
                        "files": list(doc.files),
                        "start": total,
                        "tokens": len(ids),
                        "bytes": doc.n_bytes,
                    }
                )
                total += len(ids)
                bar.update(len(doc.text))
    bar.close()
    os.replace(tmp, out / f"{name}.bin")
    np.save(out / f"{name}_docs.npy", np.asarray(starts, dtype=np.int64))
    meta = {
        "file": f"{name}.bin",
        "doc_starts": f"{name}_docs.npy",
        "tokens": total,
        "documents": len(docs),
        "bytes": sum(e["bytes"] for e in entries),
        "sha256": sha.hexdigest(),
    }
    return meta, entries


def write_tokens(
    split: Split,
    tokenizer_dir: str | Path,
    out: str | Path,
    roots: Sequence[str | Path],
    heldout_modules: Sequence[str] = HELDOUT_MODULES,
    sources_sha256: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Encodes both splits into ``out`` (layout above); returns tokens.json's content."""
    tokenizer_dir, out = Path(tokenizer_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not split.train or not split.heldout:
        raise ValueError("both splits need at least one document")
    splits, documents = {}, {}
    for name, docs in zip(SPLITS, split, strict=True):
        splits[name], documents[name] = _encode_split(docs, tokenizer_dir, out, name, progress)
    tok = corpus_encoder(tokenizer_dir)
    meta = {
        "dtype": np.dtype(DTYPE).name,
        "vocab_size": tok.get_vocab_size(),
        "eos_id": eos_id(tokenizer_dir),
        "tokenizer_sha256": sha256_file(tokenizer_dir / "tokenizer.json"),
        "sources_sha256": sources_sha256,
        "python": platform.python_version(),
        "roots": [str(Path(r).resolve()) for r in roots],
        "heldout_modules": list(heldout_modules),
        "heldout_files": [f for d in split.heldout for f in d.files],
        "splits": splits,
    }
    (out / DOCUMENTS).write_text(json.dumps(documents, ensure_ascii=False) + "\n")
    (out / META).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    return meta


def _load_split(out: Path, meta: dict[str, Any], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    entry = meta["splits"][name]
    path = out / entry["file"]
    data = np.fromfile(path, dtype=meta["dtype"])
    if (
        hashlib.sha256(data.tobytes()).hexdigest() != entry["sha256"]
        or len(data) != entry["tokens"]
    ):
        raise ValueError(f"{path} does not match {out / META} (sha256 or token count differ)")
    starts = np.load(out / entry["doc_starts"])
    eos = meta["eos_id"]
    ends = np.append(starts[1:], len(data)) - 1
    if (
        len(starts) != entry["documents"]
        or starts[0] != 0
        or (np.diff(starts) <= 0).any()
        or (data[ends] != eos).any()
    ):
        raise ValueError(f"{out / entry['doc_starts']} does not mark {path}'s documents")
    return torch.from_numpy(data.astype(np.int32)), torch.from_numpy(starts.astype(np.int64))


def load_tokens(out: str | Path, tokenizer_dir: str | Path | None = None) -> TokenCorpus:
    """The token files of ``out``, checked against tokens.json (each .bin's sha256 and
    size, the document starts, and the sha256 of the tokenizer in ``tokenizer_dir``, by
    default ``out/tokenizer``)."""
    out = Path(out)
    meta = json.loads((out / META).read_text())
    tokenizer = Path(tokenizer_dir or out / TOKENIZER_DIR) / "tokenizer.json"
    if not tokenizer.is_file() or sha256_file(tokenizer) != meta["tokenizer_sha256"]:
        raise ValueError(f"{tokenizer} is missing or is not the tokenizer of {out / META}")
    train, train_starts = _load_split(out, meta, "train")
    heldout, heldout_starts = _load_split(out, meta, "heldout")
    return TokenCorpus(train, heldout, train_starts, heldout_starts, meta)
