"""Documents and the held-out split.

A *document* is one package of one root: its files in import order, each preceded by a
one-line header ``# <root-relative path>``, files separated by a newline; its text is what the
tokenizer sees. The held-out split is ``HELDOUT_MODULES``, standard-library modules chosen
whole, chosen to be 1-2% of the standard library's bytes (their tests not counted), one
document per file so that each can be scored on its own.

A held-out module stays out of training in every copy: training drops any file with the
content of a held-out file, any file with a path component named like a held-out module
(``foo/_vendor/textwrap.py``, ``bar/zoneinfo/...``) and the stdlib's tests of them
(``test/test_<name>*``), which quote the module.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

from tqdm import tqdm

from training.corpus.import_order import imported_names, order_by_imports
from training.corpus.sources import SourceFile

HELDOUT_MODULES = (
    "configparser",
    "difflib",
    "fractions",
    "graphlib",
    "ipaddress",
    "shlex",
    "statistics",
    "textwrap",
    "tomllib",
    "zoneinfo",
)
# Names under which a held-out module's near-copies ship as third-party packages (vendored or
# backported): their files are kept out of training too.
ALIASES = {"tomllib": ("tomli",), "graphlib": ("graphlib_backport",)}
PARSE_CHUNK = 64  # files per task of the import-parsing pool


@dataclass(frozen=True)
class Document:
    """``files``: root-relative paths in the order ``text`` holds them."""

    name: str
    files: tuple[str, ...]
    text: str

    @property
    def n_bytes(self) -> int:
        """UTF-8 bytes of the text plus one for the separator that follows the document."""
        return len(self.text.encode("utf-8")) + 1


class Split(NamedTuple):
    train: list[Document]  # one per (root, package), in root then package order
    heldout: list[Document]  # one per held-out file, in path order


def document_text(parts: Sequence[tuple[str, str]]) -> str:
    """(path, source) pairs as one document's text."""
    return "\n".join(f"# {path}\n{text}" for path, text in parts)


def _component_names(path: str) -> set[str]:
    return {part.removesuffix(".py") for part in path.split("/")}


def kept_out_of_training(f: SourceFile, heldout: Sequence[str], heldout_sha: set[str]) -> bool:
    """Whether a file that is not itself held out is a copy, a namesake (or a namesake of one
    of its ``ALIASES``) or a test of a held-out module."""
    parts = f.path.split("/")
    tests = len(parts) > 1 and parts[0] == "test"
    names = set(heldout) | {alias for name in heldout for alias in ALIASES.get(name, ())}
    return (
        f.sha256 in heldout_sha
        or bool(_component_names(f.path) & names)
        or (tests and parts[1].startswith(tuple(f"test_{name}" for name in heldout)))
    )


def _imports_of(item: tuple[str, str]) -> frozenset[str]:
    root, path = item
    with open(os.path.join(root, path), encoding="utf-8") as fh:
        return imported_names(path, fh.read())


def _all_imports(
    files: Sequence[SourceFile], workers: int, progress: bool
) -> dict[tuple[str, str], frozenset[str]]:
    """(root, path) -> imported names; parsing runs in ``workers`` processes (``ast`` is the
    slow part of building documents)."""
    items = [(f.root, f.path) for f in files]
    workers = max(1, min(workers, -(-len(items) // PARSE_CHUNK)))
    bar = tqdm(total=len(items), desc="imports", unit="file", disable=not progress)
    if workers == 1:
        found = []
        for item in items:
            found.append(_imports_of(item))
            bar.update()
    else:
        with ProcessPoolExecutor(workers) as pool:
            found = []
            for names in pool.map(_imports_of, items, chunksize=PARSE_CHUNK):
                found.append(names)
                bar.update()
    bar.close()
    return dict(zip(items, found, strict=True))


def training_files(
    files: Sequence[SourceFile], heldout: Sequence[str] = HELDOUT_MODULES
) -> list[SourceFile]:
    """The scanned files that training reads, in their order: neither held out (a top-level
    package named in ``heldout``) nor kept out with them (``kept_out_of_training``). Naming a
    module that no file is is an error (the split would silently hold out less)."""
    held = [f for f in files if f.package in heldout]
    missing = sorted(set(heldout) - {f.package for f in held})
    if missing:
        raise ValueError(f"held-out modules {missing} are not among the source files")
    held_sha = {f.sha256 for f in held}
    train = [f for f in files if f.package not in heldout]
    return [f for f in train if not kept_out_of_training(f, heldout, held_sha)]


def split_documents(
    files: Sequence[SourceFile],
    heldout: Sequence[str] = HELDOUT_MODULES,
    workers: int = 1,
    progress: bool = False,
) -> Split:
    """The training documents (``training_files``, one per root and package) and the held-out
    ones (one per file) from the scanned files (in any order)."""
    held = [f for f in files if f.package in heldout]
    train = training_files(files, heldout)
    imports = _all_imports(train, workers, progress)
    packages: dict[tuple[str, str], dict[str, SourceFile]] = defaultdict(dict)
    roots = list(dict.fromkeys(f.root for f in files))
    for f in train:
        packages[(f.root, f.package)][f.path] = f
    train_docs = []
    for root, package in sorted(packages, key=lambda k: (roots.index(k[0]), k[1])):
        members = packages[(root, package)]
        order = order_by_imports({p: imports[(root, p)] for p in members})
        text = document_text([(p, members[p].read()) for p in order])
        train_docs.append(Document(package, tuple(order), text))
    held_docs = [
        Document(f.path, (f.path,), document_text([(f.path, f.read())]))
        for f in sorted(held, key=lambda f: (roots.index(f.root), f.path))
    ]
    return Split(train_docs, held_docs)
