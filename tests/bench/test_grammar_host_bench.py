"""``python -m bench grammar-host`` on the CPU at a toy size, as a process: every phase of the
engine thread's grammar work is timed, the apply kernel apart, and the result names the code it
measured (the masks, the filler thread and the matchers' owner among it)."""

from __future__ import annotations

import json

from tests.bench.helpers import bench


def test_grammar_host_times_each_phase_of_a_constrained_step(tmp_path) -> None:
    out = tmp_path / "h.json"
    proc = bench(
        "grammar-host", "--batch", "4", "--steps", "6", "--warmup", "2", "--torch-ops", "10",
        "--threads", "1", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert set(doc["median_s"]) == {"accept", "prefetch", "fill", "apply"}
    assert all(v > 0 for v in doc["median_s"].values())
    assert doc["step_s"] == sum(doc["median_s"].values())
    assert doc["step_without_kernel_s"] == doc["step_s"] - doc["apply_kernel_s"]
    assert doc["batch"] == 4 and doc["threads"] == 1
    files = doc["provenance"]["files"]
    for f in ("grammar_masks.py", "mask_filler.py", "grammar_state.py"):
        assert f"services/worker/request/{f}" in files
    assert "bench/grammar_host.py" in files
