from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.kv_host_store.arena import HostArena, map_arena
from services.kv_host_store.errors import ArenaError, ArenaInUse

CAP = 1 << 20

# Reads bytes [offset, offset+n) through its own mapping, prints them as hex, then writes
# the bytes 0..255 repeated at offset+n.
CHILD = """
import sys
from services.kv_host_store import map_arena
path, cap, offset, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
m = map_arena(path, cap)
print(m.array[offset : offset + n].tobytes().hex())
m.array[offset + n : offset + 2 * n] = [i % 256 for i in range(n)]
"""


def test_two_mappings_share_bytes(arena_path: Path) -> None:
    arena = HostArena.create(arena_path, CAP)
    try:
        assert arena_path.stat().st_size == CAP
        a, b = map_arena(arena_path, CAP), map_arena(arena_path)
        assert b.capacity == CAP and a.tensor.shape == (CAP,) and a.tensor.dtype == torch.uint8
        rows = a.rows(4096, 8, 16)  # [8, 16] uint8
        rows.copy_(torch.arange(128, dtype=torch.uint8).view(8, 16))
        assert torch.equal(b.region(4096, 128), torch.arange(128, dtype=torch.uint8))
        a.close()
        b.close()
    finally:
        arena.close(remove=True)
    assert not arena_path.exists()


def test_another_process_sees_and_writes_the_same_bytes(arena_path: Path) -> None:
    arena = HostArena.create(arena_path, CAP)
    try:
        with map_arena(arena_path, CAP) as m:
            payload = os.urandom(1000)
            m.array[8192 : 8192 + 1000] = list(payload)
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(arena_path), str(CAP), "8192", "1000"],
                check=True,
                capture_output=True,
                text=True,
                timeout=120,
            ).stdout.strip()
            assert bytes.fromhex(out) == payload
            assert m.array[9192:10192].tolist() == [i % 256 for i in range(1000)]
    finally:
        arena.close(remove=True)


def test_map_never_creates_or_resizes(arena_path: Path) -> None:
    with pytest.raises(ArenaError, match="no arena file"):
        map_arena(arena_path, CAP)
    assert not arena_path.exists()
    arena = HostArena.create(arena_path, CAP)
    try:
        with pytest.raises(ArenaError, match="expected"):
            map_arena(arena_path, 2 * CAP)
        assert arena_path.stat().st_size == CAP
    finally:
        arena.close(remove=True)


def test_second_store_on_the_same_path_is_refused(arena_path: Path) -> None:
    first = HostArena.create(arena_path, CAP)
    try:
        with pytest.raises(ArenaInUse):
            HostArena.create(arena_path, CAP)
    finally:
        first.close(remove=False)
    assert arena_path.exists()  # kept: remove=False
    # With the owner gone the stale file is replaced by a fresh (zeroed) one.
    with map_arena(arena_path, CAP) as old:
        old.array[:4] = [1, 2, 3, 4]
        second = HostArena.create(arena_path, CAP)
        try:
            with map_arena(arena_path, CAP) as new:
                assert new.array[:4].tolist() == [0, 0, 0, 0]
            assert old.array[:4].tolist() == [1, 2, 3, 4]  # the old mapping kept its file
        finally:
            second.close(remove=True)


def test_close_removes_only_its_own_file(arena_path: Path) -> None:
    first = HostArena.create(arena_path, CAP)
    arena_path.unlink()  # someone replaced the path under the first store
    second = HostArena.create(arena_path, CAP)
    first.close(remove=True)
    assert arena_path.exists()
    second.close(remove=True)
    assert not arena_path.exists()


def test_arena_larger_than_tmpfs_is_refused(arena_path: Path) -> None:
    with pytest.raises(ArenaError, match="does not fit"):
        HostArena.create(arena_path, 1 << 60)
    assert not arena_path.exists()


def test_views_are_bounds_checked_and_pin_is_guarded(arena_path: Path) -> None:
    arena = HostArena.create(arena_path, CAP)
    try:
        with map_arena(arena_path, CAP) as m:
            with pytest.raises(ValueError, match="outside"):
                m.region(CAP - 10, 11)
            with pytest.raises(ValueError, match="outside"):
                m.region(-1, 1)
            if not torch.cuda.is_available():
                assert m.pin() is False and not m.pinned
    finally:
        arena.close(remove=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_mapping_copies_to_the_gpu(arena_path: Path) -> None:
    arena = HostArena.create(arena_path, CAP)
    try:
        with map_arena(arena_path, CAP) as m:
            assert m.pin() and m.pinned
            src = m.rows(0, 16, 64)
            src.copy_(torch.randint(0, 256, (16, 64), dtype=torch.uint8))
            assert torch.equal(src.cuda(non_blocking=True).cpu(), src)
    finally:
        arena.close(remove=True)
