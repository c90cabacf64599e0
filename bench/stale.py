"""``python -m bench stale``: the committed results whose measured code has changed since.

Every result JSON under ``docs/results/`` outside ``docs/results/archive/`` is checked: each
file its provenance names (the code it measured and the results it derives from) must hash as
it did then, under the provenance's ``hash_scheme`` (``bench/core/provenance.py``: code without
docstrings and comments for ``code-ast-v1``; bytes for results recorded before it, which name
no scheme). A result without provenance is stale too. Lists what changed, per result, and
exits 1 when anything is stale (0 when nothing is), so a test can hold the docs to HEAD."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from bench.core.provenance import BLOB_SCHEME, ROOT, measured_hash

RESULTS = "docs/results"
ARCHIVE = "docs/results/archive"


@dataclass(frozen=True)
class Stale:
    result: str  # the result JSON, relative to the root
    commit: str | None  # what it was measured at (None: no provenance)
    reasons: tuple[str, ...]  # changed, deleted or missing files, or why it has no provenance


def _differing(recorded: dict, root: Path, what: str, scheme: str) -> list[str]:
    out = []
    for p, h in sorted(recorded.items()):
        if Path(p).is_absolute():  # outside the repository: not comparable
            continue
        f = root / p
        if not f.is_file():
            out.append(f"{p} ({what} deleted)")
        elif measured_hash(f, scheme) != h:
            out.append(f"{p} ({what} changed)")
    return out


def check(path: Path, root: Path) -> Stale | None:
    """Whether one result JSON is stale against the tree at ``root`` (None: it is not)."""
    name = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return Stale(name, None, (f"unreadable: {e}",))
    prov = doc.get("provenance") if isinstance(doc, dict) else None
    if not isinstance(prov, dict) or not isinstance(prov.get("files"), dict):
        return Stale(name, None, ("no provenance (it names no code it measured)",))
    scheme = prov.get("hash_scheme", BLOB_SCHEME)
    try:
        reasons = _differing(prov["files"], root, "code", scheme) + _differing(
            prov.get("inputs") or {}, root, "input", scheme
        )
    except ValueError as e:  # a scheme this tree does not know
        return Stale(name, prov.get("commit"), (str(e),))
    return Stale(name, prov.get("commit"), tuple(reasons)) if reasons else None


def stale_results(results: Path, archive: Path, root: Path = ROOT) -> list[Stale]:
    """Every stale result JSON under ``results``, ``archive`` excluded."""
    out = []
    for path in sorted(results.rglob("*.json")):
        if path.is_relative_to(archive):
            continue
        s = check(path, root)
        if s is not None:
            out.append(s)
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--results", default=RESULTS, help="where the committed results are")
    ap.add_argument("--archive", default=ARCHIVE, help="superseded results: not checked")


def run(args: argparse.Namespace) -> int:
    results, archive = ROOT / args.results, ROOT / args.archive
    found = stale_results(results, archive)
    for s in found:
        at = f"measured at {s.commit[:12]}" if s.commit else "no provenance"
        print(f"{s.result} ({at}):")
        for r in s.reasons:
            print(f"  {r}")
    if found:
        print(f"{len(found)} stale result(s) under {args.results} (outside {args.archive})")
        return 1
    print(f"no stale results under {args.results} (outside {args.archive})")
    return 0
