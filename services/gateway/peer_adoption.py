"""Moving a stream whose worker died to a live peer of the same node (DESIGN §10).

Every worker of a node maps the node's host store, where each durable session keeps its rows,
index keys and manifest, so any of them can continue a session. When a stream breaks
(``reattach.WORKER_GONE``), the gateway asks the peers that can serve it (``is_peer``: healthy,
on the same node — the same host store, ``kv_store_id`` —, durable, the same model served the same way, one serving rank) in the order
admission ranks them with room for the session (``Admission.try_acquire``: the ledger decides,
per session) to ``Adopt`` it: the peer takes the session over from the store and streams the
rest after the tokens the client has. A peer without room (RESOURCE_EXHAUSTED) or unreachable is
passed over for the next; FAILED_PRECONDITION or NOT_FOUND ends the attempt (the store says the
session is not there to take: its worker lives and keeps it, or its successor resumed it).
Whoever adopts fences the dead worker's generation off first when the dead worker refuses
connections (``unreachable``): its process is gone, and the store need not wait for its lease
to expire. When no peer adopts, the stream waits for the restart as before (``reattach``).

A peer whose process dies inside ``Adopt`` (its call breaks and it refuses connections) may
have taken the session over at the store already: the session is looked for there next — the
stream's origin becomes that peer (``Broke``), whose peers (fencing it off) or successor take
it on. Had it died before the store moved the session, the session is still its first owner's:
a peer asked to take it from the broken one is refused, and the broken one's successor, finding
no such session, adopts it from the store from its first owner, fenced off when that process
refuses connections (``reattach.TakeFrom``).

A worker the stream saw die is not asked again until a health poll hears a new generation at
its address (its successor registered): polls miss a dead worker a few times before they mark
it unhealthy, and asking the dead process would look like a peer dying inside ``Adopt``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio

from dhisparse.rpc import worker_pb2
from services.gateway.convert import ModelInfo
from services.gateway.reattach import WORKER_GONE, unreachable
from services.gateway.routing import Admission, AdmissionJob, Lease
from services.gateway.worker_conn import WorkerClient, describe

log = logging.getLogger(__name__)

# The peer's answer that ends the attempt: the session is not there to take.
_NOT_TAKEN = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND}


@dataclass(frozen=True)
class Origin:
    """The worker a stream ran on, as the gateway knew it while the worker lived."""

    address: str
    generation: int  # its registration with the node's store (its health polls')
    node: str  # the node's host store (its arena id, ``kv_store_id``)
    model: ModelInfo
    # the store owner holding the stream's session, and its generation: the worker's own, or
    # under data-parallel attention the registration of the rank running it
    owner: str
    owner_generation: int

    @classmethod
    def of(cls, w: WorkerClient, rank: int | None = None) -> Origin | None:
        """``w`` as the origin of a stream it runs (on its data-parallel rank ``rank``); None
        when its sessions cannot move (not durable, it never named its node, or a data-parallel
        group's stream whose rank or that rank's registration the gateway does not know)."""
        node = w.load.kv_store_id if w.load is not None else ""
        if w.model is None or not w.model.durable_sessions or not node:
            return None
        owner, generation = w.model.worker_id, w.generation
        if w.load is not None and w.load.serving_ranks > 1:  # each rank holds its own sessions
            if rank is None or not 0 <= rank < len(w.rank_owners):
                return None
            owner, generation = w.rank_owners[rank]
        return cls(w.address, w.generation, node, w.model, owner, generation)


def is_peer(origin: Origin, w: WorkerClient) -> bool:
    """Whether ``w`` can continue ``origin``'s sessions: another healthy worker on the same
    node, with durable sessions, serving the same model the same way (config and KV layout:
    the store checks the rows' salt, which names the parallel layout, besides). A
    data-parallel group adopts on the rank its lease holds room on."""
    m, o = w.model, origin.model
    return (
        w.address != origin.address
        and w.healthy
        and w.load is not None
        and w.load.kv_store_id == origin.node
        and m is not None
        and m.durable_sessions
        and (m.model_name, m.config_json, m.kv_layout_json)
        == (o.model_name, o.config_json, o.kv_layout_json)
    )


@dataclass
class Moved:
    """A stream a peer took over: its first response is in, the rest comes from ``call``."""

    worker: WorkerClient
    lease: Lease
    call: grpc.aio.UnaryStreamCall
    first: worker_pb2.GenerateResponse


@dataclass(frozen=True)
class Broke:
    """A peer whose process died inside ``Adopt`` (on its data-parallel rank ``rank``): the
    store may have moved the session to it before it died, so the session is looked for there
    next (its peers, or its successor)."""

    worker: WorkerClient
    rank: int | None = None


async def move_to_peer(
    workers: Sequence[WorkerClient],
    admission: Admission,
    job: AdmissionJob,
    origin: Origin,
    origin_stub,
    received: int,
    gone: Mapping[str, int] | None = None,
) -> Moved | Broke | None:
    """The stream of ``job`` continued by a peer of ``origin`` after the client's first
    ``received`` tokens; ``Broke`` when the peer asked died inside the call; None when no
    peer took it (none on the node, none with room, or the store says it is not there to
    take). ``gone``: the workers this stream saw die (address: the generation each had), which
    the health polls may not have marked yet: none is asked while its address answers (or last
    answered) as that generation."""
    gone = gone or {}
    peers = [w for w in workers if is_peer(origin, w) and gone.get(w.address) != w.generation]
    if not peers:
        return None
    fence = await unreachable(origin_stub)
    tried: list[str] = []
    while True:
        lease = await admission.try_acquire(job, lambda: [w.status() for w in peers], tried)
        if lease is None:
            return None
        peer = next(w for w in peers if w.address == lease.worker)
        tried.append(peer.address)
        ask = worker_pb2.AdoptSessionRequest(
            request_id=job.request_id, from_owner=origin.owner,
            from_generation=origin.owner_generation, tokens_received=received, fence=fence,
        )  # fmt: skip
        if lease.rank is not None:  # a data-parallel group: the rank the lease holds room on
            ask.dp_rank = lease.rank
        call = peer.stub.Adopt(ask)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            call.cancel()
            lease.release()
            log.warning("peer %s did not adopt %s: %s", peer.address, job.request_id, describe(e))
            if e.code() in _NOT_TAKEN:
                return None
            if e.code() in WORKER_GONE and await unreachable(peer.stub):
                return Broke(peer, lease.rank)
            continue
        if first is grpc.aio.EOF:  # an adopted session always answers with its catch-up
            call.cancel()
            lease.release()
            return None
        log.info("peer %s adopted %s from %s after %d tokens%s", peer.address, job.request_id,
                 origin.address, received, " (fenced it off)" if fence else "")  # fmt: skip
        return Moved(peer, lease, call, first)
