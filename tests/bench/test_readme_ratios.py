"""README's results table is what ``python -m bench ratios`` prints from the result JSONs under
``docs/results/``: the text between README's marker lines equals its output."""

from __future__ import annotations

import difflib

from bench import ratios
from tests.bench.helpers import ROOT, bench


def test_readmes_results_table_is_bench_ratios_output() -> None:
    section = ratios.readme_section((ROOT / ratios.README).read_text())
    start, end = ratios.MARKERS
    assert section is not None, f"README.md has no lines {start!r} ... {end!r} around its table"
    proc = bench("ratios")
    assert proc.returncode == 0, proc.stderr
    diff = "".join(difflib.unified_diff(
        section.splitlines(keepends=True), proc.stdout.splitlines(keepends=True),
        "README.md", "python -m bench ratios",
    ))  # fmt: skip
    assert section == proc.stdout, (
        "README's results table differs from `python -m bench ratios`; regenerate it with "
        f"`python -m bench ratios --write-readme`:\n{diff}"
    )
