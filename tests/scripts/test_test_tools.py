"""``scripts/test-tools`` (the first step of ``make test``): run by a user without root or sudo
while a system tool is missing, it stops at once, naming each missing tool and the command that
installs it, and touches nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "test-tools"
NOBODY = 65534
# What the script runs before it decides; redis-server, prometheus, promtool and sudo are left
# out, so to this PATH they are missing.
COMMANDS = ("bash", "dirname", "id", "env")


@pytest.fixture
def sandbox() -> Iterator[Path]:
    """A copy of the script in a directory the unprivileged user can read (pytest's tmp_path
    is private to root), and a bin directory holding only ``COMMANDS``."""
    top = Path(tempfile.mkdtemp(prefix="dhisparse-test-tools-"))
    try:
        (top / "scripts").mkdir()
        shutil.copy2(SCRIPT, top / "scripts" / "test-tools")
        (top / "bin").mkdir()
        for name in COMMANDS:
            found = shutil.which(name)
            assert found is not None, name
            (top / "bin" / name).symlink_to(found)
        for d in (top, top / "scripts", top / "bin"):
            d.chmod(0o755)
        yield top
    finally:
        shutil.rmtree(top)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the script as another user")
def test_without_root_a_missing_system_tool_stops_at_once(sandbox: Path) -> None:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    argv = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            str(sandbox / "scripts" / "test-tools")]  # fmt: skip
    env = {"PATH": str(sandbox / "bin"), "HOME": "/nonexistent", "LANG": "C"}
    t0 = time.monotonic()
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)
    elapsed = time.monotonic() - t0
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert elapsed < 5  # nothing was tried before the verdict
    for tool in ("redis-server", "prometheus", "promtool"):
        assert f"  {tool} (Debian package" in r.stderr, r.stderr
    assert "apt-get install -y --no-install-recommends redis-server prometheus" in r.stderr
    assert "root or sudo" in r.stderr
    assert not (sandbox / ".tools").exists()  # it stopped before the repo-local tools


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the script as another user")
def test_present_system_tools_need_no_privilege(sandbox: Path) -> None:
    """With every system tool on PATH and the repo-local ones in place, an unprivileged user
    runs the script silently: it asks for root only for what is missing."""
    if not (ROOT / ".tools" / "bin").is_dir():
        pytest.skip(".tools/bin is not installed (make test installs it first)")
    for tool in ("redis-server", "prometheus", "promtool"):
        found = shutil.which(tool)
        if found is None:
            pytest.fail(f"{tool} is not installed: run scripts/test-tools as root")
        (sandbox / "bin" / tool).symlink_to(found)
    shutil.copytree(ROOT / ".tools", sandbox / ".tools", copy_function=_link_or_copy)
    argv = [shutil.which("setpriv") or "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
            "--clear-groups", str(sandbox / "scripts" / "test-tools")]  # fmt: skip
    env = {"PATH": str(sandbox / "bin"), "HOME": "/nonexistent", "LANG": "C"}
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
