"""A model's token map: its ids ranked by frequency in its training corpus, most frequent first,
the hot vocabulary the MTP drafter's draft steps score (``--speculative-token-map``, FR-Spec).

    python -m training.corpus.token_map --model models/glm-dsa-mini --out hot.txt [--size N]

The counts come from a built corpus's training split (``--corpus DIR``: its ``train.bin``, the
very ids trained on), or else from the sources such a corpus is built from, scanned as the
build scans them (``--root``, repeatable; default this Python's standard library, then its
site-packages) with the held-out modules kept out as the split keeps them, each file encoded
with the model's tokenizer as a document of its own (the corpus's encoding: special-token
strings as text, the eos after each document). A scan counts what this interpreter ships,
which may differ from the corpus the model was trained on (its ``corpus.json`` names that
one's Python and roots).

Ids are ranked by count, ties by id, and every id of the model's vocabulary is listed (those
never seen last), so ``--draft-vocab-size N`` takes the N most frequent; ``--size N`` writes
only those. The file holds one id per line; a one-line JSON summary is printed."""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from training.corpus.bpe import corpus_encoder, eos_id
from training.corpus.chunks import cut
from training.corpus.documents import HELDOUT_MODULES, document_text, training_files
from training.corpus.sources import SourceFile, find_sources
from training.corpus.tokens import BATCH_CHARS, DTYPE


def vocab_size(model_dir: str | Path) -> int:
    """The ids a token map ranks: the model's vocabulary (its config.json's ``vocab_size``,
    which may pad the tokenizer's), else the tokenizer's (a corpus's tokenizer directory)."""
    config = Path(model_dir) / "config.json"
    if config.is_file():
        return int(json.loads(config.read_text())["vocab_size"])
    return corpus_encoder(model_dir).get_vocab_size()


def ranked(counts: np.ndarray) -> list[int]:
    """Every id of ``counts`` [V], the most frequent first, ties by id."""
    return np.lexsort((np.arange(len(counts)), -counts)).tolist()


def corpus_counts(corpus: str | Path, vocab_size: int) -> np.ndarray:
    """[vocab_size] int64 counts of the ids of a built corpus's ``train.bin``."""
    ids = np.memmap(Path(corpus) / "train.bin", dtype=DTYPE, mode="r")
    return np.bincount(ids, minlength=vocab_size).astype(np.int64)


def _batches(files: Sequence[SourceFile]) -> Iterator[list[str]]:
    """The files' document texts, about ``BATCH_CHARS`` per batch."""
    batch: list[str] = []
    size = 0
    for f in files:
        batch.append(document_text([(f.path, f.read())]))
        size += len(batch[-1])
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def source_counts(
    model_dir: str | Path,
    vocab_size: int,
    roots: Sequence[str | Path] | None = None,
    heldout: Sequence[str] = HELDOUT_MODULES,
) -> tuple[np.ndarray, int]:
    """([vocab_size] int64 counts, files read): the training files of the scanned ``roots``
    (``training_files``), each encoded as a document by ``model_dir``'s tokenizer."""
    files = training_files(find_sources(roots).files, heldout)
    tok = corpus_encoder(model_dir)
    counts = np.zeros(vocab_size, dtype=np.int64)
    counts[eos_id(model_dir)] += len(files)
    for texts in _batches(files):
        pieces = [p for text in texts for p in cut(text)]
        ids = np.concatenate(
            [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch_fast(pieces)]
        )
        counts += np.bincount(ids, minlength=vocab_size)
    return counts, len(files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.corpus.token_map", description=__doc__)
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--model", default="models/glm-dsa-mini", help="model (or tokenizer) directory")
    ap.add_argument("--out", required=True, help="the token map to write (one id per line)")
    ap.add_argument("--size", type=int, default=None, help="write the N most frequent only")
    ap.add_argument("--corpus", default=None, help="a built corpus directory (its train.bin)")
    ap.add_argument("--root", action="append", default=None, help="a source root, repeatable")
    a = ap.parse_args(argv)
    vocab = vocab_size(a.model)
    if a.corpus is not None:
        counts, source = corpus_counts(a.corpus, vocab), {"corpus": a.corpus}
    else:
        counts, files = source_counts(a.model, vocab, a.root)
        source = {"roots": a.root or "default", "files": files}
    order = ranked(counts)[: a.size]
    Path(a.out).write_text("".join(f"{i}\n" for i in order))
    total = int(counts.sum())
    top = {n: float(counts[order[:n]].sum() / total) for n in (1024, 2048, 4096) if n <= len(order)}
    print(json.dumps({
        "out": a.out, "ids": len(order), "vocab_size": vocab, "tokens": total,
        "ids_seen": int((counts > 0).sum()), "coverage_of_top": top,
        "python": platform.python_version(), **source,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
