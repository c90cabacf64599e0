"""``python -m bench gpu-tests``: the GPU test suite as a result.

    python -m bench gpu-tests --out docs/results/gpu_tests.json

Runs, in this process (``bench/core/suite.py``), the tests marked ``gpu`` in every test file that
uses the marker (found by its text under ``tests/``, so a file that moves stays in), but the
real-dimension slices, which ``python -m bench slices`` runs and records with their figures.
Writes each test's node id, outcome, duration and skip reason (or failure message), the totals
and pytest's exit status, with the provenance of the code the tests imported and the test files
as inputs, so ``python -m bench stale`` holds the suite's verdict to the code as it holds every
other result. The result is written whatever the outcome; the exit status is pytest's."""

from __future__ import annotations

import argparse

from bench.core import UsageError, suite
from bench.core.output import write_result

SLICES = "test_real_slice.py"  # its own command: bench/slices.py


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "paths", nargs="*",
        help="test files or folders (default: every test file under tests/ that marks a test "
             f"gpu, but {SLICES})",
    )  # fmt: skip
    suite.add_selection_arguments(ap, "-v --durations=15")
    ap.add_argument("--out", default="docs/results/gpu_tests.json")


def run(args: argparse.Namespace) -> int:
    paths = args.paths or [
        p for p in suite.gpu_test_files() if not p.endswith(f"/{SLICES}")
    ]  # fmt: skip
    if not paths:
        raise UsageError("no test file marks a test gpu under tests/")
    argv = suite.selection(args, paths)
    run = suite.run_pytest(argv)
    doc = {
        "benchmark": "gpu-tests",
        "pytest_args": argv,
        **run.record(),
    }
    print(f"wrote {write_result(doc, args.out, inputs=suite.inputs(run))}: {run.totals()}")
    return run.exit_status
