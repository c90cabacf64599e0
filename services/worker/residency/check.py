"""The residency invariant checker, run by tests and by ``DHISPARSE_CHECK_INVARIANTS``:
eq. 3 holds, published pages are owned and in a publishable state, and every committed row
of every admitted request is in its tail ring, in a published page, or backed up on the host."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.residency.optional_history import State, page_key

if TYPE_CHECKING:
    from services.worker.residency.residency import Residency


def check_residency(res: Residency) -> None:
    """Raises AssertionError when eq. 3 or the residency invariant is broken."""
    payload = res.p
    assert res.required_pages + res.optional_pages + res.reserve <= payload.pages.total, (
        "eq. 3 broken"
    )
    p, ring = payload.page, payload.ring
    for slot, oid in res._slot_owner.items():
        owner = res._owners[oid]
        committed = payload.committed.get(slot)
        if committed is None:
            continue
        for source, geo in enumerate(payload.geo):
            opt = geo.opt_map[slot].tolist()
            for index, page in enumerate(opt):
                pg = owner.pages.get(page_key(source, index))
                if page >= 0:
                    assert pg is not None and pg.page == page, "published page not owned"
                    assert pg.state in (State.READY, State.BACKING), f"{pg.state} published"
                elif pg is not None:
                    assert pg.state in (State.PENDING, State.DRAINING), f"{pg.state} hidden"
            ring_hi = max(committed[source], payload.ring_hi_of[slot][source])
            on_device = max(0, ring_hi - ring)  # rows below the valid tail ring
            for index in range(-(-on_device // p)):
                lo, hi = index * p, min(index * p + p, on_device)
                if index < len(opt) and opt[index] >= 0:
                    continue
                assert payload.host.durable(slot, source, lo, hi), (
                    f"slot {slot} source {source} rows [{lo}, {hi}) neither on the device "
                    "nor backed up"
                )
