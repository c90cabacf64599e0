"""Result files: every result JSON is written here, with its provenance."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from . import provenance


def write_result(
    doc: Mapping, path: str | Path, inputs: Iterable[str | Path] = (),
    data: Iterable[str | Path] = (),
) -> Path:  # fmt: skip
    """Writes ``doc`` and its ``provenance`` (``provenance.collect``) as JSON at ``path``,
    replacing the file whole. Raises ``provenance.ProvenanceError``, writing nothing, when the
    code it measured cannot be named."""
    out = {**doc, "provenance": provenance.collect(inputs, data)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    tmp.replace(path)
    return path
