"""``python -m bench prepare``: writes ``bench/PROVENANCE.json`` (git-ignored) in a checkout:
its commit, whether the measured roots are dirty, and the hash of every file under them. Run
it right before copying the tree to a machine whose copy has no ``.git`` (the GPU machine), and
carry the file with the tree: benchmarks there take commit and dirty flag from it and refuse to
write results when the tree differs from what it recorded."""

from __future__ import annotations

import argparse

from bench.core import provenance


def add_arguments(ap: argparse.ArgumentParser) -> None:
    del ap  # no options


def run(args: argparse.Namespace) -> int:
    doc = provenance.prepare()
    dirty = " (dirty: the measured roots differ from it)" if doc["dirty"] else ""
    print(
        f"wrote {provenance.PREPARED}: commit {doc['commit'][:12]}{dirty}, "
        f"{len(doc['files'])} files under {', '.join(provenance.MEASURED_ROOTS)}; carry it "
        "with the tree (it is git-ignored)"
    )
    return 0
