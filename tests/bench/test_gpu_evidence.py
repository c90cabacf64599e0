"""GPU evidence is a result like the others: ``python -m bench gpu-tests`` and ``slices`` run
tests in their own process and write JSON with each test's outcome (and the slices' figures),
the code the tests imported as provenance and the test files as inputs, which ``bench stale``
checks; they work in a copy of the tree without ``.git``. Here on a tiny suite of a passing, a
failing and a skipped test, in a small checkout of ``bench/``."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.core import provenance, suite
from bench.stale import check
from tests.bench.helpers import ROOT, bench

FAKE = '''"""A suite of three."""

import pytest

pytestmark = pytest.mark.gpu


def test_passes():
    """It passes."""
    assert 1 + 1 == 2


def test_fails():
    assert 1 + 1 == 3, "arithmetic"


def test_skipped():
    pytest.skip("no device here")
'''

FAKE_SLICE = '''"""A slice that writes its report where bench slices asks, and one that skips."""

import json
import os
from pathlib import Path

import pytest


@pytest.mark.gpu
def test_slice():
    report = {
        "family": "deepseek_v32", "device": "cuda", "tokens": 3072,
        "injected_logit_error": 0.0157, "logit_error": 0.123, "top1_injected": 0.95,
        "top1": 0.83, "selection_recall": {"0": {"all": 1.0, "sparse": 0.985},
                                           "1": {"all": 1.0, "sparse": 0.999}},
        "routing": {"1": {"identical": 0.9, "overlap": 0.956}, "2": {"identical": 0.9,
                    "overlap": 0.995}},
    }
    Path(os.environ["DHISPARSE_REPORT_DIR"], "real_slice_deepseek_v32.json").write_text(
        json.dumps(report)
    )


@pytest.mark.gpu
def test_skipped_slice():
    pytest.skip("needs a CUDA device")
'''


def _git(tree: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tree), *args],
                   check=True, capture_output=True)  # fmt: skip


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A git checkout of ``bench/`` (with the repository's pytest settings) and the fake
    suites under ``tests/fake/``."""
    tree = tmp_path_factory.mktemp("checkout")
    shutil.copytree(ROOT / "bench", tree / "bench",
                    ignore=shutil.ignore_patterns("__pycache__", "PROVENANCE.json"))  # fmt: skip
    for f in ("pyproject.toml", ".gitignore"):
        shutil.copy2(ROOT / f, tree / f)
    (tree / "tests" / "fake").mkdir(parents=True)
    (tree / "tests" / "fake" / "test_fake.py").write_text(FAKE)
    (tree / "tests" / "fake" / "test_fake_slice.py").write_text(FAKE_SLICE)
    _git(tree, "init", "-q")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "-m", "tree")
    return tree


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_gpu_tests_records_each_outcome_and_goes_stale_with_its_tests(tree: Path, tmp_path):
    work = tmp_path / "tree"
    shutil.copytree(tree, work)
    proc = bench("gpu-tests", "tests/fake/test_fake.py", "--out", "docs/results/gpu_tests.json",
                 cwd=work)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]  # pytest's: a test failed
    out = work / "docs" / "results" / "gpu_tests.json"
    doc = json.loads(out.read_text())
    by = {t["nodeid"]: t for t in doc["tests"]}
    assert {n: t["outcome"] for n, t in by.items()} == {
        "tests/fake/test_fake.py::test_passes": "passed",
        "tests/fake/test_fake.py::test_fails": "failed",
        "tests/fake/test_fake.py::test_skipped": "skipped",
    }
    assert by["tests/fake/test_fake.py::test_skipped"]["skip_reason"] == "no device here"
    assert "arithmetic" in by["tests/fake/test_fake.py::test_fails"]["message"]
    assert all(t["duration_s"] >= 0 for t in doc["tests"])
    assert doc["totals"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1, "tests": 3,
                             "collection_errors": 0}  # fmt: skip
    assert doc["exit_status"] == 1
    assert doc["packages"]["pytest"] == pytest.__version__
    prov = doc["provenance"]
    assert prov["hash_scheme"] == provenance.HASH_SCHEME and prov["source"] == "git"
    assert {"bench/gpu_tests.py", "bench/core/suite.py"} <= prov["files"].keys()
    assert "tests/fake/test_fake.py" in prov["inputs"]
    assert "tests/fake/test_fake_slice.py" not in prov["inputs"]  # not run: not an input
    # `bench stale` checks it: fresh; a docstring of a test leaves it so; code does not
    assert bench("stale", cwd=work).returncode == 0
    test_file = work / "tests" / "fake" / "test_fake.py"
    _edit(test_file, '"""It passes."""', '"""It passes, always."""')
    assert check(out, work) is None
    _edit(test_file, "1 + 1 == 2", "2 + 2 == 4")
    proc = bench("stale", cwd=work)
    assert proc.returncode == 1 and "tests/fake/test_fake.py (input changed)" in proc.stdout
    _edit(test_file, "2 + 2 == 4", "1 + 1 == 2")
    _edit(work / "bench" / "gpu_tests.py", 'SLICES = "', 'SLICES = "renamed_')
    assert check(out, work).reasons == ("bench/gpu_tests.py (code changed)",)


def test_slices_records_each_slices_figures(tree: Path, tmp_path) -> None:
    work = tmp_path / "tree"
    shutil.copytree(tree, work)
    proc = bench("slices", "tests/fake/test_fake_slice.py", "--out", "docs/results/slices.json",
                 cwd=work)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((work / "docs" / "results" / "slices.json").read_text())
    (s,) = doc["slices"].values()
    assert s["family"] == "deepseek_v32" and s["injected_logit_error"] == 0.0157
    assert s["selection_recall_sparse"] == {"min": 0.985, "max": 0.999}
    assert s["routing_overlap"] == {"min": 0.956, "max": 0.995}
    assert doc["totals"]["passed"] == 1 and doc["totals"]["skipped"] == 1
    assert "tests/fake/test_fake_slice.py" in doc["provenance"]["inputs"]
    assert check(work / "docs" / "results" / "slices.json", work) is None
    # no slice reported (every one skipped): no result
    proc = bench("slices", "tests/fake/test_fake_slice.py", "-k", "skipped", "--out",
                 "docs/results/none.json", cwd=work)  # fmt: skip
    assert proc.returncode != 0 and "no slice wrote its report" in proc.stderr
    assert not (work / "docs" / "results" / "none.json").exists()


def test_in_a_copy_without_git_after_prepare(tree: Path, tmp_path) -> None:
    """As on the GPU machine: ``prepare`` in the checkout, the copy carries its file."""
    checkout = tmp_path / "checkout"
    shutil.copytree(tree, checkout)
    assert bench("prepare", cwd=checkout).returncode == 0
    copy = tmp_path / "copy"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git"))
    proc = bench("gpu-tests", "tests/fake/test_fake.py", "-k", "not fails", "--out",
                 "out/gpu_tests.json", cwd=copy)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    prov = json.loads((copy / "out" / "gpu_tests.json").read_text())["provenance"]
    assert prov["source"] == provenance.PREPARED and prov["dirty"] is False


def test_the_default_selection_is_every_gpu_test_file_but_the_slices() -> None:
    files = suite.gpu_test_files()
    assert any(f.endswith("/test_resolver.py") for f in files)
    assert all("mark.gpu" in (ROOT / f).read_text() for f in files)
    from bench.gpu_tests import SLICES

    assert any(f.endswith("/" + SLICES) for f in files)  # the command leaves it out
