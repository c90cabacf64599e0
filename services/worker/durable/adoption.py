"""A worker process taking over the sessions its predecessor left in the host store.

On start, after registering a new generation (``take_over``), a worker adopts every request
that earlier generations of its own owner id (its worker id; a data-parallel rank's own,
``ParallelConfig.store_owner``) still hold (those processes are gone: the store fences their
calls off), reads each one's manifest and resumes it in the engine. A request that cannot be
resumed (no valid manifest, no room) is released so that its capacity returns; it is reported,
and the gateway's re-attach for it gets NOT_FOUND.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from services.worker.durable.host_link import HostLink
from services.worker.durable.manifest import ManifestError, SessionRecord
from services.worker.durable.restore import read_manifest

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


def adopt_sessions(
    engine: Adopter, store: KVHostStoreClient | LocalHostStore, owner: str, generation: int
) -> AdoptionReport:
    """Adopts and resumes the requests of ``owner``'s earlier generations. ``store``: the
    host-store client (or ``LocalHostStore``) whose arena ``engine`` maps; ``engine`` must run
    a hierarchy mode with durable sessions and not be stepping concurrently."""
    report = AdoptionReport()
    kv = engine.kv
    if kv.sessions is None:
        return report
    mapping = kv.host_backups.mapping
    for info in store.list_requests(owner, adoptable_only=True):
        if info.generation >= generation:
            continue
        rid = info.request_id
        regions = store.adopt(rid, owner, generation)
        try:
            version, rec = read_manifest(mapping, regions)
            if rec.request_id != rid:
                raise ManifestError(f"manifest names request {rec.request_id!r}")
            req = engine.restore(rec, version, regions)
            why = None if req is not None else "no free slot or device room"
        except (ManifestError, ValueError) as e:
            why = str(e)
        if why is None:
            report.resumed.append(rid)
            log.info(
                "resumed %s from generation %d at %d tokens", rid, info.generation,
                rec.num_computed,
            )  # fmt: skip
            continue
        report.released[rid] = why
        log.warning("cannot resume %s (%s): releasing its host regions", rid, why)
        try:
            store.release_request(owner, rid, generation)
        except Exception as e:  # it expires with the orphans otherwise
            log.warning("release of %s failed: %s", rid, e)
    return report


def take_over(
    engine: Adopter, client: KVHostStoreClient | LocalHostStore, lease_ttl_s: float
) -> HostLink:
    """Registers ``engine``'s owner (its host regions') with the store as a new generation,
    resumes the durable sessions earlier generations left, and starts renewing the lease from
    a thread of its own; returns the link, which ``engine`` reports through
    (``Engine.host_link``). Every rank of a data-parallel group takes over its own owner."""
    owner = engine.kv.host_backups.owner
    link = HostLink(client, owner, lease_ttl_s, engine.kv.host_backups)
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
