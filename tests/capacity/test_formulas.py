"""Each formula of the capacity model on hand-computed cases."""

from __future__ import annotations

import pytest

from dhisparse.capacity import (
    DrafterProfile,
    IndexGroup,
    Profile,
    SourceGroup,
    host_bytes,
    host_sessions,
    pool_range,
    required_bytes,
    ring_address,
    ring_rows,
    session_bytes,
    sessions_kept_share,
    sessions_per_gpu,
    sessions_that_fit,
    speculation_pays,
    staging_bytes,
)
from dhisparse.capacity.model import page_rows, source_rows


def hand_profile() -> Profile:
    """Every source kind, two compressions, p=4: small enough to add up by hand."""
    return Profile(
        name="hand",
        sources=(
            SourceGroup(count=2, row_bytes=100),  # sparse, m=1
            SourceGroup(count=1, row_bytes=50, compress=4, window=8),  # sparse, m=4
            SourceGroup(count=1, row_bytes=30, compress=16, kind="dense"),
            SourceGroup(count=1, row_bytes=20, window=5, kind="window"),
        ),
        indexers=(IndexGroup(count=1, key_bytes=10), IndexGroup(count=1, key_bytes=6, compress=4)),
        top_k=4,
        hot_cache_rows=8,
        chi=2,
        page_size=4,
        tail_pages=1,
    )


DRAFTER = DrafterProfile(name="d", window=6, k_max=2, row_bytes=40, fixed_bytes=1000)


def test_rows_and_pages() -> None:
    assert source_rows(50, 1) == 50
    assert source_rows(50, 4) == 12  # eq. 8: complete rows only
    assert source_rows(3, 4) == 0
    assert page_rows(50, 4) == 52
    assert page_rows(48, 4) == 48
    assert page_rows(0, 4) == 0


@pytest.mark.parametrize(
    ("w", "k_max", "p", "expected"),
    [
        (2048, 8, 64, 2176),  # the paper's DFlash2 ring
        (2048, 6, 64, 2176),  # "also covers the six- and four-query blocks"
        (2048, 4, 64, 2176),
        (6, 2, 4, 12),  # 4·⌈(6+2+3)/4⌉
        (8, 1, 4, 12),
        (0, 1, 1, 1),
        (63, 1, 64, 128),  # W + K_max = p: alignment adds a page
    ],
)
def test_ring_rows(w: int, k_max: int, p: int, expected: int) -> None:
    assert ring_rows(w, k_max, p) == expected
    assert ring_rows(w, k_max, p) % p == 0
    assert ring_rows(w, k_max, p) >= w + k_max


def test_ring_rows_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        ring_rows(10, 0, 4)
    with pytest.raises(ValueError):
        ring_rows(-1, 1, 4)


def test_ring_address_values() -> None:
    assert ring_address(0, 0, 12) == 0
    assert ring_address(0, 13, 12) == 1
    assert ring_address(3, 5, 12) == 41
    assert ring_address(2, 2176 * 7 + 9, 2176) == 2 * 2176 + 9
    with pytest.raises(ValueError):
        ring_address(-1, 0, 12)


def test_ring_address_live_positions_never_collide() -> None:
    """Eq. 10: live positions of one slot (fewer than R_d apart) get distinct rows, and
    slots occupy disjoint ranges [i·R_d, (i+1)·R_d)."""
    w, k_max, p = 6, 2, 4
    r_d = ring_rows(w, k_max, p)
    for slot in range(3):
        for frontier in range(0, 50):
            live = range(max(0, frontier - w), frontier + k_max)  # window + current block
            rows = [ring_address(slot, t, r_d) for t in live]
            assert len(set(rows)) == len(rows)
            assert all(slot * r_d <= r < (slot + 1) * r_d for r in rows)


def test_staging_bytes() -> None:
    assert staging_bytes(2, 3, 2, 4, 100) == 2 * 3 * 2 * 4 * 100
    assert staging_bytes(4, 35, 8, 2048, 576) == 1_321_205_760
    assert staging_bytes(4, 0, 8, 2048, 576) == 0


def test_resident_session_by_hand() -> None:
    sb = session_bytes(hand_profile(), 50, "resident")
    # histories: 2·52·100 (m=1) + 12·50 (m=4) + 4·30 (dense m=16, 3 rows -> 1 page)
    assert sb.history == 10_400 + 600 + 120
    assert (sb.hot_cache, sb.tail) == (0, 0)
    # m=4 window: 4·⌈(8+1+3)/4⌉ = 12 rows · 50; window-only: 4·⌈(5+1+3)/4⌉ = 12 rows · 20
    assert sb.window == 600 + 240
    assert sb.index_keys == 52 * 10 + 12 * 6
    assert sb.metadata == 4 * (13 + 3 + 1)  # page map over m = 1, 4, 16
    assert (sb.draft_ring, sb.staging) == (0, 0)
    assert sb.total == 12_620


def test_hierarchy_session_by_hand() -> None:
    sb = session_bytes(hand_profile(), 50, "hierarchy")
    assert sb.history == 120  # only the dense source keeps its history
    assert sb.hot_cache == 2 * 8 * 100 + 8 * 50
    assert sb.tail == 2 * 4 * 100 + 4 * 50
    assert sb.window == 600 + 240
    assert sb.index_keys == 592
    assert sb.metadata == 68
    assert sb.total == 4_620


def test_sessions_with_drafter_by_hand() -> None:
    profile = hand_profile()
    res = session_bytes(profile, 50, "resident", DRAFTER)
    hier = session_bytes(profile, 50, "hierarchy", DRAFTER)
    assert res.draft_ring == hier.draft_ring == 12 * 40  # R_d = 4·⌈(6+2+3)/4⌉
    # windows now cover the verified block: 4·⌈(8+2+3)/4⌉ = 16 rows, 4·⌈(5+2+3)/4⌉ = 12 rows
    assert res.window == hier.window == 16 * 50 + 12 * 20
    assert res.staging == 0  # resident serving stages nothing
    assert hier.staging == 2 * 2 * 4 * 100  # χ·K_max·k·d_kv, d_kv = widest sparse row
    assert res.total == 11_120 + 1_040 + 592 + 68 + 480
    assert hier.total == 120 + 2_000 + 1_000 + 1_040 + 592 + 68 + 480 + 1_600
    assert hier.without_staging == hier.total - 1_600
    assert required_bytes(profile, 50, "hierarchy", DRAFTER) == hier.total
    assert required_bytes(profile, 50, "hierarchy", DRAFTER, staging_reserved=True) == 5_300


def test_sessions_per_gpu_by_hand() -> None:
    p = hand_profile()
    assert sessions_per_gpu(p, 50, "hierarchy", 100_000) == 100_000 // 4_620
    # the drafter's fixed 1,000 B, then 6,900 B a session
    assert sessions_per_gpu(p, 50, "hierarchy", 100_000, drafter=DRAFTER) == 14
    # N = 10 slots: staging 10·1,600 reserved first, 5,300 B a session, capped at N
    assert sessions_per_gpu(p, 50, "hierarchy", 100_000, drafter=DRAFTER, slots=10) == 10
    assert sessions_per_gpu(p, 50, "hierarchy", 100_000, drafter=DRAFTER, slots=20) == 12
    assert sessions_per_gpu(p, 50, "hierarchy", 100_000, fixed_bytes=96_000) == 0
    assert sessions_per_gpu(p, 50, "hierarchy", 1_000, fixed_bytes=5_000) == 0


def test_sessions_that_fit_and_pool_range() -> None:
    assert sessions_that_fit(100, 7) == 14
    assert sessions_that_fit(100, 7, fixed_bytes=30) == 10
    assert sessions_that_fit(100, 7, slots=5) == 5
    assert sessions_that_fit(10, 7, fixed_bytes=30) == 0
    lo, hi = pool_range(10, 7, fixed_bytes=30)
    assert (lo, hi) == (100, 107)
    assert sessions_that_fit(lo, 7, 30) == sessions_that_fit(hi - 1, 7, 30) == 10
    assert sessions_that_fit(hi, 7, 30) == 11


def test_host_bytes_by_hand() -> None:
    p = hand_profile()
    assert host_bytes(p, 50) == 2 * 52 * 100 + 12 * 50  # sparse sources only
    assert host_bytes(p, 50, sessions=3) == 3 * 11_000
    assert host_sessions(p, 50, 100_000) == 9


def test_speculation_pays() -> None:
    assert sessions_kept_share(140, 208) == pytest.approx(140 / 208)
    assert sessions_kept_share(140, 208, load=128) == 1.0
    assert sessions_kept_share(140, 208, load=150) == pytest.approx(140 / 150)
    assert speculation_pays(140, 208, 0.6)
    assert not speculation_pays(140, 208, 0.71)
    assert speculation_pays(140, 208, 0.77, load=128)
    assert not speculation_pays(100, 100, 1.0)  # strict inequality
    with pytest.raises(ValueError):
        sessions_kept_share(1, 0)


def test_session_bytes_validates() -> None:
    with pytest.raises(ValueError):
        session_bytes(hand_profile(), -1, "resident")
    with pytest.raises(ValueError):
        session_bytes(hand_profile(), 10, "paged")  # type: ignore[arg-type]


def test_profile_validates() -> None:
    with pytest.raises(ValueError):
        SourceGroup(count=0, row_bytes=1)
    with pytest.raises(ValueError):
        SourceGroup(count=1, row_bytes=1, kind="window")  # needs a window
    with pytest.raises(ValueError):
        Profile(name="x", sources=(), indexers=(), top_k=1, hot_cache_rows=1, chi=1)
    with pytest.raises(ValueError):
        hand_profile().drafter("none-such")
