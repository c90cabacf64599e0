"""``dhisparse worker --tensor-parallel-size 2`` as real processes on the CPU (gloo): one process
per rank under a supervisor; rank 0's gRPC streams one process's greedy tokens; a rank
SIGKILLed takes the whole group down (for ``up`` or Kubernetes to restart), leaving no rank
behind; SIGTERM drains and stops every rank; configurations no group can serve fail at
start-up with a message that names the reason. Under data-parallel attention over a real
kv-host-store process each rank is an owner of its own at the store, and a rank whose link to
the store fails makes the group unhealthy."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from dhisparse.family.parallel_layout import ParallelConfig
from dhisparse.rpc import worker_pb2 as pb
from dhisparse.rpc import worker_pb2_grpc as pb_grpc
from services.kv_host_store.client import KVHostStoreClient
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams
from services.worker.startup import process_start
from tests.conftest import free_port
from tests.kv_host_store.conftest import kill_process, start_store_process

PROMPT = list(b"The sparse indexer picks rows; ")
FLAGS = ("--model", "tiny-glm", "--device", "cpu", "--kv-pool-mib", "48", "--max-model-len", "512",
         "--max-num-seqs", "4",
         "--metrics-port", "0", "--log-level", "INFO")  # fmt: skip


def _worker(log: Path, *flags: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "dhisparse.cli", "worker", *FLAGS, *flags],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of an exited rank counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[1][0] != "Z"


@contextmanager
def group(
    tmp_path: Path, *flags: str
) -> Iterator[tuple[subprocess.Popen, pb_grpc.WorkerStub, Path]]:
    """A 2-rank worker serving on a free port; killed, with every rank, by process group."""
    port = free_port()
    log = tmp_path / "worker.log"
    proc = _worker(log, "--port", str(port), "--tensor-parallel-size", "2", *flags)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.WorkerStub(channel)
        deadline = time.monotonic() + 120
        while True:
            try:
                if stub.Health(pb.HealthRequest(), timeout=2).ok:
                    break
            except grpc.RpcError:
                pass
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        yield proc, stub, log
    finally:
        channel.close()
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _rank_pids(log: Path) -> list[int]:
    return [int(p) for p in re.findall(r"rank \d pid (\d+)", log.read_text())]


def _request(
    rid: str, n: int, prompt: list[int] = PROMPT, rank: int | None = None
) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
    if rank is not None:
        req.dp_rank = rank
    return req


def _generate(stub: pb_grpc.WorkerStub, rid: str, n: int) -> list[int]:
    return [t for resp in stub.Generate(_request(rid, n), timeout=120) for t in resp.token_ids]


def _offline_engine(mode: str) -> Engine:
    """One process's engine with the group's flags."""
    return Engine(EngineConfig(model="tiny-glm", kv_pool_mib=48, max_model_len=512, max_num_seqs=4,
                               mode=mode))  # fmt: skip


def _offline(n: int, mode: str, prompt: list[int] = PROMPT, eng: Engine | None = None) -> list[int]:
    eng = eng or _offline_engine(mode)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return eng.generate([prompt], params)[0].output_ids


@pytest.mark.parametrize("layout", [(), ("--data-parallel-attention", "--expert-parallel")])
def test_group_serves_one_process_tokens_and_stops_on_sigterm(
    tmp_path: Path, layout: tuple[str, ...]
) -> None:
    metrics = free_port()
    with group(tmp_path, "--mode", "adaptive", "--metrics-port", str(metrics), *layout) as (
        proc, stub, log
    ):  # fmt: skip
        one = _offline_engine("adaptive")
        assert _generate(stub, "r1", 16) == _offline(16, "adaptive", eng=one)
        # the group's start-up runs from the supervisor's start, through every rank's load
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert 0 < info.startup_s < time.time() - process_start(proc.pid) + 1
        # per-rank metrics: each data-parallel rank's requests and free KV, from rank 0
        text = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
        free = re.findall(r'^dhisparse:rank_kv_free_bytes\{model="tiny-glm",rank="(\d)"\} (\S+)',
                          text, re.M)  # fmt: skip
        assert [r for r, _ in free] == (["0", "1"] if layout else []), text
        assert all(float(v) > 0 for _, v in free)
        assert ('dhisparse:rank_requests_running{model="tiny-glm",rank="1"}' in text) == bool(
            layout
        )
        # the gateway admits against the group: each DP rank brings its own seats and pool,
        # and a request must fit one rank's (TP: the group serves one batch)
        load = stub.GetLoad(pb.LoadRequest(), timeout=10)
        assert load.max_num_seqs == 4 * (2 if layout else 1)
        assert load.serving_ranks == (2 if layout else 1)
        assert load.kv_free_bytes > 0 and load.kv_capacity_bytes >= load.kv_free_bytes
        # the capacity the gateway charges sessions' per-GPU bytes against: one GPU's pool
        # under TP (every rank stores every session's rows), each rank's under DP attention
        per_gpu = one.kv.memory().capacity - one.kv.fixed_bytes()
        assert load.kv_capacity_bytes == per_gpu * load.serving_ranks
        pids = _rank_pids(log)
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
        assert not any(_alive(p) for p in pids)


def test_a_dead_rank_stops_the_group(tmp_path: Path) -> None:
    with group(tmp_path, "--mode", "resident") as (proc, _stub, log):
        pids = _rank_pids(log)
        os.kill(pids[1], signal.SIGKILL)
        assert proc.wait(60) == 1
        assert not any(_alive(p) for p in pids)
        assert re.search(r"rank 1 \(pid \d+\) exited with status -9", log.read_text())


def test_configurations_no_group_serves_fail_at_start_up(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    # 4 attention heads do not split 3 ways: every rank refuses, the supervisor exits 2
    proc = _worker(log, "--port", str(free_port()), "--tensor-parallel-size", "3")
    assert proc.wait(120) == 2
    assert "splits attention heads (num_attention_heads) = 4 3 ways" in log.read_text()
    if torch.cuda.device_count() >= 2:
        return
    # more ranks than GPUs: refused before any rank starts
    proc = _worker(log, "--port", str(free_port()), "--tensor-parallel-size", "2", "--device",
                   "cuda")  # fmt: skip
    assert proc.wait(60) == 2
    assert re.search(r"needs 2 GPUs, one per rank; this process sees \d", log.read_text())
    with pytest.raises(ValueError, match="need --tensor-parallel-size >= 2"):
        ParallelConfig(1, data_parallel_attention=True)


def _wait_owned(client: KVHostStoreClient, owners: dict[str, str]) -> None:
    """Until the store's requests are ``owners`` (request id -> owner)."""
    deadline = time.monotonic() + 10
    while (got := {i.request_id: i.owner for i in client.list_requests()}) != owners:
        assert time.monotonic() < deadline, got
        time.sleep(0.1)


def test_data_parallel_ranks_each_own_their_regions_at_the_node_store(tmp_path: Path) -> None:
    """DP attention over a real kv-host-store process: the first request runs on rank 0, the
    next on rank 1 (the least loaded), and a request that names its rank runs there; each
    rank's regions are registered under its own owner and released when its request ends or
    its client leaves; the tokens are one process's. A rank whose lease is lost (a newer
    generation of its owner registered) makes the group report unhealthy."""
    arena = Path("/dev/shm") / f"dhisparse-test-dp-{uuid.uuid4().hex}"
    store = start_store_process(arena)
    client = KVHostStoreClient(store.target)
    second = list(b"Host backups hold every row; ")
    try:
        with group(tmp_path, "--mode", "hisparse", "--kv-store", store.target, "--worker-id",
                   "w", "--lease-ttl-s", "1.5", "--data-parallel-attention",
                   "--expert-parallel") as (_proc, stub, _log):  # fmt: skip
            a = stub.Generate(_request("a", 24), timeout=120)
            got_a = list(next(a).token_ids)  # running on rank 0 before "b" arrives
            b = stub.Generate(_request("b", 24, second), timeout=120)
            got_b = list(next(b).token_ids)
            owners = {info.request_id: info.owner for info in client.list_requests()}
            assert owners == {"a": "w/dp0", "b": "w/dp1"}
            got_a += [t for resp in a for t in resp.token_ids]
            got_b += [t for resp in b for t in resp.token_ids]
            assert got_a == _offline(24, "hisparse")
            assert got_b == _offline(24, "hisparse", second)
            _wait_owned(client, {})  # each rank released its own request's regions
            # requests that name their rank run there (the gateway's lease holds room on it),
            # where the least loaded rank would have been rank 0 for the first; a client that
            # leaves one: rank 0 routes the abort, and rank 1 releases the request's regions
            c = stub.Generate(_request("c", 400, rank=1), timeout=120)
            next(c)
            d = stub.Generate(_request("d", 400, second, rank=1), timeout=120)
            next(d)
            _wait_owned(client, {"c": "w/dp1", "d": "w/dp1"})
            d.cancel()
            _wait_owned(client, {"c": "w/dp1"})
            c.cancel()
            _wait_owned(client, {})
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(_request("e", 4, rank=2), timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "dp_rank 2 is not a rank of this worker" in (e.value.details() or "")
            assert stub.Health(pb.HealthRequest(), timeout=5).ok
            # rank 1's generation superseded: its next renewal is refused, and its report after
            # the next step tells rank 0
            client.register_owner("w/dp1", 1.5)
            time.sleep(1.0)
            with suppress(grpc.RpcError):  # on rank 1 the request fails: its owner is fenced
                _generate(stub, "c", 2)
            health = stub.Health(pb.HealthRequest(), timeout=5)
            assert not health.ok
            assert "rank 1: host KV store unavailable (superseded)" in health.status, health
    finally:
        client.close()
        kill_process(store.proc)
        arena.unlink(missing_ok=True)
