"""A worker process taking over sessions that another process left in the host store.

On start, after registering a new generation (``take_over``), a worker adopts every request
that earlier generations of its own owner id (its worker id; a data-parallel rank's own,
``ParallelConfig.store_owner``) still hold (those processes are gone: the store fences their
calls off), reads each one's manifest and resumes it in the engine. A request that cannot be
resumed (no valid manifest, no room) is released so that its capacity returns; it is reported,
and the gateway's re-attach for it gets NOT_FOUND.

A live worker also adopts single sessions of a *peer* of its node — one that died, or drains
— when the gateway moves a stream to it (``adopt_session``, the worker's ``Adopt`` RPC): the
same steps for one request, except that a session it has no room for is handed back to the
store for the next adopter instead of released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from services.kv_host_store.errors import NotFound, StoreError
from services.worker.durable.host_link import HostLink
from services.worker.durable.manifest import ManifestError, SessionRecord
from services.worker.durable.restore import read_manifest
from services.worker.kv.errors import describe

if TYPE_CHECKING:
    from services.kv_host_store.client import KVHostStoreClient
    from services.kv_host_store.records import Region
    from services.worker.hierarchy.local_store import LocalHostStore
    from services.worker.request.request import Request
    from services.worker.serving.cache import KVCache

log = logging.getLogger(__name__)


class Adopter(Protocol):
    """What adoption needs of an engine (``Engine``): its KV state, the link it reports its
    store registration through, and a way to resume one session."""

    kv: KVCache
    host_link: object | None

    def restore(
        self, record: SessionRecord, version: int, regions: list[Region]
    ) -> Request | None: ...


@dataclass
class AdoptionReport:
    resumed: list[str] = field(default_factory=list)
    released: dict[str, str] = field(default_factory=dict)  # request id -> why


@dataclass(frozen=True)
class AdoptFrom:
    """Whom a session is taken from: ``owner`` (a worker id; "" whoever holds it) and its
    ``generation`` (0: any); ``fence``: that process was found unreachable, so the store ends
    its generation first (``HostStore.adopt``)."""

    owner: str = ""
    generation: int = 0
    fence: bool = False


class NotAdopted(RuntimeError):
    """A session this worker could not take over. ``code``: "failed_precondition" (the store
    refused: its owner lives, another adopter won, rows of another salt; or the manifest does
    not fit this engine), "resource_exhausted" (no slot or device room: it was handed back),
    "not_found" (no such session in the store), "unavailable" (the store did not answer) or
    "invalid_argument" (a data-parallel rank the group does not have)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _store_code(e: Exception) -> str:
    if isinstance(e, NotFound):
        return "not_found"
    if isinstance(e, StoreError):  # refused: not this caller's to take (or a bad call)
        return "failed_precondition"
    return "unavailable"  # transport: the store did not answer


def adopt_session(
    engine: Adopter,
    store: KVHostStoreClient | LocalHostStore,
    owner: str,
    generation: int,
    request_id: str,
    source: AdoptFrom = AdoptFrom(),
    *,
    hand_back: bool = False,
) -> Request:
    """Takes ``request_id`` over from the store for ``(owner, generation)`` (``HostStore.adopt``
    from ``source``), reads its manifest and resumes it in ``engine``; returns
    the running request. Raises ``NotAdopted``. A session that cannot be resumed does not stay
    with this owner: one whose manifest does not fit is released (nobody can resume it), one
    for which there is no room is handed back (``hand_back``: offered to the next adopter,
    ``HostStore.hand_over``) or released. Runs where ``engine`` does not step concurrently."""
    try:
        regions = store.adopt(
            request_id, owner, generation, from_owner=source.owner, fence=source.fence,
            from_generation=source.generation,
        )  # fmt: skip
    except Exception as e:
        raise NotAdopted(_store_code(e), describe(e)) from e
    try:
        version, rec = read_manifest(engine.kv.host_backups.mapping, regions, request_id)
        req = engine.restore(rec, version, regions)
    except (ManifestError, ValueError) as e:
        _let_go(store, owner, generation, request_id, str(e), hand_back=False)
        raise NotAdopted("failed_precondition", str(e)) from e
    if req is None:
        why = "no free slot or device room"
        _let_go(store, owner, generation, request_id, why, hand_back=hand_back)
        raise NotAdopted("resource_exhausted", why)
    log.info("resumed %s at %d tokens%s", request_id, rec.num_computed,
             f", adopted from {source.owner}" if source.owner else "")  # fmt: skip
    return req


def rank_adopter(
    engine: Adopter, link: HostLink
) -> Callable[[str, AdoptFrom], tuple[Request | None, str, str]]:
    """How a rank of a data-parallel-attention group registered through ``link`` adopts a
    peer's session rank 0 asked it to (``RankAdoptions.registered``): ``adopt_session`` under its
    own registration, one without room handed back; (the running request or None, and why
    not: ``NotAdopted``'s code and message)."""

    def adopt(request_id: str, source: AdoptFrom) -> tuple[Request | None, str, str]:
        try:
            req = adopt_session(
                engine, link.client, link.owner, link.generation, request_id, source,
                hand_back=True,
            )  # fmt: skip
        except NotAdopted as e:
            return None, e.code, str(e)
        return req, "", ""

    return adopt


def _let_go(
    store: KVHostStoreClient | LocalHostStore,
    owner: str,
    generation: int,
    request_id: str,
    why: str,
    *,
    hand_back: bool,
) -> None:
    """Gives up a session this owner adopted but cannot resume: offered to the next adopter
    (``hand_back``) or released."""
    verb = "handing it back" if hand_back else "releasing its host regions"
    log.warning("cannot resume %s (%s): %s", request_id, why, verb)
    try:
        if hand_back:
            store.hand_over(request_id, owner, generation)
        else:
            store.release_request(owner, request_id, generation)
    except Exception as e:  # it expires with the orphans otherwise
        log.warning("letting %s go failed: %s", request_id, e)


def adopt_sessions(
    engine: Adopter, store: KVHostStoreClient | LocalHostStore, owner: str, generation: int
) -> AdoptionReport:
    """Adopts and resumes the requests of ``owner``'s earlier generations (``adopt_session``).
    ``store``: the host-store client (or ``LocalHostStore``) whose arena ``engine`` maps;
    ``engine`` must run a hierarchy mode with durable sessions and not be stepping
    concurrently."""
    report = AdoptionReport()
    if engine.kv.sessions is None:
        return report
    for info in store.list_requests(owner, adoptable_only=True):
        if info.generation >= generation:
            continue
        try:
            adopt_session(engine, store, owner, generation, info.request_id)
            report.resumed.append(info.request_id)
        except NotAdopted as e:
            report.released[info.request_id] = str(e)
    return report


def take_over(
    engine: Adopter,
    client: KVHostStoreClient | LocalHostStore,
    lease_ttl_s: float,
    salt: str = "",
) -> HostLink:
    """Registers ``engine``'s owner (its host regions') with the store as a new generation
    computing rows of ``salt`` (what a peer must match to adopt them),
    resumes the durable sessions earlier generations left, and starts renewing the lease from
    a thread of its own; returns the link, which ``engine`` reports through
    (``Engine.host_link``). Every rank of a data-parallel group takes over its own owner."""
    owner = engine.kv.host_backups.owner
    link = HostLink(client, owner, lease_ttl_s, engine.kv.host_backups, salt)
    generation = link.register()
    engine.host_link = link
    if engine.kv.sessions is not None:
        report = adopt_sessions(engine, client, owner, generation)
        if report.resumed or report.released:
            log.info(
                "%s took over %d sessions of earlier generations (%d released)", owner,
                len(report.resumed), len(report.released),
            )  # fmt: skip
    link.start()
    return link
