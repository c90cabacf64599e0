"""The offline training corpus: the Python standard library's ``*.py`` sources packed into one
byte file, so that every machine trains on exactly the same bytes whatever its Python.

Layout: the files' raw bytes in sorted relative-path order, each followed by one NUL byte
(``SEPARATOR``; no stdlib source contains NUL, checked). The reader turns NUL into ``<eos>``, so
the model learns to end a file. A JSON file beside it records the sha256, byte count, file
count, Python version and the exclusions.

Included: the test suites too (``test/``, ``*/tests``, ``idle_test``): they are ordinary Python
and double a corpus that a ~10M-parameter model otherwise sees many times over. Excluded:
third-party packages (``site-packages``), ``encodings/`` (codec tables: ~1.4 MB of hex that
would be memorised rather than learned) and ``lib2to3/tests/data`` (Python 2 syntax samples).

    python -m training.target.corpus --out stdlib.u8
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sysconfig
from pathlib import Path

SEPARATOR = 0
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__", "encodings")
EXCLUDED_PREFIXES = ("lib2to3/tests/data/",)


def meta_path(corpus: str | Path) -> Path:
    """The JSON that describes a corpus file: ``<corpus>.json``."""
    corpus = Path(corpus)
    return corpus.with_name(corpus.name + ".json")


def source_files(root: Path) -> list[str]:
    """Relative POSIX paths of the ``*.py`` files under ``root`` that enter the corpus, sorted."""
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        name = rel.as_posix()
        if set(rel.parts[:-1]) & set(EXCLUDED_DIRS) or name.startswith(EXCLUDED_PREFIXES):
            continue
        if p.is_file():
            out.append(name)
    return sorted(out)


def build_corpus(out: str | Path, root: str | Path | None = None) -> dict:
    """Writes the corpus file ``out`` and its JSON; returns the JSON's content. ``root``:
    default the running Python's standard library."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    names = source_files(root)
    if not names:
        raise ValueError(f"no *.py files under {root}")
    sha = hashlib.sha256()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    size = 0
    with out.open("wb") as f:
        for name in names:
            data = (root / name).read_bytes()
            if bytes([SEPARATOR]) in data:
                raise ValueError(f"{name} contains the separator byte {SEPARATOR}")
            data += bytes([SEPARATOR])
            f.write(data)
            sha.update(data)
            size += len(data)
    meta = {
        "sha256": sha.hexdigest(),
        "bytes": size,
        "files": len(names),
        "python": platform.python_version(),
        "root": str(root),
        "separator": SEPARATOR,
        "excluded_dirs": list(EXCLUDED_DIRS),
        "excluded_prefixes": list(EXCLUDED_PREFIXES),
    }
    meta_path(out).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.target.corpus", description=__doc__)
    ap.add_argument("--out", required=True, help="corpus file to write (its JSON goes beside)")
    ap.add_argument("--root", default=None, help="source tree (default: this Python's stdlib)")
    a = ap.parse_args(argv)
    print(json.dumps(build_corpus(a.out, a.root)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
