"""The gateway moves a stream whose worker died to a live peer of the same node: the peer is
asked to ``Adopt`` it from the dead worker (fenced off, since its address refuses connections)
after the tokens the client has, and the stream goes on with nothing lost or doubled; a peer
without room is passed over and the stream waits for the restart; a peer on another node is
never asked; a peer that dies inside ``Adopt`` is where the stream is looked for next (its
successor resumes it, or adopts it from the worker that died first when the store had not moved
it yet), and a worker that died is not asked again before its successor answers. Fake workers (in-process gRPC) play the dying worker and its peer; the admission
is a counting one that admits at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence

import grpc
import grpc.aio

from dhisparse.rpc import worker_pb2 as pb
from dhisparse.rpc import worker_pb2_grpc as pb_grpc
from services.gateway.generation import GenerationInput, SamplingSpec
from services.gateway.metrics import GatewayMetrics
from services.gateway.routing import AdmissionJob, WorkerStatus
from services.gateway.worker_client import WorkerPool
from tests.gateway.test_reattach import TOKENS, CountingAdmission, FakeWorker


class NodeWorker(FakeWorker):
    """A ``FakeWorker`` on node ``node`` with worker id ``wid`` that adopts sessions
    (``adopt``: ok; full: RESOURCE_EXHAUSTED; die: its process dies inside the first call,
    down for ``down_s``, and comes back — holding the session, or with ``resume="not_found"``
    not: it died before the store moved it). ``stream_after_adopt``: how many tokens after its
    catch-up it streams of an adopted session before its process dies (None: all). Its
    process answers nothing while down; each process after the first registers a new
    generation (the first: 3)."""

    def __init__(
        self, wid: str, node: str, *args, adopt: str = "ok",
        stream_after_adopt: int | None = None, ranks: int = 1, **kw,
    ) -> None:  # fmt: skip
        super().__init__(*args, **kw)
        self.wid, self.node, self.adopt = wid, node, adopt
        self.stream_after_adopt = stream_after_adopt
        self.ranks = ranks  # > 1: a data-parallel-attention group, each rank an owner
        self.adopted: list[tuple[str, int, int, bool]] = []
        self.adopted_on: list[int | None] = []  # the data-parallel rank each Adopt named
        self.generation = 3
        self._came_back_from = 0.0  # the down_until of the last death this process followed

    def _down(self) -> bool:
        now = asyncio.get_running_loop().time()
        if now < self.down_until:
            return True
        if self.down_until != self._came_back_from:  # a successor: a new registration
            self.generation += 1
            self._came_back_from = self.down_until
        return False

    def _die(self) -> None:
        self.down_until = asyncio.get_running_loop().time() + self.down_s

    async def Health(self, request, context):
        if self._down():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection refused")
        owners = [pb.StoreOwner(owner=f"{self.wid}/dp{r}", generation=self.generation + 10 * r)
                  for r in range(self.ranks)] if self.ranks > 1 else []  # fmt: skip
        return pb.HealthResponse(
            ok=True, status="serving", generation=self.generation, rank_owners=owners
        )

    async def GetLoad(self, request, context):
        load = await super().GetLoad(request, context)
        load.kv_store_id = self.node
        load.serving_ranks = self.ranks
        return load

    async def GetModelInfo(self, request, context):
        info = await super().GetModelInfo(request, context)
        info.worker_id = self.wid
        return info

    async def Adopt(self, request, context):
        if self._down():  # no process: the call never arrives
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection refused")
        r = request
        self.adopted.append((r.from_owner, r.from_generation, r.tokens_received, r.fence))
        self.adopted_on.append(r.dp_rank if r.HasField("dp_rank") else None)
        if self.adopt == "full":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free slot")
        if self.adopt == "die":
            self.adopt = "ok"  # its successor adopts
            self._die()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)")
        n = r.tokens_received
        yield self._resp(TOKENS[n : n + 5], n + 5, False)  # the catch-up
        end = len(TOKENS) if self.stream_after_adopt is None else n + 5 + self.stream_after_adopt
        for i in range(n + 5, min(end, len(TOKENS))):
            yield self._resp([TOKENS[i]], i + 1, i + 1 == len(TOKENS))
        if end < len(TOKENS):
            self._die()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)")


class PeerAdmission(CountingAdmission):
    """Admits at once on the first worker offered, and moves sessions the same way."""

    def __init__(self, rank: int | None = None) -> None:
        super().__init__(rank)
        self.moves: list[str] = []

    async def try_acquire(
        self, job: AdmissionJob, workers: Callable[[], Sequence[WorkerStatus]],
        exclude: Collection[str] = (),
    ):  # fmt: skip
        left = [w for w in workers() if w.healthy and w.address not in exclude]
        if not left:
            return None
        self.moves.append(left[0].address)
        lease = await self.acquire(job, lambda: left)
        return lease


async def run(*workers: NodeWorker, rank: int | None = None):
    """Streams one request through a gateway pool of ``workers`` (its leases on data-parallel
    rank ``rank``); (tokens, admission, adoption outcomes)."""
    servers, addresses = [], []
    for w in workers:
        server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(w, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    admission, metrics = PeerAdmission(rank), GatewayMetrics()
    pool = WorkerPool(
        addresses, admission=admission, poll_interval_s=0.1, resume_deadline_s=10,
        metrics=metrics,
    )  # fmt: skip
    await pool.start()
    got: list[int] = []
    try:
        inp = GenerationInput("r", (1, 2, 3), SamplingSpec(max_tokens=len(TOKENS)))
        async for delta in pool.generate(inp):
            got.extend(delta.token_ids)
    finally:
        await pool.close()
        for s in servers:
            await s.stop(0)
    outcomes = {o: metrics.adoptions.labels("", o)._value.get() for o in ("adopted", "no_peer")}
    return got, admission, outcomes


async def test_a_live_peer_of_the_node_adopts_the_stream() -> None:
    dying = NodeWorker("wA", "n1", die_after=7, down_s=5)
    peer = NodeWorker("wB", "n1", die_after=99, down_s=0)
    got, admission, outcomes = await run(dying, peer)
    assert got == TOKENS  # nothing lost, nothing twice
    assert peer.adopted == [("wA", 3, 7, True)]  # fenced: its address refused connections
    assert dying.resumed_from == []  # never waited for
    assert (admission.held, admission.released) == (0, 2)  # the dead worker's, then the peer's
    assert outcomes == {"adopted": 1, "no_peer": 0}


async def test_a_data_parallel_group_adopts_from_the_rank_that_ran_it_on_its_leases_rank():
    """Groups of data-parallel ranks, each rank an owner of its own at the store: the session
    is taken from the registration of the dead group's rank that ran it (the lease's rank,
    its generation as the health polls said) and adopted on the rank the peer's lease holds
    room on."""
    dying = NodeWorker("wA", "n1", die_after=7, down_s=5, ranks=2)
    peer = NodeWorker("wB", "n1", die_after=99, down_s=0, ranks=2)
    got, admission, outcomes = await run(dying, peer, rank=1)
    assert got == TOKENS
    assert peer.adopted == [("wA/dp1", 13, 7, True)] and peer.adopted_on == [1]
    assert dying.resumed_from == []
    assert (admission.held, admission.released) == (0, 2)
    assert outcomes == {"adopted": 1, "no_peer": 0}


async def test_a_peer_without_room_leaves_the_stream_to_the_restart() -> None:
    dying = NodeWorker("wA", "n1", die_after=7, down_s=0.5)
    peer = NodeWorker("wB", "n1", die_after=99, down_s=0, adopt="full")
    got, admission, outcomes = await run(dying, peer)
    assert got == TOKENS
    assert len(peer.adopted) == 1 and dying.resumed_from == [7]
    assert (admission.held, admission.released) == (0, 2)
    assert outcomes == {"adopted": 0, "no_peer": 1}


async def test_a_worker_of_another_node_is_never_asked() -> None:
    dying = NodeWorker("wA", "n1", die_after=7, down_s=0.5)
    elsewhere = NodeWorker("wB", "n2", die_after=99, down_s=0)
    got, admission, outcomes = await run(dying, elsewhere)
    assert got == TOKENS
    assert elsewhere.adopted == [] and dying.resumed_from == [7]
    assert admission.moves == []
    assert outcomes == {"adopted": 0, "no_peer": 1}


async def test_a_peer_that_dies_inside_adopt_is_where_the_session_is_looked_for() -> None:
    dying = NodeWorker("wA", "n1", die_after=7, down_s=5)
    peer = NodeWorker("wB", "n1", die_after=99, down_s=0.5, adopt="die")
    got, admission, outcomes = await run(dying, peer)
    assert got == TOKENS
    assert peer.adopted == [("wA", 3, 7, True)]
    assert peer.resumed_from == [7]  # its successor resumed what the store had moved to it
    assert dying.adopted == [] and dying.resumed_from == []  # gone: never asked
    assert (admission.held, admission.released) == (0, 2)  # no lease left behind
    assert outcomes == {"adopted": 0, "no_peer": 1}


async def test_a_peer_that_dies_adopting_before_the_store_moved_it_leaves_it_to_its_successor():
    """The peer dies inside ``Adopt`` before the store moved the session: its successor holds
    none (Resume: NOT_FOUND) and adopts it from the worker that died first, fenced off (that
    process still refuses connections, its lease has not run out)."""
    dying = NodeWorker("wA", "n1", die_after=7, down_s=5)
    peer = NodeWorker("wB", "n1", die_after=99, down_s=0.5, adopt="die", resume="not_found")
    got, admission, outcomes = await run(dying, peer)
    assert got == TOKENS
    assert peer.resumed_from == [7]
    assert peer.adopted == [("wA", 3, 7, True), ("wA", 3, 7, True)]  # the successor: fenced too
    assert dying.adopted == [] and dying.resumed_from == []
    assert (admission.held, admission.released) == (0, 2)
    assert outcomes == {"adopted": 0, "no_peer": 1}


async def test_a_worker_that_died_is_not_asked_to_adopt_before_its_successor_answers():
    """The first worker dies, its peer adopts the stream and dies in turn before the health
    polls have marked the first one (they allow a few misses): the dead first worker is not
    asked to adopt it (that would look like a peer dying inside ``Adopt``, and the stream would
    wait for the wrong successor); the stream waits for the adopter's successor, which resumed
    the session."""
    dying = NodeWorker("wA", "n1", die_after=7, down_s=3, resume="not_found")
    peer = NodeWorker("wB", "n1", die_after=99, down_s=0.3, stream_after_adopt=3)
    got, admission, outcomes = await run(dying, peer)
    assert got == TOKENS
    assert peer.adopted == [("wA", 3, 7, True)]
    assert peer.resumed_from == [15]  # 7 + 5 caught up + 3
    assert dying.adopted == [] and dying.resumed_from == []
    assert (admission.held, admission.released) == (0, 2)
    assert outcomes == {"adopted": 1, "no_peer": 1}
