"""The repository travels whole to the GPU machine (a working tree of at most 64 MiB): the
tracked files stay within 54 MiB, so that the untracked files a device run carries (the
wheels, about 9 MiB, and the provenance) fit beside them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 54 << 20


def test_the_tracked_tree_stays_within_54_mib() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (the device's copy of the tree has no .git)")
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.split(b"\0")
    sizes = {f.decode(): (ROOT / f.decode()).stat().st_size for f in files if f}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= LIMIT, f"{total / 2**20:.1f} MiB tracked; the largest: {largest}"
