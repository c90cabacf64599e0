"""The paper's figures (§3.4, Table 1, discussion) from the GLM-5.3 profile, to the paper's
printed precision. Nothing here restates a figure as an input: each is derived."""

from __future__ import annotations

import pytest

from dhisparse.capacity import (
    GIB,
    TB,
    Mode,
    build_plan,
    draft_ring_bytes,
    glm53,
    glm53_paper_deployment,
    host_bytes,
    host_sessions,
    pool_range,
    ring_rows,
    session_bytes,
    sessions_kept_share,
    sessions_per_gpu,
    speculation_pays,
    staging_bytes,
)
from dhisparse.capacity.builtin import PAPER_SLOTS, PAPER_SPEC_FIXED_BYTES

CONTEXT = 100_000
PROFILE = glm53()
DFLASH2 = PROFILE.drafter("dflash2")
DEPLOYMENT = glm53_paper_deployment()


def printed(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def test_per_session_gib_at_100k() -> None:
    """Table 1: 0.432 vs 4.444 GiB (10.3× less); with DFlash2 0.492 and 4.469 GiB."""
    res = session_bytes(PROFILE, CONTEXT, "resident")
    hier = session_bytes(PROFILE, CONTEXT, "hierarchy")
    res_d = session_bytes(PROFILE, CONTEXT, "resident", DFLASH2)
    hier_d = session_bytes(PROFILE, CONTEXT, "hierarchy", DFLASH2)
    assert printed(res.total / GIB, 3) == "4.444"
    assert printed(hier.total / GIB, 3) == "0.432"
    assert printed(res.total / hier.total, 1) == "10.3"
    assert printed(res_d.total / GIB, 3) == "4.469"
    assert printed(hier_d.total / GIB, 3) == "0.492"


def test_the_accounting_behind_table_1() -> None:
    """Resident: 78·576 B + 21·132 B per token over ⌈100000/64⌉ pages; hierarchy: (B + one
    page)·576 B·78 + all index keys; both plus a 4 B page-map entry per page."""
    pages = -(-CONTEXT // 64)
    res = session_bytes(PROFILE, CONTEXT, "resident")
    hier = session_bytes(PROFILE, CONTEXT, "hierarchy")
    assert res.history == 78 * 576 * pages * 64
    assert res.index_keys == hier.index_keys == 21 * 132 * pages * 64
    assert hier.hot_cache + hier.tail == (4096 + 64) * 576 * 78
    assert res.metadata == hier.metadata == 4 * pages


def test_draft_ring() -> None:
    """§3.4: R_d = 2,176; 35 slots of 12,288 B rows occupy about 0.87 GiB; 0.025 GiB per
    session at 32K and at 100K alike."""
    assert ring_rows(DFLASH2.window, DFLASH2.k_max, PROFILE.page_size) == 2176
    assert printed(draft_ring_bytes(PROFILE, DFLASH2, PAPER_SLOTS) / GIB, 2) == "0.87"
    for context in (32_000, 32_768, 100_000):
        ring = session_bytes(PROFILE, context, "hierarchy", DFLASH2).draft_ring
        assert printed(ring / GIB, 3) == "0.025"


def test_staging_four_arenas_vs_one_per_layer() -> None:
    """§3.4: reusing four arenas instead of one per 78 layers divides staging by 19.5, from
    24.0 to 1.23 GiB per GPU at 35 slots."""
    args = (PAPER_SLOTS, DFLASH2.k_max, PROFILE.top_k, PROFILE.d_kv)
    four = staging_bytes(PROFILE.chi, *args)
    per_layer = staging_bytes(PROFILE.payload_sources, *args)
    assert PROFILE.chi == 4 and PROFILE.payload_sources == 78
    assert printed(four / GIB, 2) == "1.23"
    assert printed(per_layer / GIB, 1) == "24.0"
    assert per_layer / four == 19.5


def test_ring_and_staging_per_session() -> None:
    """§3.4: the windowed ring and reusable staging add 0.060 GiB per session."""
    with_d = session_bytes(PROFILE, CONTEXT, "hierarchy", DFLASH2)
    without = session_bytes(PROFILE, CONTEXT, "hierarchy")
    added = with_d.total - without.total
    assert added == with_d.draft_ring + with_d.staging
    assert printed(added / GIB, 3) == "0.060"


def test_fixed_allocations_for_speculation() -> None:
    """§5: 6.6 GiB of fixed allocations per GPU, read as the drafter's own plus the staging
    reserved for its 35 slots (the assumption documented in docs/capacity.md)."""
    plan = build_plan(PROFILE, CONTEXT, DFLASH2, DEPLOYMENT)
    assert plan.slots is not None and plan.slots.slots == PAPER_SLOTS
    assert plan.slots.fixed_bytes == PAPER_SPEC_FIXED_BYTES
    assert printed(plan.slots.fixed_bytes / GIB, 1) == "6.6"


@pytest.mark.parametrize(
    ("mode", "with_drafter", "total"),
    [
        ("hierarchy", False, 208),
        ("hierarchy", True, 140),
        ("resident", False, 20),
        ("resident", True, 12),
    ],
)
def test_sessions_admitted(mode: Mode, with_drafter: bool, total: int) -> None:
    """§5: the configurations admit 208 and 140 sessions; Table 1: resident histories stop
    fitting at about 20 sessions, 12 with DFlash2 — on the implied deployment."""
    drafter = DFLASH2 if with_drafter else None
    assert DEPLOYMENT.pool_bytes is not None
    per_gpu = sessions_per_gpu(PROFILE, CONTEXT, mode, DEPLOYMENT.pool_bytes, drafter=drafter)
    assert per_gpu * DEPLOYMENT.gpus == total


def test_implied_pool_interval() -> None:
    """One per-GPU pool reproduces all four counts iff it lies in [22.60, 22.91) GiB."""
    hier = session_bytes(PROFILE, CONTEXT, "hierarchy").total
    res = session_bytes(PROFILE, CONTEXT, "resident").total
    hier_d = session_bytes(PROFILE, CONTEXT, "hierarchy", DFLASH2).total
    res_d = session_bytes(PROFILE, CONTEXT, "resident", DFLASH2).total
    ranges = [
        pool_range(208 // 4, hier),
        pool_range(20 // 4, res),
        pool_range(140 // 4, hier_d, DFLASH2.fixed_bytes),
        pool_range(12 // 4, res_d, DFLASH2.fixed_bytes),
    ]
    lo, hi = max(r[0] for r in ranges), min(r[1] for r in ranges)
    assert (printed(lo / GIB, 2), printed(hi / GIB, 2)) == ("22.60", "22.91")
    assert DEPLOYMENT.pool_bytes is not None and lo <= DEPLOYMENT.pool_bytes < hi


def test_other_readings_of_the_session_counts_are_inconsistent() -> None:
    """Why the assumption: with the sessions on one or two GPUs, or with the 6.6 GiB added on
    top of the staging each session already pays for, no single pool gives both counts."""
    hier = session_bytes(PROFILE, CONTEXT, "hierarchy").total
    hier_d = session_bytes(PROFILE, CONTEXT, "hierarchy", DFLASH2).total
    readings = [(g, f) for g in (1, 2) for f in (DFLASH2.fixed_bytes, PAPER_SPEC_FIXED_BYTES)]
    readings.append((4, PAPER_SPEC_FIXED_BYTES))  # staging counted twice
    for gpus, fixed in readings:
        base = pool_range(208 // gpus, hier)
        spec = pool_range(140 // gpus, hier_d, fixed)
        assert base[1] <= spec[0] or spec[1] <= base[0], (gpus, fixed)


def test_host_backups() -> None:
    """§5: 208 sessions back up 0.93 TB of a 4.3 TB host, which would hold about 950."""
    assert printed(host_bytes(PROFILE, CONTEXT, 208) / TB, 2) == "0.93"
    assert DEPLOYMENT.host_bytes == 4.3 * TB
    held = host_sessions(PROFILE, CONTEXT, DEPLOYMENT.host_bytes)
    assert held == 956  # "about 950"
    assert abs(held - 950) / 950 < 0.01


def test_speculation_pays_eq13() -> None:
    """§5: once both configurations fill their slots the share kept is 140/208 = 0.67, below
    the TPOT ratio 0.71 measured at C256; at C128 (ratio 0.77) both run every session."""
    plan = build_plan(PROFILE, CONTEXT, DFLASH2, DEPLOYMENT, tpot_ratio=0.71, load=256)
    assert plan.speculation is not None
    assert (plan.speculation.n_spec, plan.speculation.n_base) == (140, 208)
    assert printed(sessions_kept_share(140, 208), 2) == "0.67"
    assert plan.speculation.pays is False
    assert speculation_pays(140, 208, 0.77, load=128)
    assert not speculation_pays(140, 208, 0.77, load=256)
