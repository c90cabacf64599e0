"""Provenance and ``python -m bench stale``: a result names the files it measured by the hash of
their code (``test_code_hash.py``); it goes stale when one of them changes and not when another
file does; a tree without ``.git`` writes results only with the ``bench/PROVENANCE.json`` that
``prepare`` wrote (git blob hashes) for exactly that tree; the committed results are true at
HEAD."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.core import provenance
from bench.stale import check, stale_results
from tests.bench.helpers import ROOT, bench
from tests.bench.test_projection import serving


def test_hashes_are_gits_blob_hashes(tmp_path) -> None:
    f = tmp_path / "x.py"
    f.write_bytes(b"print('hello')\n\x00\xff")
    want = subprocess.run(["git", "hash-object", str(f)], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    assert provenance.file_hash(f) == want
    f.write_bytes(b"print('hello!')\n")  # a new size: hashed again, not taken from the cache
    assert provenance.file_hash(f) != want


def test_measured_files_are_the_modules_imported_and_the_files_read() -> None:
    provenance.track_reads()
    import bench.cli
    import bench.stale  # noqa: F401

    config = ROOT / "models" / "glm-dsa-mini" / "config.json"
    json.loads(config.read_text())
    files = provenance.measured_files()
    assert {"bench/stale.py", "bench/core/__init__.py", "models/glm-dsa-mini/config.json"} <= set(
        files
    )
    # the shards beside the config, which safetensors opens outside Python's open
    assert {"models/glm-dsa-mini/model-00001-of-00002.safetensors",
            "models/glm-dsa-mini/model-00002-of-00002.safetensors"} <= set(files)  # fmt: skip
    for recording in ("bench/cli.py", "bench/__main__.py", "bench/core/provenance.py"):
        assert recording not in files  # dispatching and recording measure nothing
    assert all(f.split("/")[0] in provenance.MEASURED_ROOTS for f in files)


ROOTS = ("bench", "services", "dhisparse", "models")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Iterator[Path]:
    """A git checkout of the tree as it is (tracked and untracked files that git does not
    ignore), committed: where ``prepare`` runs."""
    repo = tmp_path_factory.mktemp("checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *ROOTS,
         ".gitignore"], cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    for p in filter(None, listed):
        if (ROOT / p).is_file():
            (repo / p).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / p, repo / p)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "tree"], check=True)
    yield repo


@pytest.fixture(scope="module")
def device_tree(checkout: Path, tmp_path_factory) -> Path:
    """The checkout after ``python -m bench prepare``, copied without ``.git`` (as the GPU
    machine's copy is)."""
    proc = bench("prepare", cwd=checkout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (checkout / provenance.PREPARED).exists()
    status = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert status == ""  # the file is git-ignored: preparing leaves the tree clean
    tree = tmp_path_factory.mktemp("device") / "tree"
    shutil.copytree(checkout, tree, ignore=shutil.ignore_patterns(".git"))
    return tree


def _projection(tree: Path, tmp: Path) -> tuple[subprocess.CompletedProcess, Path]:
    src, out = tmp / "serving.json", tmp / "projection.json"
    src.write_text(json.dumps(serving()))
    out.unlink(missing_ok=True)
    return bench("projection", "--serving", str(src), "--out", str(out), cwd=tree), out


def test_without_git_and_without_the_prepared_file_no_result_is_written(
    checkout: Path, tmp_path
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(checkout, bare, ignore=shutil.ignore_patterns(".git", "PROVENANCE.json"))
    proc, out = _projection(bare, tmp_path)
    assert proc.returncode == 2 and not out.exists()
    assert "no .git and no bench/PROVENANCE.json" in proc.stderr
    assert "python -m bench prepare" in proc.stderr


def test_prepare_then_run_without_git(checkout: Path, device_tree: Path, tmp_path) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(device_tree, tree)
    proc, out = _projection(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    prov = json.loads(out.read_text())["provenance"]
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert prov["source"] == provenance.PREPARED
    assert prov["commit"] == head and prov["dirty"] is False
    recorded = json.loads((tree / provenance.PREPARED).read_text())["files"]
    assert {"bench/projection.py", "dhisparse/capacity/__init__.py"} <= prov["files"].keys()
    assert all(recorded[p] == provenance.file_hash(tree / p) for p in prov["files"])
    assert prov["hash_scheme"] == provenance.HASH_SCHEME
    assert all(provenance.measured_hash(tree / p) == h for p, h in prov["files"].items())
    assert prov["code_hash"] == provenance.code_hash(prov["files"])
    # Fresh in that tree; an edit elsewhere leaves it fresh, an edit to code it ran does not.
    assert check(out, tree) is None
    unrelated = tree / "services" / "gateway" / "app.py"
    assert "services/gateway/app.py" not in prov["files"]
    unrelated.write_text(unrelated.read_text() + "\nEDITED = 1\n")
    assert check(out, tree) is None
    measured = tree / "bench" / "serving" / "scaling.py"
    measured.write_text(measured.read_text() + "\n# a comment: still the code it ran\n")
    assert check(out, tree) is None
    measured.write_text(measured.read_text() + "\nEDITED = 1\n")
    found = check(out, tree)
    assert found is not None and found.commit == head
    assert found.reasons == ("bench/serving/scaling.py (code changed)",)


def test_a_copy_that_brought_an_older_git_takes_the_prepared_commit(
    checkout: Path, device_tree: Path, tmp_path
) -> None:
    """The GPU machine's copy may hold a ``.git`` of an older commit, against which the tree is
    dirty: the prepared file, which the tree still matches, names the code; a clean checkout
    names its own HEAD."""
    tree = tmp_path / "tree"
    shutil.copytree(device_tree, tree)
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    subprocess.run(["git", "-C", str(tree), "commit", "-q", "--allow-empty", "-m", "old"],
                   check=True, env=env)  # fmt: skip
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    src = provenance.source(tree)
    assert src["source"] == provenance.PREPARED and src["commit"] == head
    assert provenance.source(checkout)["source"] == "git"


def test_a_tree_changed_after_prepare_writes_no_result(device_tree: Path, tmp_path) -> None:
    changed = tmp_path / "changed"
    shutil.copytree(device_tree, changed)
    f = changed / "bench" / "core" / "clock.py"
    f.write_text(f.read_text() + "\n# edited after prepare\n")
    proc, out = _projection(changed, tmp_path)
    assert proc.returncode == 2 and not out.exists()
    assert "bench/core/clock.py (changed)" in proc.stderr and "prepare again" in proc.stderr


def test_stale_lists_changed_code_inputs_and_results_without_provenance(tmp_path) -> None:
    root = tmp_path / "root"
    (root / "bench").mkdir(parents=True)
    code = root / "bench" / "m.py"
    code.write_text("x = 1\n")
    results = root / "docs" / "results"
    (results / "archive").mkdir(parents=True)
    fresh = {"provenance": {"commit": "a" * 40, "files": {"bench/m.py": provenance.file_hash(code)},
                            "inputs": {}}}  # fmt: skip
    (results / "fresh.json").write_text(json.dumps(fresh))
    (results / "derived.json").write_text(json.dumps(
        {"provenance": {**fresh["provenance"],
                        "inputs": {"docs/results/fresh.json": "0" * 40}}}
    ))  # fmt: skip
    (results / "bare.json").write_text(json.dumps({"runs": []}))
    (results / "archive" / "old.json").write_text(json.dumps({"runs": []}))
    found = {s.result: s.reasons for s in stale_results(results, results / "archive", root)}
    assert found == {
        "docs/results/bare.json": ("no provenance (it names no code it measured)",),
        "docs/results/derived.json": ("docs/results/fresh.json (input changed)",),
    }
    code.write_text("x = 2\n")
    found = {s.result: s.reasons for s in stale_results(results, results / "archive", root)}
    assert found["docs/results/fresh.json"] == ("bench/m.py (code changed)",)
    code.unlink()
    assert check(results / "fresh.json", root).reasons == ("bench/m.py (code deleted)",)


def test_no_committed_result_is_stale_outside_the_archive() -> None:
    proc = bench("stale")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "no stale results under docs/results" in proc.stdout
