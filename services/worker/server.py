"""The worker's gRPC front. The servicer only translates messages; the engine does the work."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal

import grpc

from dhisparse.metrics_server import serve_metrics
from dhisparse.rpc import worker_pb2 as pb
from dhisparse.rpc import worker_pb2_grpc as pb_grpc
from services.worker.async_engine import (
    AsyncEngine,
    EngineDeadError,
    SessionNotFound,
    SessionsHandedOver,
)
from services.worker.convert import output_to_proto, sampling_from_proto
from services.worker.durable.adoption import AdoptFrom, NotAdopted, adopt_session, take_over
from services.worker.durable.host_link import HostLink
from services.worker.engine.engine import Engine
from services.worker.engine.heap import freeze_heap
from services.worker.engine.kernel_builds import KernelBuilds
from services.worker.engine.prefix_setup import prefix_salt
from services.worker.engine.warm_up import skip_reason, warm_up
from services.worker.metrics import WorkerMetrics, config_labels
from services.worker.parallel.comm import LOCAL, Comm
from services.worker.settings import WorkerSettings
from services.worker.startup import startup_seconds

log = logging.getLogger(__name__)


# How a request the engine gave up on (``RequestError.code``), or a session this worker could
# not adopt (``NotAdopted.code``), fails over gRPC.
_ERROR_STATUS = {
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "internal": grpc.StatusCode.INTERNAL,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
}


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        worker_id: str,
        model_name: str,
        link: HostLink | None = None,
        startup_s: float = 0.0,
    ) -> None:
        """``startup_s``: seconds from the worker's start to serving (``startup``)."""
        self.engine = engine
        self.worker_id = worker_id
        self.model_name = model_name
        self.link = link
        self.startup_s = startup_s

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.engine.draining:  # before its first token: the gateway tries another worker
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker drains: it admits nothing")
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        params = sampling_from_proto(request.sampling)
        rank = request.dp_rank if request.HasField("dp_rank") else None
        outputs = self.engine.generate(
            request.request_id, list(request.prompt_token_ids), params, rank
        )
        async for resp in self._stream(outputs, context):
            yield resp

    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext):
        """Re-attaches to a session this worker resumed from its dead predecessor: first the
        tokens after ``tokens_received``, then new ones. NOT_FOUND when there is none."""
        outputs = self.engine.resume(request.request_id, request.tokens_received)
        async for resp in self._stream(outputs, context):
            yield resp

    async def Adopt(self, request: pb.AdoptSessionRequest, context: grpc.aio.ServicerContext):
        """Takes over a session a peer of this node left in the host store and streams it as
        ``Resume`` does (codes: the proto's)."""
        r = request
        source = AdoptFrom(r.from_owner, r.from_generation, r.fence)
        rank = r.dp_rank if r.HasField("dp_rank") else None
        outputs = self.engine.adopt(r.request_id, source, r.tokens_received, rank)
        async for resp in self._stream(outputs, context):
            yield resp

    async def _stream(self, outputs, context: grpc.aio.ServicerContext):
        tokenizer = self.engine.engine.tokenizer
        try:
            async for out in outputs:
                if out.error is not None:
                    await context.abort(_ERROR_STATUS[out.error.code], out.error.message)
                yield output_to_proto(out, tokenizer)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SessionNotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except NotAdopted as e:
            await context.abort(_ERROR_STATUS[e.code], str(e))
        except SessionsHandedOver as e:  # the gateway moves the stream (``WORKER_GONE``)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):
        return pb.AbortResponse(found=self.engine.abort(request.request_id))

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext):
        """The worker's load for the gateway's admission: under data-parallel attention the
        whole group's (every rank its own seats and KV pool; free bytes as the ranks last
        reported them; required and optional bytes: this rank's), as requests run and wait
        across it, and the number of serving ranks: a request runs within one rank's pool."""
        eng = self.engine.engine
        mem = eng.kv.memory()
        ranks = eng.group.loads.serving_ranks
        return pb.LoadResponse(
            worker_id=self.worker_id,
            num_running=eng.num_running,
            num_waiting=eng.num_waiting,
            max_num_seqs=eng.cfg.max_num_seqs * ranks,
            kv_capacity_bytes=(mem.capacity - eng.kv.fixed_bytes()) * ranks,
            kv_required_bytes=mem.required,
            kv_optional_bytes=mem.optional,
            kv_free_bytes=mem.free + eng.group.loads.others_free_bytes(),
            mode=eng.kv.payload.mode,
            serving_ranks=ranks,
            kv_store_id=self.link.store_id if self.link is not None else "",
        )

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext):
        """Whether it serves, and its generation at the host store: the gateway moves a dead
        worker's streams to peers of the same store (``LoadResponse.kv_store_id``)."""
        generation = self.link.generation if self.link is not None else 0
        ok, status = self._health()
        owners = [pb.StoreOwner(owner=o, generation=g) for o, g in self._rank_owners()]
        return pb.HealthResponse(ok=ok, status=status, generation=generation, rank_owners=owners)

    def _rank_owners(self) -> list[tuple[str, int]]:
        """Under data-parallel attention, each rank's own registration with the store (this
        rank's as it is now, the others' as they last reported): the gateway takes a session
        from the owner of the rank that held it."""
        eng = self.engine.engine
        if not eng.group.data_parallel:
            return []
        owners = eng.group.loads.owners()
        if owners and self.link is not None:
            owners[0] = (self.link.owner, self.link.generation)
        return owners

    def _health(self) -> tuple[bool, str]:
        if self.engine.draining:
            return False, "draining"
        if not self.engine.alive:
            return False, f"engine failed: {self.engine.error!r}"
        if self.link is not None and not self.link.healthy:
            return False, self.link.status()
        # the other data-parallel ranks' links
        problems = self.engine.engine.group.loads.store_problems()
        if problems:
            return False, "; ".join(problems)
        return True, "serving"

    async def GetModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext):
        eng = self.engine.engine
        return pb.ModelInfo(
            model_name=self.model_name,
            max_model_len=eng.cfg.max_model_len,
            vocab_size=eng.model_cfg.vocab_size,
            mode=eng.kv.payload.mode,
            config_json=json.dumps(eng.model_cfg.to_dict()),
            worker_id=self.worker_id,
            kv_layout_json=json.dumps(
                {
                    **eng.kv.layout(),
                    "drafter": eng.cfg.speculation.drafter,
                    "spec_width": eng.cfg.speculation.width,
                }
            ),
            durable_sessions=eng.kv.sessions is not None,
            startup_s=self.startup_s,
            prefix_cache=eng.scheduler.prefix is not None,
        )


def peer_adopter(link: HostLink, kill_marker: str = ""):
    """The ``SessionAdopter`` of a worker registered with the store through ``link``: one
    session of a peer of its node (``adopt_session``), one without room handed back. A group
    of data-parallel ranks (an owner per rank) adopts it on one rank (``RankGroup.adopt_on``:
    the one named, else the least loaded): rank 0 here, through ``link``; another rank under
    its own registration before the next step (None is returned). ``kill_marker``: test-only
    fault injection (``WorkerSettings.test_kill_in_adopt``): "" none."""

    def adopt(engine: Engine, request_id: str, source: AdoptFrom, rank: int | None):
        if engine.group.data_parallel:
            try:
                engine.group.check_rank(rank)
            except ValueError as e:
                raise NotAdopted("invalid_argument", str(e)) from e
            if engine.group.adopt_on(request_id, source, rank) != 0:
                return None
        try:
            req = adopt_session(
                engine, link.client, link.owner, link.generation, request_id, source,
                hand_back=True,
            )  # fmt: skip
        except NotAdopted:
            engine.group.forget(request_id)
            raise
        if kill_marker:
            _die_once(kill_marker, f"adopted {request_id}, before streaming it")
        return req

    return adopt


def _die_once(marker: str, where: str) -> None:
    """Test-only fault: SIGKILLs this process unless ``marker`` exists, creating it first, so
    that the fault fires once however often the worker restarts."""
    try:
        with open(marker, "x"):
            pass
    except FileExistsError:
        return
    log.warning("test fault: SIGKILL %s", where)
    os.kill(os.getpid(), signal.SIGKILL)


def connect_store(settings: WorkerSettings) -> tuple:
    """(client, arena mapping) of the node's kv_host_store."""
    from services.kv_host_store.client import KVHostStoreClient

    client = KVHostStoreClient(settings.kv_store, timeout=settings.kv_store_timeout_s)
    client.wait_ready(timeout=30.0)
    info, mapping = client.map_arena()
    log.info("mapped host arena %s (%d bytes)", info.path, info.capacity_bytes)
    return client, mapping


def _log_config(engine: Engine) -> None:
    """One line with what the worker chose; a warning when a GPU runs without CUDA graphs."""
    labels = config_labels(engine)
    shown = (f"{k}={v!r}" if " " in v or not v else f"{k}={v}" for k, v in labels.items())
    log.info("worker config: %s", " ".join(shown))
    if engine.device.type == "cuda" and engine.passes.graphs is None:
        log.warning(
            "CUDA graphs are off on %s: %s; decode passes run eagerly",
            engine.device,
            engine.graphs_off_reason,
        )


def _warm_up(engine: Engine, comm: Comm) -> None:
    """Runs the start-up warm-up (``engine.warm_up``) where it can run, and logs what it did
    or why it did not."""
    if comm.size > 1:
        log.info("warm-up skipped: it runs on a worker of one rank (this one has %d)", comm.size)
        return
    why = skip_reason(engine)
    done = warm_up(engine) if why is None else None
    if done is None:  # warm_up runs wherever skip_reason gives none
        log.info("warm-up skipped: %s", why)
        return
    log.info(
        "warmed up in %.1f s: %d requests, %d prompt tokens, %d Triton kernels built",
        done.seconds, done.requests, done.prompt_tokens, done.kernel_builds,
    )  # fmt: skip


async def start_server(
    settings: WorkerSettings, engine: Engine | None = None, comm: Comm = LOCAL
) -> tuple[grpc.aio.Server, AsyncEngine]:
    """Builds the engine (unless given) and starts gRPC (and metrics) serving. In a hierarchy
    mode with ``kv_store`` set, host backups go to the node's kv_host_store arena, and the
    sessions a dead predecessor of this worker id left there are resumed. ``comm``: the group
    this process is rank 0 of (``group``), whose other ranks follow its engine."""
    worker_id = settings.resolved_worker_id()
    link = None
    if engine is None:
        host = None
        if settings.kv_store and settings.mode != "resident":
            host = connect_store(settings)
        engine = Engine(settings.engine_config(comm.rank), host=host, comm=comm)
        if host is not None:
            salt = prefix_salt(engine.cfg, engine.kv).root()
            link = take_over(engine, host[0], settings.lease_ttl_s, salt)
            engine.group.adoptions.registered(link)
            if (
                engine.group.data_parallel
            ):  # every rank has taken over its own: rank 0 learns theirs
                engine.group.share_resumed(engine)
    if settings.warms_up(str(engine.device)):
        _warm_up(engine, comm)
    model_name = settings.served_model_name or engine.model_cfg.name
    startup_s = startup_seconds()
    metrics = WorkerMetrics(model_name)
    metrics.start_after(engine)  # the warm-up's requests are not the clients'
    metrics.describe(engine)
    _log_config(engine)
    async_engine = AsyncEngine(
        engine,
        on_step=metrics.on_step,
        detached=engine.request_ids(),  # only resumed sessions exist before serving
        attach_timeout_s=settings.attach_timeout_s,
        between_steps=(
            (lambda eng: link.maintain(eng.group.lockstep is not None))
            if link is not None
            else None
        ),
        on_shutdown=link.close if link is not None else None,
        adopter=peer_adopter(link, settings.test_kill_in_adopt) if link is not None else None,
    )
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_WorkerServicer_to_server(
        WorkerServicer(async_engine, worker_id, model_name, link, startup_s), server
    )
    addr = f"{settings.host}:{settings.port}"
    if server.add_insecure_port(addr) == 0:
        async_engine.shutdown()
        raise RuntimeError(f"cannot bind {addr}")
    if settings.metrics_port:
        serve_metrics(metrics.registry, settings.host, settings.metrics_port)
    await server.start()
    log.info("worker %s serving %s (%s mode) on %s, %.1f s after its start", worker_id,
             model_name, engine.kv.payload.mode, addr, startup_s)  # fmt: skip
    return server, async_engine


async def serve(settings: WorkerSettings, comm: Comm = LOCAL) -> None:
    """Serves until SIGTERM/SIGINT, then drains (and releases the group's other ranks)."""
    builds = KernelBuilds.process()  # from the start: start-up's builds are counted too
    server, async_engine = await start_server(settings, comm=comm)
    log.info("%d Triton kernels built during start-up", builds.total)
    builds.serving()
    if settings.gc_freeze:  # the process's own heap: not in start_server, which tests call
        log.info("froze %d objects of the start-up heap", freeze_heap())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if async_engine.engine.kv.sessions is not None:
        # its streams end now, and the gateway moves them (a data-parallel group's ranks each
        # release their own sessions first)
        moved = await asyncio.to_thread(async_engine.drain)
        log.info("worker draining: handed %d sessions over", moved)
    else:
        log.info("worker shutting down")
    await server.stop(grace=5.0)
    async_engine.shutdown()
    async_engine.engine.group.stop()  # the engine thread has ended: the followers' loops end too
    async_engine.engine.close()
