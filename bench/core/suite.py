"""Tests run as evidence: ``pytest.main`` in this process with a plugin that records each test's
outcome, so that the modules the tests import land in ``sys.modules`` and the files they read
in the audit hook: the result's provenance names the code they exercised
(``provenance.measured_files``). Its ``inputs`` are the test files and what they use under
``tests/`` (helpers, conftest, fixtures; ``inputs``), so editing a test's code makes the result
stale as editing the code it tests does.

Tests that start processes of their own (servers, rank groups) run code this process may not
import; that code is named only where a test imports it too."""

from __future__ import annotations

import argparse
import importlib.metadata
import shlex
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.core import provenance

TESTS = "tests"
# the packages the tests compare against or run under (besides provenance's torch and triton)
PACKAGES = ("pytest", "transformers")
# the plugins that would take tests out of this process, or write beside the tree
PYTEST_FLAGS = ("-p", "no:cacheprovider", "-p", "no:xdist")
MESSAGE_CHARS = 600


@dataclass
class Recorder:
    """The pytest plugin: each test's outcome (``passed``, ``failed``, ``skipped``, ``error``
    in set-up or tear-down, ``xfailed``, ``xpassed``), its duration over its three phases, the
    reason it was skipped or the message it failed with; the files collection failed on."""

    tests: dict[str, dict] = field(default_factory=dict)
    collection_errors: list[dict] = field(default_factory=list)
    files: set[Path] = field(default_factory=set)  # the test files collected or tried
    rootpath: Path = Path()  # pytest's rootdir, which node ids are relative to

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        path = report.nodeid.split("::")[0]
        if path.endswith(".py"):
            self.files.add(self.rootpath / path)
        if report.failed:
            self.collection_errors.append({"nodeid": report.nodeid, "message": _message(report)})

    def pytest_configure(self, config: pytest.Config) -> None:
        self.rootpath = config.rootpath

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        rec = self.tests.setdefault(report.nodeid, {
            "nodeid": report.nodeid, "outcome": None, "duration_s": 0.0, "skip_reason": None,
            "message": None,
        })  # fmt: skip
        rec["duration_s"] += report.duration
        xfail = hasattr(report, "wasxfail")
        if report.when == "call":
            if report.skipped:
                rec["outcome"] = "xfailed" if xfail else "skipped"
            elif report.passed:
                rec["outcome"] = "xpassed" if xfail else "passed"
            else:
                rec["outcome"] = "failed"
        elif report.failed:  # set-up or tear-down
            rec["outcome"] = "error"
        elif report.when == "setup" and report.skipped:
            rec["outcome"] = "xfailed" if xfail else "skipped"
        if report.skipped and not xfail:
            rec["skip_reason"] = _skip_reason(report)
        elif report.failed:
            rec["message"] = _message(report)


def _skip_reason(report: pytest.TestReport) -> str:
    lr = report.longrepr
    reason = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    return reason.removeprefix("Skipped: ")


def _message(report: pytest.TestReport | pytest.CollectReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = getattr(crash, "message", None) or str(report.longrepr)
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


@dataclass(frozen=True)
class SuiteRun:
    exit_status: int  # pytest's
    seconds: float
    tests: list[dict]  # one per test, in the order they ran
    collection_errors: list[dict]
    files: list[Path]  # the test files collected

    def totals(self) -> dict[str, int]:
        counts = Counter(t["outcome"] for t in self.tests)
        out = {k: counts.get(k, 0) for k in ("passed", "failed", "error", "skipped")}
        out |= {k: n for k, n in counts.items() if k not in out}
        return out | {"tests": len(self.tests), "collection_errors": len(self.collection_errors)}

    def record(self) -> dict:
        """What a result holds of the run."""
        return {
            "exit_status": self.exit_status,
            "seconds": round(self.seconds, 2),
            "packages": {name: _version(name) for name in PACKAGES},
            "totals": self.totals(),
            "tests": self.tests,
            "collection_errors": self.collection_errors,
        }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_pytest(args: Sequence[str]) -> SuiteRun:
    """Runs pytest in this process on ``args`` (paths, ``-m``, ``-k``, ...) with the recording
    plugin, the cache and xdist off."""
    rec = Recorder()
    t0 = time.monotonic()
    status = pytest.main([*PYTEST_FLAGS, *args], plugins=[rec])
    return SuiteRun(
        int(status), time.monotonic() - t0, list(rec.tests.values()), rec.collection_errors,
        sorted(rec.files),
    )  # fmt: skip


def add_selection_arguments(ap: argparse.ArgumentParser, more: str) -> None:
    """``-m`` (default ``gpu``), ``-k`` and ``--pytest-args`` (default ``more``)."""
    ap.add_argument("-m", dest="marker", default="gpu", help="pytest's -m (default: gpu)")
    ap.add_argument("-k", dest="keyword", default=None, help="pytest's -k")
    ap.add_argument("--pytest-args", default=more, help=f"more pytest options (default: {more})")


def selection(args: argparse.Namespace, paths: Sequence[str]) -> list[str]:
    """pytest's arguments for ``paths`` and the options of ``add_selection_arguments``."""
    out = [*paths, "-m", args.marker, *shlex.split(args.pytest_args)]
    return out + (["-k", args.keyword] if args.keyword else [])


def inputs(run: SuiteRun) -> list[Path]:
    """The result's inputs: the test files collected and the files under ``tests/`` this
    process imported or read (conftest, helpers, fixtures)."""
    used = {provenance.ROOT / p for p in provenance.measured_files(roots=(TESTS,))}
    return sorted(used | {f for f in run.files if f.is_file()})


def gpu_test_files(root: Path = provenance.ROOT, exclude: Sequence[str] = ()) -> list[str]:
    """The test files under ``tests/`` that mark a test ``gpu`` (by their text: a file that moves
    stays in), relative to ``root``, but ``exclude``."""
    found = []
    with provenance.unrecorded():  # finding them is not running them
        for f in sorted((root / TESTS).rglob("test_*.py")):
            rel = f.relative_to(root).as_posix()
            if rel not in exclude and "mark.gpu" in f.read_text(errors="replace"):
                found.append(rel)
    return found
