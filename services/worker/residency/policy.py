"""Pure residency policy: whom to reclaim (eq. 4) and whom to refill next. No tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.worker.kv.config import RECLAIM_ORDERS


@dataclass(frozen=True)
class Holder:
    """A request that holds optional pages it could give back."""

    slot: int
    pages: int  # a_r: optional pages held and not already being reclaimed
    admitted: int  # admission sequence number (older = smaller)


def reclaim_order(holders: Sequence[Holder], order: str) -> list[Holder]:
    """The reclaim order r1, r2, ...; ties go to the older admission."""
    if order == "largest":
        key = lambda h: (-h.pages, h.admitted)  # noqa: E731 - fewest requests disturbed
    elif order == "smallest":
        key = lambda h: (h.pages, h.admitted)  # noqa: E731
    elif order == "oldest":
        key = lambda h: (h.admitted,)  # noqa: E731
    elif order == "newest":
        key = lambda h: (-h.admitted,)  # noqa: E731
    else:
        raise ValueError(f"unknown reclaim order {order!r}; choose from {RECLAIM_ORDERS}")
    return sorted((h for h in holders if h.pages > 0), key=key)


def requests_to_reclaim(ordered: Sequence[Holder], deficit: int) -> list[Holder] | None:
    """Eq. 4: the first q requests of the order, q = min{q : sum_{i<=q} a_{r_i} >= deficit};
    ``None`` when all optional pages together cannot cover the deficit (the admission waits)."""
    if deficit <= 0:
        return []
    taken, total = [], 0
    for h in ordered:
        taken.append(h)
        total += h.pages
        if total >= deficit:
            return taken
    return None


def refill_pays(steps_left: int, topk: int, rows: int, payback: float) -> bool:
    """Whether refilling a request's history pays for the copy. A decode step selects k of the
    V rows a source holds, so a refilled page of p rows spares about p·k/V host reads per step
    and pays back the p rows copied after V/k steps: refill only while the request has
    ``payback`` times that many steps left (0: always)."""
    return steps_left * topk >= payback * rows


class RoundRobin:
    """Bounded round-robin over requests that miss optional history: each attempt hands out at
    most ``budget`` pages, one request after another, resuming where the last attempt ended."""

    def __init__(self) -> None:
        self._last = -1

    def plan(self, wants: dict[int, int], budget: int) -> dict[int, int]:
        """``wants``: slot -> pages it could use. Returns slot -> pages to populate now."""
        slots = sorted(s for s, n in wants.items() if n > 0)
        if not slots or budget <= 0:
            return {}
        start = next((i for i, s in enumerate(slots) if s > self._last), 0)
        order = slots[start:] + slots[:start]
        grant: dict[int, int] = {}
        left = {s: wants[s] for s in order}
        while budget > 0 and any(left.values()):
            for s in order:
                if budget == 0:
                    break
                if left[s]:
                    grant[s] = grant.get(s, 0) + 1
                    left[s] -= 1
                    budget -= 1
                    self._last = s
        return grant
