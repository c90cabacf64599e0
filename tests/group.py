"""Runs a function on every rank of a real torch.distributed group (gloo, one process per rank,
started and joined by the test) and hands back what each rank returned.

The ranks are forked from a fork server that imported ``tests.ranks`` (torch, the worker) once
per test process: each rank is a fresh process, as spawned, without seconds of imports each; it
takes the test's environment, not the one the server started with."""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.worker.parallel.comm import TorchComm
from tests.conftest import free_port

TIMEOUT_S = 120
PRELOAD = ["tests.ranks"]  # what every rank imports: the worker's engine and its model code


def _rank(
    rank: int, size: int, port: int, env: dict[str, str], fn: Callable, args: tuple, out: Any
) -> None:
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
        )
        comm = TorchComm(dist.group.WORLD)
        result = fn(comm, *args)
        # bytes, not tensors: torch's queue would share their storage with a process that exits
        out.put((rank, "ok", pickle.dumps(result)))
        comm.close()
    except BaseException:  # the test reports the rank's traceback
        out.put((rank, "error", traceback.format_exc()))


def run_group(fn: Callable[..., Any], size: int = 2, *args: Any) -> list[Any]:
    """``fn(comm, *args)`` on ``size`` ranks (``fn`` importable, its result picklable); the
    results in rank order. A rank's exception fails the call with its traceback."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first call)
    out = ctx.Queue()
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        ctx.Process(target=_rank, args=(r, size, port, env, fn, args, out)) for r in range(size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(size):
            rank, status, value = out.get(timeout=TIMEOUT_S)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(size)]
