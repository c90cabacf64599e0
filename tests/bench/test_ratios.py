"""``python -m bench ratios``: every row of README's results table from a result JSON under
``docs/results/`` (never its archive), each with the commit, the machine and the command of
its provenance; a result that is not there reads "not measured at HEAD" with the command that
measures it. Checked here on small results of the committed formats."""

from __future__ import annotations

import json
from pathlib import Path

from bench import ratios
from tests.bench.helpers import bench


def _prov(command: str, gpu: str | None = None, dirty: bool = False) -> dict:
    return {"commit": "0123456789abcdef" * 2 + "01234567", "dirty": dirty, "command": command,
            "gpu": {"name": gpu} if gpu else None}  # fmt: skip


def _resolver() -> dict:
    case = {"misses_per_step": 0, "recovery_over_bulk": None}
    results = [
        {**case, "batch": 4, "miss_rate": 0.0, "total_over_gather": 1.26},
        {**case, "batch": 1, "miss_rate": 0.0, "total_over_gather": 1.02},
        {**case, "batch": 256, "miss_rate": 0.0, "total_over_gather": 0.14},
        {"batch": 256, "miss_rate": 0.01, "misses_per_step": 5242, "total_over_gather": 3.0,
         "recovery_over_bulk": 0.37},
        {"batch": 256, "miss_rate": 0.1, "misses_per_step": 52428, "total_over_gather": 9.0,
         "recovery_over_bulk": 0.69},
        {"batch": 1, "miss_rate": 0.1, "misses_per_step": 205, "total_over_gather": 4.3,
         "recovery_over_bulk": 0.05},
    ]  # fmt: skip
    return {"results": results, "provenance": _prov(
        "python -m bench resolver --out /root/out/resolver.json --plot /root/out/resolver.png",
        "NVIDIA H200",
    )}  # fmt: skip


def _spec_scaled(concurrency: int) -> dict:
    """A run of ``bench scaled --spec`` at one concurrency (the row reads one per C)."""
    rates = {("off", 1): (103.7, 103.7), ("fixed:4", 1): (168.2, 168.2),
             ("fixed:4+block", 1): (159.0, 159.0), ("off", 16): (689.1, 758.1),
             ("fixed:4", 16): (682.5, 1059.0)}  # fmt: skip
    rows = [{"mode": f"adaptive/{s}", "concurrency": c, "decode_tokens_per_s": v,
             "steady_tokens_per_s": steady} for (s, c), (v, steady) in rates.items()
            if c == concurrency]  # fmt: skip
    return {"spec": ["off", "fixed:4", "fixed:4+block"],
            "families": [{"family": "v32-scaled", "parameters": 46_646_608_128, "weights": "fp8",
                          "rows": rows}],
            "provenance": _prov("python -m bench scaled --family v32-scaled --out x.json",
                                "NVIDIA H100 80GB HBM3")}  # fmt: skip


def results() -> dict[str, dict]:
    """One small result per file the table reads, in its committed format."""
    acceptance = [
        {"drafter": "none", "width": 1, "temperature": 0.0, "acceptance_length": 1.0},
        {"drafter": "mtp", "width": 8, "temperature": 0.0, "acceptance_length": 3.7612,
         "equals_plain_greedy": True},
        {"drafter": "mtp", "width": 2, "temperature": 0.0, "acceptance_length": 1.8529,
         "equals_plain_greedy": True},
        {"drafter": "mtp", "width": 2, "temperature": 1.0, "acceptance_length": 1.67},
        {"drafter": "dflash2", "width": 2, "temperature": 0.0, "acceptance_length": 1.5,
         "equals_plain_greedy": True},
    ]  # fmt: skip
    pooled = {"non_stream": 3.2827, "stream": 4.1103}
    census = [
        {"weights": w, "context": c, "k": 512, "dense_mass_recall": r, "hisparse": {"host": h}}
        for w, c, r, h in (("trained", 4096, 0.8229, 0.0813), ("trained", 16384, 0.5682, 0.3238),
                           ("random", 4096, 0.1227, 0.06), ("random", 16384, 0.0321, 0.14))
    ]  # fmt: skip
    slice_ = {"family": "deepseek_v32", "injected_logit_error": 0.015651,
              "selection_recall_sparse": {"min": 0.985, "max": 0.9988},
              "routing_overlap": {"min": 0.956, "max": 0.97}}  # fmt: skip
    glm = {**slice_, "family": "glm_moe_dsa", "injected_logit_error": 0.0121,
           "routing_overlap": {"min": 0.96, "max": 0.995}}  # fmt: skip
    totals = {"passed": 113, "failed": 0, "error": 0, "skipped": 4, "tests": 117,
              "collection_errors": 0}  # fmt: skip
    return {
        "resolver.json": _resolver(),
        "spec_scaled_v32_8k_c1.json": _spec_scaled(1),
        "spec_scaled_v32_8k_c16.json": _spec_scaled(16),
        "heldout_bpb.json": {"eval_bpb": 0.95573, "provenance": _prov(
            "python -m bench heldout-bpb --out docs/results/heldout_bpb.json")},
        "acceptance.json": {"results": acceptance, "provenance": _prov(
            "python -m bench acceptance --prompts 8 --out a.json --table a.md")},
        "cpu_stream.json": {
            "drafter": "mtp", "goal_tokens_per_s": 20.0,
            "summary": {"make run": {"median_tokens_per_s": 24.75},
                        "plain decoding": {"median_tokens_per_s": 18.50}},
            "provenance": _prov("python -m bench cpu-stream", dirty=True)},
        "burst.json": {
            "summary": {"served": 56, "served_per_s": 1.8144, "tokens_per_s": 58.06,
                        "refused_429": 64, "refusal_s": {"median": 0.2093, "max": 10.8355},
                        "other": 0},
            "provenance": _prov("python -m bench burst --out docs/results/burst.json")},
        "prefix_turns.json": {
            "goal_computed_share": 0.1, "ttft_with_over_without": [0.066, 0.075, 0.081],
            "same_text": [True, True, True, True],
            "summary": {"prefix cache (make run)": {"max_later_computed_share": 0.0296},
                        "no prefix cache": {"max_later_computed_share": 1.0}},
            "provenance": _prov("python -m bench prefix-turns --out p.json")},
        "gateway.json": {
            "config": {"model": "tiny-glm"},
            "variants": {k: {"pooled": {"overhead_ms": {"p50": v}}} for k, v in pooled.items()},
            "provenance": _prov("python -m bench gateway --out=docs/results/gateway.json")},
        "census.json": {"rows": census, "provenance": _prov("python -m bench census --trace t.npz")},
        "slices.json": {"slices": {"a": slice_, "b": glm}, "totals": {**totals, "passed": 2},
                        "provenance": _prov("python -m bench slices", "NVIDIA H200")},
        "gpu_tests.json": {"totals": totals, "provenance": _prov("python -m bench gpu-tests",
                                                                  "NVIDIA H200")},
        "defaults.json": {
            "device": "cuda:0", "mode": "adaptive", "cuda_graphs": "on", "drafter": "none",
            "kv_pool": {"bytes": 4 * 2**30}, "kills": 3, "text_identical": True,
            "stalls_s": [11.12, 11.04, None], "tokens_per_s": 180.44,
            "provenance": _prov("python -m bench defaults", "NVIDIA H100 80GB HBM3")},
    }  # fmt: skip


def _rows(md: str) -> list[list[str]]:
    return [line.strip("| ").split(" | ") for line in md.splitlines()[2:]]


def test_every_row_from_its_result(tmp_path: Path) -> None:
    for name, doc in results().items():
        (tmp_path / name).write_text(json.dumps(doc))
    rows = _rows(ratios.table(tmp_path))
    assert len(rows) == len(ratios.ROWS) <= 12
    values = [r[1] for r in rows]
    assert values == [
        "all hit 1.02× / 1.26× / 0.14× at batch 1 / 4 / 256 (met); host recovery 37%–69% (not met)",
        "MTP width 4: 1.62× at C = 1 (goal ≥ 1.3: met), 0.99× at C = 16 (1.40× steady; goal "
        "≥ 1.6: not met); 46.6 B parameters, fp8 weights",
        "0.956 (met)",
        "1.85 / 3.76 at K = 2 / 8 (met); every drafter's greedy tokens equal plain decoding's: yes",
        "1.34× (24.8 / 18.5 tok/s, drafter mtp; ≥ 20 tok/s met)",
        "56 served, 1.81 requests/s (58.1 tok/s); 64 refused with 429 and Retry-After, after "
        "0.21 s (median) to 10.8 s; 0 other statuses",
        "3.0% computed (met); time to first token 0.07–0.08 of the uncached; text equal: yes",
        "3.28 ms (not met), streaming 4.11 ms (not met); tiny-glm",
        "k = 512; 4K: 0.82 / 0.12, 8% from host; 16K: 0.57 / 0.03, 32% from host",
        "deepseek_v32 1.57%, glm_moe_dsa 1.21%; uninjected: selection recall 0.985–0.999, "
        "routing overlap 0.956–0.995; tests 2 passed, 0 failed",
        "113 passed, 0 failed, 0 errors, 4 skipped",
        "cuda:0, adaptive, CUDA graphs on, drafter none, KV pool 4096 MiB; text identical after "
        "each of 3 kills: yes, stalls 11.1 / 11.0 / – s; 180.4 tok/s unkilled",
    ]
    at = {r[0]: r[2] for r in rows}
    assert at[ratios.ROWS[0].what] == "0123456, H200"
    assert at[ratios.ROWS[4].what] == "0123456 (dirty), CPU"
    assert at[ratios.ROWS[-1].what] == "0123456, H100 80GB HBM3"
    commands = [r[3] for r in rows]
    # the result's own command, the options that only name output files left out
    assert commands[0] == "`python -m bench resolver`"
    assert commands[3] == "`python -m bench acceptance --prompts 8`"
    assert commands[5] == "`python -m bench burst`"
    assert commands[6] == "`python -m bench prefix-turns`"
    assert commands[7] == "`python -m bench gateway`"
    assert commands[8] == "`python -m bench census`"


def test_a_missing_result_reads_not_measured_with_its_command(tmp_path: Path) -> None:
    archive = tmp_path / "archive"  # archived results are never read
    archive.mkdir()
    for name, doc in results().items():
        (archive / name).write_text(json.dumps(doc))
    proc = bench("ratios", "--results", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    rows = _rows(proc.stdout)
    assert len(rows) == len(ratios.ROWS)
    for row, spec in zip(rows, ratios.ROWS, strict=True):
        assert row[1:] == [ratios.NOT_MEASURED, "–", spec.measure]
        assert spec.measure.startswith("`python -m bench ")


def test_write_readme_replaces_only_the_section_between_the_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    start, end = ratios.MARKERS
    readme.write_text(f"# title\n\ntext\n{start}\n| old | table |\n{end}\n\nafter\n")
    proc = bench("ratios", "--results", str(tmp_path), "--write-readme", "--readme", str(readme))
    assert proc.returncode == 0, proc.stderr
    text = readme.read_text()
    assert text.startswith(f"# title\n\ntext\n{start}\n| result |")
    assert text.endswith(f"|\n{end}\n\nafter\n") and "| old |" not in text
    assert ratios.readme_section(text) == ratios.table(tmp_path)
    readme.write_text("# no markers\n")
    proc = bench("ratios", "--results", str(tmp_path), "--write-readme", "--readme", str(readme))
    assert proc.returncode != 0 and "no lines" in proc.stderr


def test_a_burst_with_no_refusal_reads_so() -> None:
    summary = {"served": 120, "served_per_s": 3.7265, "tokens_per_s": 119.25, "refused_429": 0,
               "refusal_s": {"median": None, "max": None}, "other": 0}  # fmt: skip
    assert ratios.burst({"summary": summary}) == (
        "120 served, 3.73 requests/s (119.2 tok/s); 0 refused with 429; 0 other statuses"
    )
