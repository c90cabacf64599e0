"""The residency invariant checker, run by tests and by ``DHISPARSE_CHECK_INVARIANTS``:
eq. 3 holds, published pages are owned and in a publishable state, and every committed row
of every admitted request is in its tail ring, in a published page, or backed up on the host."""

from __future__ import annotations

from services.worker.hierarchy.device_store import DeviceStore
from services.worker.residency.optional_history import OptionalHistory, State, page_key


def check_residency(store: DeviceStore, history: OptionalHistory, reserve: int) -> None:
    """Raises AssertionError when eq. 3 or the residency invariant is broken."""
    optional = history.optional_pages
    # pages only cached index keys hold (``serving.key_records``) give way at once: not required
    required = store.pages.total - store.pages.available - optional
    assert required + optional + reserve <= store.pages.total, "eq. 3 broken"
    p, ring = store.page, store.tail
    for _, owner in history.admitted():
        slot = owner.slot
        committed = store.committed.get(slot)
        if committed is None:
            continue
        for source, geo in enumerate(store.geo):
            opt = geo.opt_map[slot].tolist()
            for index, page in enumerate(opt):
                pg = owner.pages.get(page_key(source, index))
                if page >= 0:
                    assert pg is not None and pg.page == page, "published page not owned"
                    assert pg.state in (State.READY, State.BACKING), f"{pg.state} published"
                elif pg is not None:
                    assert pg.state in (State.PENDING, State.DRAINING), f"{pg.state} hidden"
            ring_hi = max(committed[source], store.tail_hi[slot][source])
            on_device = max(0, ring_hi - ring)  # rows below the valid tail ring
            for index in range(-(-on_device // p)):
                lo, hi = index * p, min(index * p + p, on_device)
                if index < len(opt) and opt[index] >= 0:
                    continue
                assert store.host.durable(slot, source, lo, hi), (
                    f"slot {slot} source {source} rows [{lo}, {hi}) neither on the device "
                    "nor backed up"
                )
