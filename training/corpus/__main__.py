"""python -m training.corpus --out DIR [--root R ...] [--vocab-size 8192] [--no-progress]

Builds the corpus of the shipped model into DIR: the source scan (``sources.json``), the BPE
tokenizer (``DIR/tokenizer/``) and the token files (``train.bin``, ``heldout.bin``, ...,
``tokens.json``), skipping the stages that are up to date; prints a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json

from training.corpus.bpe import MODEL_MAX_LENGTH, VOCAB_SIZE
from training.corpus.build import build
from training.corpus.documents import HELDOUT_MODULES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.corpus", description=__doc__)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument(
        "--root",
        action="append",
        default=None,
        help="a source root, repeatable, scanned in order (default: this Python's stdlib, "
        "then its site-packages)",
    )
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help="ids, specials included")
    ap.add_argument("--model-max-length", type=int, default=MODEL_MAX_LENGTH)
    ap.add_argument(
        "--heldout",
        nargs="+",
        default=list(HELDOUT_MODULES),
        metavar="MODULE",
        help="top-level modules held out (default: documents.HELDOUT_MODULES)",
    )
    ap.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    a = ap.parse_args(argv)
    summary = build(
        a.out,
        roots=a.root,
        vocab_size=a.vocab_size,
        heldout=tuple(a.heldout),
        model_max_length=a.model_max_length,
        workers=a.workers,
        progress=not a.no_progress,
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
