"""The source files of the corpus: every ``*.py`` under the roots (by default this Python's
standard library, then its site-packages), filtered and deduplicated by content.

Kept out: ``__pycache__``, nested installations (``site-packages``, ``dist-packages``, a root
inside another root: scanned as their own root or not at all), ``*.dist-info`` /
``*.egg-info``, ``encodings/`` (codec tables: hex that would be memorised rather than learned)
and the stdlib's fixture directories of deliberately broken or non-UTF-8 sources
(``FIXTURE_DIRS``); then every file over ``MAX_BYTES``, containing NUL or not valid UTF-8.
A file whose content was already seen is dropped: roots are scanned in the order given, paths
in sorted order, and the first copy wins, so a vendored copy never displaces the standard
library's own file when the stdlib root comes first.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm

MAX_BYTES = 1 << 20
SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
SKIPPED_DIR_SUFFIXES = (".dist-info", ".egg-info")
FIXTURE_DIRS = (
    "encodings/",
    "lib2to3/tests/data/",
    "test/test_lib2to3/data/",
    "test/tokenizedata/",
    "test/encoded_modules/",
)


@dataclass(frozen=True)
class SourceFile:
    """One source file. ``path``: POSIX, relative to ``root`` (which is absolute);
    ``package``: its top-level package or module (first path component, ``.py`` stripped)."""

    package: str
    path: str
    root: str
    sha256: str
    size: int

    @property
    def location(self) -> Path:
        return Path(self.root) / self.path

    def read(self) -> str:
        """The file's text; a file whose bytes changed since the scan is an error."""
        data = self.location.read_bytes()
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise ValueError(f"{self.location} changed since it was scanned (sha256 differs)")
        return data.decode("utf-8")


class Scan(NamedTuple):
    files: list[SourceFile]  # in root order, then path order
    excluded: dict[str, int]  # reason -> how many files it kept out


def default_roots() -> list[Path]:
    """This Python's stdlib, then its purelib and platlib (deduplicated, existing only)."""
    paths = sysconfig.get_paths()
    out: list[Path] = []
    for key in ("stdlib", "purelib", "platlib"):
        root = Path(paths[key]).resolve()
        if root.is_dir() and root not in out:
            out.append(root)
    return out


def _skipped_dir(rel: str, name: str, nested: set[Path], path: Path) -> bool:
    return (
        name in SKIPPED_DIRS
        or name.endswith(SKIPPED_DIR_SUFFIXES)
        or (rel + "/").startswith(FIXTURE_DIRS)
        or path in nested
    )


def _candidates(root: Path, nested: set[Path]) -> list[str]:
    """Root-relative POSIX paths of the ``*.py`` files under ``root``, sorted, skipped
    directories pruned."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        base = here.relative_to(root).as_posix()
        prefix = "" if base == "." else base + "/"
        dirnames[:] = [
            d for d in dirnames if not _skipped_dir(prefix + d, d, nested, (here / d).resolve())
        ]
        out.extend(prefix + f for f in filenames if f.endswith(".py") and (here / f).is_file())
    return sorted(out)


def _exclusion(data: bytes) -> str | None:
    """Why a file's content keeps it out, or None (the size is checked before reading)."""
    if b"\0" in data:
        return "nul"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "not_utf8"
    return None


def scan_root(root: str | Path, nested: Iterable[str | Path] = (), progress: bool = False) -> Scan:
    """The files under one root that pass the filters, in path order, *not* deduplicated.
    ``nested``: directories inside ``root`` to leave out (other roots)."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"source root {root} is not a directory")
    skip = {Path(p).resolve() for p in nested}
    excluded: Counter[str] = Counter()
    files = []
    for rel in tqdm(_candidates(root, skip), desc=f"scan {root.name}", disable=not progress):
        size = (root / rel).stat().st_size
        if size > MAX_BYTES:
            excluded["too_large"] += 1
            continue
        data = (root / rel).read_bytes()
        reason = _exclusion(data)
        if reason is not None:
            excluded[reason] += 1
            continue
        package = rel.split("/", 1)[0].removesuffix(".py")
        sha = hashlib.sha256(data).hexdigest()
        files.append(SourceFile(package, rel, str(root), sha, len(data)))
    return Scan(files, dict(excluded))


def find_sources(roots: Sequence[str | Path] | None = None, progress: bool = False) -> Scan:
    """Every root scanned (``default_roots()`` when None), in order, each leaving out the
    others nested in it; then deduplicated by content, the first copy kept."""
    resolved = [Path(r).resolve() for r in (roots or default_roots())]
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"a source root is given twice: {[str(r) for r in resolved]}")
    files: list[SourceFile] = []
    excluded: Counter[str] = Counter()
    for root in resolved:
        nested = [r for r in resolved if r != root and r.is_relative_to(root)]
        scan = scan_root(root, nested, progress)
        files.extend(scan.files)
        excluded.update(scan.excluded)
    seen: set[str] = set()
    unique = []
    for f in files:
        if f.sha256 in seen:
            excluded["duplicate"] += 1
            continue
        seen.add(f.sha256)
        unique.append(f)
    return Scan(unique, dict(sorted(excluded.items())))


def manifest_sha256(files: Sequence[SourceFile]) -> str:
    """One hash over the list (roots, paths, packages, contents, sizes) in its order."""
    text = json.dumps([asdict(f) for f in files], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def manifest(scan: Scan, roots: Sequence[str | Path]) -> dict:
    """``sources.json``: the roots, the exclusion counts, the hash and every file."""
    return {
        "roots": [str(Path(r).resolve()) for r in roots],
        "sha256": manifest_sha256(scan.files),
        "files": len(scan.files),
        "bytes": sum(f.size for f in scan.files),
        "excluded": scan.excluded,
        "sources": [asdict(f) for f in scan.files],
    }
