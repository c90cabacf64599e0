"""``python -m bench grammar-cost`` on the CPU at a toy size, as a process: every variant (the
constrained ones at each thread count asked for) runs in lockstep over the same batch, no request ends inside the timed window, and the result names the
code it measured (the grammar's modules among it)."""

from __future__ import annotations

import json

from services.worker.request.grammar_masks import default_threads
from tests.bench.helpers import bench


def test_grammar_cost_runs_both_variants_in_lockstep(tmp_path) -> None:
    out = tmp_path / "g.json"
    proc = bench(
        "grammar-cost", "--device", "cpu", "--batch", "3", "--steps", "2", "--rounds", "2",
        "--prompt-len", "32", "--mask-threads", "1,3", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    default = default_threads()
    extra = {f"json_schema_threads_{t}" for t in (1, 3) if t != default}
    assert set(doc["per_round"]) == {"unconstrained", "json_schema", *extra}
    assert doc["mask_threads"] == default and set(doc["overhead_by_variant"]) == {
        "json_schema",
        *extra,
    }
    assert all(len(rows) == 2 for rows in doc["per_round"].values())
    steps = doc["median_step_s"]
    assert steps["unconstrained"] > 0 and steps["json_schema"] > 0
    assert doc["overhead"] == steps["json_schema"] / steps["unconstrained"] - 1
    assert doc["median_mask_fill_s"] > 0 and not doc["goal_applies"]
    files = doc["provenance"]["files"]
    assert "services/worker/request/grammar_masks.py" in files
    assert "bench/grammar_cost.py" in files
