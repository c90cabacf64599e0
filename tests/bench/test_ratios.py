"""``python -m bench ratios``: the ratios README quotes, read from result JSONs; checked on the
archived runs against the figures their pages state, and "not yet measured" for a result that
is not there."""

from __future__ import annotations

from bench.ratios import table
from tests.bench.helpers import ROOT, bench

ARCHIVE = ROOT / "docs" / "results" / "archive"


def test_the_archived_runs_give_the_figures_their_pages_state(tmp_path) -> None:
    md = table({"resolver": ARCHIVE / "resolver.json", "capacity": ARCHIVE / "capacity.json",
                "spec": ARCHIVE / "spec_graphs.json"})  # fmt: skip
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1] for line in md.splitlines()[2:]}
    hit = rows["resolver: all-hit resolve / plain gather, batch 1 / 4 / 16 / 64 / 128 / 256"]
    assert hit == "1.23× / 1.30× / 0.84× / 0.27× / 0.14× / 0.14×"
    assert rows["capacity: sessions held, adaptive / resident"] == "10.75× (43 / 4)"
    fits = "capacity: adaptive / resident decode rate where resident fits (C = 1, 2, 4)"
    assert rows[fits] == "0.93–0.97×"
    assert rows["spec: dflash paper / plain decoding, C = 1 / 16 / 64"] == "0.61× / 0.42× / 0.39×"
    online = "spec: online policy within 3% of the better of plain and paper"
    assert rows[online] == "0 of 9 cells"


def test_a_missing_result_reads_not_yet_measured(tmp_path) -> None:
    proc = bench("ratios", "--resolver", str(tmp_path / "none.json"), "--capacity",
                 str(tmp_path / "none.json"), "--spec", str(tmp_path / "none.json"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("not yet measured") == 3
