"""``python -m bench slices``: the real-dimension slices against transformers as a result.

    python -m bench slices --out docs/results/slices.json

Runs the slices' test file (``tests/**/test_real_slice.py``: our bf16 engine against bf16
transformers on 4-layer slices of DeepSeek-V3.2 and GLM-5 at every per-layer dimension as
released; GPU-only) in this process (``bench/core/suite.py``) with ``$DHISPARSE_REPORT_DIR`` set,
where each slice test writes its report, and records per slice: relative logit error with
transformers' choices injected and without, top-1 agreement, each producer's selection recall
over the sparse queries and each MoE layer's routing overlap (uninjected; min and max over
layers), with the whole report; the tests' outcomes and totals beside them; the provenance of
the code they imported, with the test files as inputs. Refuses to write a result when no slice
wrote its report (every test skipped, say, on a machine without CUDA); the exit status is
pytest's otherwise."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.core import UsageError, provenance, suite
from bench.core.output import write_result

TEST_FILE = "test_real_slice.py"
REPORT_DIR = "DHISPARSE_REPORT_DIR"  # where each slice test writes ``<name>.json``


def slice_file() -> str:
    """The slices' test file under ``tests/``, wherever it moved."""
    with provenance.unrecorded():
        found = sorted((provenance.ROOT / suite.TESTS).rglob(TEST_FILE))
    if not found:
        raise UsageError(f"no {TEST_FILE} under {suite.TESTS}/")
    return found[0].relative_to(provenance.ROOT).as_posix()


def _span(values: list[float]) -> dict[str, float] | None:
    return {"min": min(values), "max": max(values)} if values else None


def figures(report: dict) -> dict:
    """One slice's figures from the report its test wrote (``compare_slice``)."""
    recall = [r["sparse"] for r in report["selection_recall"].values()]
    return {
        "family": report["family"],
        "device": report["device"],
        "tokens": report["tokens"],
        "injected_logit_error": report["injected_logit_error"],
        "logit_error": report["logit_error"],
        "top1_injected": report["top1_injected"],
        "top1": report["top1"],
        "selection_recall_sparse": _span(recall),
        "routing_overlap": _span([r["overlap"] for r in report["routing"].values()]),
        "report": report,
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("paths", nargs="*", help=f"test files (default: tests/**/{TEST_FILE})")
    suite.add_selection_arguments(ap, "-s")
    ap.add_argument("--out", default="docs/results/slices.json")


def run(args: argparse.Namespace) -> int:
    argv = suite.selection(args, args.paths or [slice_file()])
    with tempfile.TemporaryDirectory(prefix="dhisparse-slices-") as reports:
        before = os.environ.get(REPORT_DIR)
        os.environ[REPORT_DIR] = reports
        try:
            run = suite.run_pytest(argv)
        finally:
            if before is None:
                os.environ.pop(REPORT_DIR)
            else:
                os.environ[REPORT_DIR] = before
        with provenance.unrecorded():
            written = sorted(Path(reports).glob("*.json"))
            slices = {f.stem: figures(json.loads(f.read_text())) for f in written}
    if not slices:
        print(f"no slice wrote its report (tests: {run.totals()}): no result written",
              file=sys.stderr)  # fmt: skip
        return run.exit_status or 1
    doc = {"benchmark": "slices", "pytest_args": argv, "slices": slices, **run.record()}
    print(f"wrote {write_result(doc, args.out, inputs=suite.inputs(run))}: {run.totals()}")
    for name, s in slices.items():
        print(f"{name}: logit error {s['injected_logit_error']:.2%} injected, "
              f"{s['logit_error']:.2%} not")  # fmt: skip
    return run.exit_status
