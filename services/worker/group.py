"""A worker that spans several ranks (``--tensor-parallel-size N``): one process per rank,
started and supervised together by the process the user started (``dhisparse worker`` or
``dhisparse generate``).

Rank 0 is the worker the outside world sees — the gRPC server, the scheduler, health and
metrics (or, offline, the prompts and their outputs); the other ranks build their part of the
model and follow rank 0 step for step (``rank_group.lockstep``). The ranks form one
torch.distributed group on this node: gloo on the CPU; on GPUs NCCL for the model's tensors,
rank r on ``cuda:r`` (pick the GPUs with ``CUDA_VISIBLE_DEVICES``), and a gloo group for the
step inputs. The group's timeout is long: a follower waits inside a collective for as long as
rank 0 has nothing to run.

Supervision: when any rank dies, the supervisor stops the others and exits with an error
(2 for a configuration a rank refused, else 1), and whatever restarts workers — ``dhisparse
up``, Kubernetes — starts the whole group again. SIGTERM or SIGINT to the supervisor stops
rank 0, which drains its streams and releases the others. A follower's exit 0 is that release,
not a death: the group ends with rank 0's status."""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

from dhisparse.devices import resolve_device
from dhisparse.family.parallel_layout import LayoutError, ParallelConfig
from services.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

GROUP_TIMEOUT = timedelta(days=30)  # a follower's wait for rank 0's next step
STOP_GRACE_S = 20.0  # rank 0's drain, then the followers' release, before they are killed
CONFIG_ERROR = 2  # a rank's exit status for a configuration it cannot serve

# The leader's work: (settings, the group's Comm, *args) -> exit status
Leader = Callable[..., int]


def parallel_config(settings: WorkerSettings) -> ParallelConfig:
    return ParallelConfig(
        settings.tensor_parallel_size, settings.expert_parallel, settings.data_parallel_attention
    )


def check_devices(size: int, device: str) -> None:
    """Raises LayoutError when ``size`` ranks cannot each have a device of kind ``device``
    (resolved: cpu, cuda, cuda:N)."""
    if size == 1 or device == "cpu":
        return
    if device != "cuda":
        raise LayoutError(
            f"--tensor-parallel-size {size} places rank r on cuda:r: give --device cuda (or "
            f"auto), not {device}, and choose the GPUs with CUDA_VISIBLE_DEVICES"
        )
    import torch

    count = torch.cuda.device_count()
    if size > count:
        raise LayoutError(
            f"--tensor-parallel-size {size} needs {size} GPUs, one per rank; this process "
            f"sees {count} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r})"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(rank: int, size: int, port: int, device: str) -> Any:
    """This rank's Comm over a new torch.distributed group of ``size`` ranks."""
    import torch
    import torch.distributed as dist

    from services.worker.parallel.comm import TorchComm

    gpu = device.startswith("cuda")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
        world_size=size, timeout=GROUP_TIMEOUT,
    )  # fmt: skip
    objects = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT) if gpu else None
    return TorchComm(dist.group.WORLD, objects)


def _rank_main(
    rank: int, size: int, port: int, fields: dict, leader: Leader, args: tuple
) -> None:  # fmt: skip
    """One rank's process: joins the group, then leads (rank 0) or follows."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s"
    )
    faulthandler.enable()  # a rank that dies of a signal leaves its Python stacks in the log
    # NVLink multicast off unless asked for (docs/deploy.md): it can take shared GPUs down
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if rank > 0:  # Ctrl-C reaches the whole process group: rank 0 alone drains
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    settings = WorkerSettings(**fields)
    comm = _init_group(rank, size, port, settings.engine_config(rank).device)
    try:
        if rank == 0:
            code = leader(settings, comm, *args)
        else:
            code = follow(settings, comm)
    except (LayoutError, ValueError) as e:  # the configuration, refused while building
        log.error("%s", e)
        comm.close()
        sys.exit(CONFIG_ERROR)  # with the interpreter's teardown: what was built is released
    comm.close()
    _exit(code)


def _exit(code: int) -> None:
    """Ends a rank's process once its work is done, its engine closed (a private host arena
    removed) and its group closed, without the interpreter's teardown, in which
    torch.distributed's native objects (process groups, their transport threads) would be
    destroyed in whatever order module teardown reaches them."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def follow(settings: WorkerSettings, comm: Any) -> int:
    """A follower rank: its part of the model, stepping with rank 0 until rank 0 stops. Over
    the node's store a TP follower reads the regions rank 0 allocates for the group
    (``rank_group.region_group``); a data-parallel rank is an owner of its own: it registers,
    renews its lease, resumes its own sessions and tells rank 0 which (``share_resumed``),
    as rank 0 does at the same point (``server.start_server``)."""
    from services.worker.durable.adoption import rank_adopter, take_over
    from services.worker.engine.engine import Engine
    from services.worker.engine.prefix_setup import prefix_salt
    from services.worker.server import connect_store

    host = connect_store(settings) if settings.kv_store and settings.mode != "resident" else None
    engine = Engine(settings.engine_config(comm.rank), host=host, comm=comm)
    link = None
    if host is not None and engine.group.data_parallel:
        salt = prefix_salt(engine.cfg, engine.kv).root()
        link = take_over(engine, host[0], settings.lease_ttl_s, salt)
        engine.group.adoptions.registered(link, rank_adopter(engine, link))
        engine.group.share_resumed(engine)
    log.info("rank %d of %d ready: following rank 0", comm.rank, comm.size)
    # its generation released before rank 0's stop returns: a drained group's sessions on this
    # rank are adoptable once rank 0 hands its streams over
    engine.group.follow(engine, engine.stats.drain_finished, link.close if link else lambda: None)
    engine.close()
    return 0


def launch(settings: WorkerSettings, leader: Leader, *args: Any) -> int:
    """Runs the group of ``settings``: ``leader(settings, comm, *args)`` on rank 0 (module
    level, picklable, as ``args``), followers on the others; supervises them (module
    docstring). Returns the exit status for the process."""
    par = parallel_config(settings)
    check_devices(par.world_size, resolve_device(settings.device))
    ctx = mp.get_context("spawn")
    port = _free_port()
    fields = settings.model_dump()
    n = par.world_size
    procs = [
        ctx.Process(target=_rank_main, args=(r, n, port, fields, leader, args), name=f"rank-{r}")
        for r in range(n)
    ]
    stopping: list[float] = []

    def _stop(signum: int, frame: object) -> None:
        if not stopping:
            stopping.append(time.monotonic())
            if procs[0].pid is not None:
                os.kill(procs[0].pid, signal.SIGTERM)

    old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for r, p in enumerate(procs):
            p.start()
            log.info("%s over %d ranks: rank %d pid %d", par.name, par.world_size, r, p.pid)
        return _supervise(procs, stopping)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _kill(procs)


def _supervise(procs: list, stopping: list[float]) -> int:
    """Waits for the group to end: rank 0's own exit (its work done, or stopped), or any
    rank's death (the rest are stopped). A follower exits 0 only once rank 0 has released it
    (``Engine.stop``): rank 0 is ending too, and gets ``STOP_GRACE_S`` to exit."""
    released: float | None = None  # when a follower's normal exit was first seen
    while True:
        wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.5)
        done = [r for r, p in enumerate(procs) if p.exitcode is not None]
        if stopping and time.monotonic() - stopping[0] > STOP_GRACE_S:
            log.warning("the group did not stop within %.0f s: killing it", STOP_GRACE_S)
            return 1
        if released is None and any(r > 0 and procs[r].exitcode == 0 for r in done):
            released = time.monotonic()
        if released is not None and time.monotonic() - released > STOP_GRACE_S:
            log.error("rank 0 released the group but did not exit within %.0f s", STOP_GRACE_S)
            return 1
        # released followers: the group is ending, and rank 0's exit says how
        done = [r for r in done if r == 0 or procs[r].exitcode != 0]
        if not done:
            continue
        if 0 in done and procs[0].exitcode == 0:
            # rank 0 is done and has released the followers: they end on their own
            deadline = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
                wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.5)
            codes = [p.exitcode for p in procs]
            return procs[0].exitcode if all(c == 0 for c in codes[1:]) else 1
        first = done[0]
        code = procs[first].exitcode
        log.error(
            "rank %d (pid %d) exited with status %s: stopping the group", first,
            procs[first].pid, code,
        )  # fmt: skip
        return CONFIG_ERROR if code == CONFIG_ERROR else 1


def _kill(procs: list) -> None:
    """Ends every rank still running: SIGTERM, then SIGKILL."""
    live = [p for p in procs if p.exitcode is None and p.pid is not None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + 5.0
    for p in live:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()
