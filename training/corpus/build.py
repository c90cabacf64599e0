"""The corpus build: sources -> split -> tokenizer -> token files, into one directory.

Every run scans the sources (the scan is how a change is seen) and writes ``sources.json``;
the tokenizer and token stages are skipped when ``build.json`` records them with the same
inputs and their outputs are on disk with the recorded sha256s. A stage's record is written
after its outputs, so an interrupted stage runs again. The split is built only when a stage
needs it.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from training.corpus.bpe import MODEL_MAX_LENGTH, VOCAB_SIZE, train_tokenizer
from training.corpus.documents import HELDOUT_MODULES, Split, split_documents
from training.corpus.sources import default_roots, find_sources, manifest
from training.corpus.tokens import DOCUMENTS, META, SPLITS, TOKENIZER_DIR, sha256_file, write_tokens

FORMAT = 1  # bumped when a stage's outputs change meaning: older records then rebuild
RECORD = "build.json"
SOURCES = "sources.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _read_record(out: Path) -> dict[str, Any]:
    path = out / RECORD
    return json.loads(path.read_text()) if path.is_file() else {}


def _fresh(record: dict[str, Any], stage: str, inputs: dict[str, Any], out: Path) -> bool:
    """Whether ``stage`` ran with ``inputs`` and its outputs are still as it wrote them."""
    entry = record.get(stage)
    if not entry or entry.get("inputs") != inputs:
        return False
    return all(
        (out / rel).is_file() and sha256_file(out / rel) == sha
        for rel, sha in entry["outputs"].items()
    )


def _record(
    out: Path, record: dict[str, Any], stage: str, inputs: dict, outputs: list[str]
) -> None:
    record[stage] = {"inputs": inputs, "outputs": {rel: sha256_file(out / rel) for rel in outputs}}
    tmp = out / (RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out / RECORD)


def build(
    out: str | Path,
    roots: Sequence[str | Path] | None = None,
    vocab_size: int = VOCAB_SIZE,
    heldout: Sequence[str] = HELDOUT_MODULES,
    model_max_length: int = MODEL_MAX_LENGTH,
    workers: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Builds (or brings up to date) the corpus in ``out``; returns the run's summary."""
    began = time.monotonic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    roots = [Path(r).resolve() for r in (roots or default_roots())]
    workers = workers or os.cpu_count() or 1
    scan = find_sources(roots, progress)
    if not scan.files:
        raise ValueError(f"no source files under {[str(r) for r in roots]}")
    sources = manifest(scan, roots)
    (out / SOURCES).write_text(json.dumps(sources, indent=1) + "\n")
    record = _read_record(out)
    stages: dict[str, str] = {"sources": "scanned"}
    cached: list[Split] = []

    def split() -> Split:
        if not cached:
            cached.append(split_documents(scan.files, heldout, workers, progress))
        return cached[0]

    common = {"format": FORMAT, "sources": sources["sha256"], "heldout": list(heldout)}
    tok_inputs = {**common, "vocab_size": vocab_size, "model_max_length": model_max_length}
    tok_outputs = [f"{TOKENIZER_DIR}/{name}" for name in TOKENIZER_FILES]
    stages["tokenizer"] = _stage(
        out,
        record,
        "tokenizer",
        tok_inputs,
        tok_outputs,
        lambda: train_tokenizer(
            split().train, out / TOKENIZER_DIR, vocab_size, model_max_length, progress
        ),
    )
    tokenizer_sha = record["tokenizer"]["outputs"][f"{TOKENIZER_DIR}/tokenizer.json"]
    token_inputs = {**common, "tokenizer": tokenizer_sha}
    token_outputs = [*(f"{s}{x}" for s in SPLITS for x in (".bin", "_docs.npy")), DOCUMENTS, META]
    stages["tokens"] = _stage(
        out,
        record,
        "tokens",
        token_inputs,
        token_outputs,
        lambda: write_tokens(
            split(), out / TOKENIZER_DIR, out, roots, heldout, sources["sha256"], progress
        ),
    )
    meta = json.loads((out / META).read_text())
    splits = meta["splits"]
    return {
        "out": str(out),
        "python": platform.python_version(),
        "sources": {k: sources[k] for k in ("files", "bytes", "sha256", "excluded")},
        "stages": stages,
        "vocab_size": meta["vocab_size"],
        **{s: {k: splits[s][k] for k in ("documents", "tokens", "bytes")} for s in SPLITS},
        "bytes_per_token": {s: round(splits[s]["bytes"] / splits[s]["tokens"], 4) for s in SPLITS},
        "seconds": round(time.monotonic() - began, 1),
    }


def _stage(
    out: Path,
    record: dict[str, Any],
    name: str,
    inputs: dict[str, Any],
    outputs: list[str],
    run: Callable[[], object],
) -> str:
    """Runs ``run`` unless the stage is fresh; records it; "built" or "skipped"."""
    if _fresh(record, name, inputs, out):
        return "skipped"
    record.pop(name, None)
    run()
    _record(out, record, name, inputs, outputs)
    return "built"
