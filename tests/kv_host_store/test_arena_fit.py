"""A host arena that does not fit the machine (the free space of its tmpfs, or the memory
available) is refused at start, with a message naming the setting to change: by
``check_arena_fits`` and by the store's CLI (``dhisparse up``: tests/cli/test_up.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.kv_host_store.errors import ArenaError
from services.kv_host_store.fit import CAPACITY_SETTING, check_arena_fits, mem_available, misfit
from tests.conftest import free_port

GIB = 1 << 30


def test_misfit_names_the_setting_and_what_binds() -> None:
    assert misfit(GIB, "/dev/shm", 2 * GIB, 4 * GIB, "--cap") is None
    assert misfit(GIB, "/dev/shm", 2 * GIB, None, "--cap") is None  # memory unknown
    fs = misfit(3 * GIB, "/dev/shm", 2 * GIB, 4 * GIB, "--cap")
    assert fs is not None and "/dev/shm (2.00 GiB free)" in fs and "lower --cap" in fs
    mem = misfit(3 * GIB, "/dev/shm", 8 * GIB, 2 * GIB, "--cap")
    assert mem is not None and "available memory (2.00 GiB MemAvailable)" in mem
    assert "lower --cap" in mem


def test_the_machine_is_read_and_a_huge_arena_refused(arena_path: Path) -> None:
    assert (mem_available() or 0) > 0  # Linux reports it
    check_arena_fits(arena_path, 1 << 20)
    with pytest.raises(ArenaError, match="DHISPARSE_KV_STORE_CAPACITY"):
        check_arena_fits(arena_path, 1 << 60)
    with pytest.raises(ArenaError, match="does not exist"):
        check_arena_fits(arena_path.parent / "no-such-dir" / "arena", 1 << 20)
    assert "--kv-store-capacity" in CAPACITY_SETTING


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dhisparse.cli", *argv],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_the_store_refuses_an_arena_that_does_not_fit(arena_path: Path) -> None:
    r = _run("kv-host-store", "--port", str(free_port()), "--metrics-port", "0",
             "--arena-path", str(arena_path), "--capacity", "1EiB")  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "does not fit" in r.stderr and "DHISPARSE_KV_STORE_CAPACITY" in r.stderr, r.stderr
    assert not arena_path.exists()
