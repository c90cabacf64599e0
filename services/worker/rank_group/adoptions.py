"""Peers' sessions adopted by the ranks of a data-parallel-attention group (DESIGN §10).

Each rank of such a group is an owner of its own at the node's store, so a peer's session is
adopted by one rank under that rank's registration. Rank 0, which the gateway's ``Adopt``
reaches, places it (``RankGroup.adopt_on``); another rank adopts it before the next step
(``here``, with the adopter its start-up ``registered``) and reports what it did with that
step's outputs (``reported``); rank 0 mirrors each adopted session and keeps the outcomes for
the caller (``received``, ``take``). Every rank also reports its registration (owner and
generation) with its load (``with_registration``): the gateway takes a dead group's session
from the registration of the rank that ran it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from services.worker.rank_group.mirror import Resumed
from services.worker.rank_group.placement import RankLoad
from services.worker.request.request import Request

# the lockstep op that asks a data-parallel rank to adopt a peer's session
ADOPT = "adopt_peer"
# (request id, whom from) -> (the running request or None, why not: code, message)
RankAdopter = Callable[[str, Any], "tuple[Request | None, str, str]"]


@dataclass(frozen=True)
class AdoptionOutcome:
    """What a rank did with a peer's session rank 0 asked it to adopt: the session it
    resumed, or why it did not (``code``: ``NotAdopted``'s, and ``message``)."""

    request_id: str
    session: Resumed | None
    code: str = ""
    message: str = ""


class RankAdoptions:
    def __init__(self) -> None:
        self._link: Any = None  # this rank's store registration (``registered``)
        self._adopt: RankAdopter | None = None
        self._outcomes: list[AdoptionOutcome] = []  # this rank's, for rank 0
        self._received: list[tuple[AdoptionOutcome, Request | None]] = []  # rank 0's

    def registered(self, link: Any, adopt: RankAdopter | None = None) -> None:
        """This rank's registration with the node's store (``durable.host_link.HostLink``:
        its owner and generation go to rank 0 with every load it reports) and, on a
        data-parallel rank, how it adopts a peer's session (``durable.adoption.rank_adopter``)."""
        self._link, self._adopt = link, adopt

    def with_registration(self, load: RankLoad) -> RankLoad:
        """``load`` with this rank's store registration, if any."""
        if self._link is None:
            return load
        return replace(load, owner=self._link.owner, generation=self._link.generation)

    def here(self, request_id: str, source: Any) -> None:
        """On the rank rank 0 chose: adopts a peer's session; the outcome goes to rank 0 with
        this step's outputs (``reported``)."""
        if self._adopt is None:
            req, code, why = None, "failed_precondition", "this rank keeps no durable sessions"
        else:
            req, code, why = self._adopt(request_id, source)
        session = Resumed.of(req) if req is not None else None
        self._outcomes.append(AdoptionOutcome(request_id, session, code, why))

    def reported(self) -> list[AdoptionOutcome]:
        """This rank's outcomes since its last report (then none)."""
        out, self._outcomes = self._outcomes, []
        return out

    def received(self, outcome: AdoptionOutcome, mirror: Request | None) -> None:
        """Rank 0: another rank's outcome, with the adopted session's mirror (None: none)."""
        self._received.append((outcome, mirror))

    def take(self) -> list[tuple[AdoptionOutcome, Request | None]]:
        """Rank 0: the outcomes received since the last call, each adopted session with its
        mirror (which holds the outputs of the step it was adopted in)."""
        out, self._received = self._received, []
        return out
