"""``python -m bench grammar-cost`` on the CPU at a toy size, as a process: both variants run in
lockstep over the same batch, no request ends inside the timed window, and the result names the
code it measured (the grammar's modules among it)."""

from __future__ import annotations

import json

from tests.bench.helpers import bench


def test_grammar_cost_runs_both_variants_in_lockstep(tmp_path) -> None:
    out = tmp_path / "g.json"
    proc = bench(
        "grammar-cost", "--device", "cpu", "--batch", "3", "--steps", "2", "--rounds", "2",
        "--prompt-len", "32", "--threads", "2", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert set(doc["per_round"]) == {"unconstrained", "json_schema"}
    assert all(len(rows) == 2 for rows in doc["per_round"].values())
    steps = doc["median_step_s"]
    assert steps["unconstrained"] > 0 and steps["json_schema"] > 0
    assert doc["overhead"] == steps["json_schema"] / steps["unconstrained"] - 1
    assert doc["median_mask_fill_s"] > 0 and not doc["goal_applies"]
    assert doc["threads"] == 2 and doc["host_cores"] >= 1
    files = doc["provenance"]["files"]
    assert "services/worker/request/grammar_masks.py" in files
    assert "bench/grammar_cost.py" in files
