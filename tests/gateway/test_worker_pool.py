"""The worker pool against the real worker and a dead address: polling, routing, retry before
the first token, and the gateway's answers when no worker can serve."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Collection, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from services.gateway import GatewaySettings, create_app
from services.gateway.errors import APIError
from services.gateway.generation import GenerationInput, SamplingSpec
from services.gateway.routing import AdmissionJob, ImmediateAdmission, WorkerStatus
from services.gateway.worker_client import WorkerPool, retry_of

from .conftest import (
    MODEL,
    WorkerProcess,
    free_port,
    gateway_client,
    kill_process,
    sse_events,
    start_worker,
)


class InOrderRouter:
    """Prefers workers in the configured order, healthy or not, to force a first failure."""

    def pick(
        self, workers: Sequence[WorkerStatus], exclude: Collection[str], job: object = None
    ) -> str | None:
        return next((w.address for w in workers if w.address not in exclude), None)


def sampling(**kw: Any) -> SamplingSpec:
    return SamplingSpec(**{"max_tokens": 3, "ignore_eos": True, **kw})


async def test_poll_learns_model_and_load(worker: WorkerProcess) -> None:
    dead = f"127.0.0.1:{free_port()}"
    pool = WorkerPool([worker.address, dead], poll_interval_s=0.2)
    await pool.start()
    try:
        status = {s.address: s for s in pool.statuses()}
        assert status[worker.address].healthy
        assert status[worker.address].max_num_seqs > 0
        assert not status[dead].healthy
        info = pool.model_info()
        assert info is not None and info.model_name == MODEL
        assert pool.max_model_len() == info.max_model_len
        assert pool.workers[dead].last_error
    finally:
        await pool.close()


async def test_failure_before_first_token_is_retried_elsewhere(worker: WorkerProcess) -> None:
    dead = f"127.0.0.1:{free_port()}"
    pool = WorkerPool(
        [dead, worker.address], admission=ImmediateAdmission(InOrderRouter()), max_retries=1
    )
    await pool.start()
    try:
        deltas = [d async for d in pool.generate(GenerationInput("retry-1", (1, 2, 3), sampling()))]
        assert deltas[-1].finish_reason == "length"
        assert deltas[-1].completion_tokens == 3
        assert pool.workers[worker.address].in_flight == 0
        assert pool.workers[dead].in_flight == 0
    finally:
        await pool.close()
    assert worker.wait_idle()


def test_a_retry_sends_the_request_under_an_id_of_its_own() -> None:
    """A worker that died before the first token leaves host regions under the request's id,
    which the node's store keeps for it until its lease lapses: a retry's own id is never
    refused them by a peer of that node. The first attempt goes as it came."""
    inp = GenerationInput("chatcmpl-abc-0", (1, 2, 3), sampling())
    job = AdmissionJob(inp.request_id, 3, 4, MODEL)
    assert retry_of(inp, job, 0) == (inp, job)
    ids = set()
    for tries in (1, 2):
        again, work = retry_of(inp, job, tries)
        assert again.request_id == work.request_id == f"chatcmpl-abc-0~{tries}"
        assert replace(again, request_id=inp.request_id) == inp
        assert replace(work, request_id=job.request_id) == job
        ids.add(again.request_id)
    assert len(ids) == 2


async def test_parameters_the_worker_refuses_are_400(worker: WorkerProcess) -> None:
    """INVALID_ARGUMENT from the worker is the client's mistake (the HTTP layer checks top_k
    itself; the pool is asked directly here)."""
    pool = WorkerPool([worker.address])
    await pool.start()
    try:
        inp = GenerationInput("refused-1", (1, 2, 3), sampling(top_k=100000))
        with pytest.raises(APIError) as e:
            _ = [d async for d in pool.generate(inp)]
        assert e.value.status == 400
        assert "top_k" in e.value.message
    finally:
        await pool.close()


async def test_gateway_without_workers_is_503() -> None:
    settings = GatewaySettings(workers=[f"127.0.0.1:{free_port()}"], model=MODEL)
    async with gateway_client(create_app(settings)) as client:
        r = await client.get("/health")
        assert r.status_code == 503
        r = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
        assert r.headers["retry-after"] == "1"
        # Validation still answers without a worker.
        r = await client.post("/v1/completions", json={"prompt": "x", "temperature": -1})
        assert r.status_code == 400
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == MODEL


async def test_worker_dying_between_polls_gives_503(worker: WorkerProcess) -> None:
    """A worker the poll thought healthy fails at once: with no other worker, 503."""
    dead = f"127.0.0.1:{free_port()}"
    settings = GatewaySettings(workers=[dead], model=MODEL, max_retries=0)
    app = create_app(settings, admission=ImmediateAdmission(InOrderRouter()))
    async with gateway_client(app) as client:
        pool = app.state.ctx.pool
        # Pretend the dead address answered a poll with the real worker's model.
        real = WorkerPool([worker.address])
        await real.poll_all()
        pool.workers[dead].model = real.workers[worker.address].model
        await real.close()
        r = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}
        )
        assert r.status_code == 503, r.text
        assert dead in r.json()["error"]["message"]


async def test_worker_dying_mid_stream_ends_with_error_frame(tmp_path: Path) -> None:
    """After the first token the status is already 200: the failure is a data frame, then
    [DONE]. A worker of its own, since this one gets killed."""
    doomed = start_worker(tmp_path / "worker.log")
    try:
        settings = GatewaySettings(workers=[doomed.address], model=MODEL)
        async with gateway_client(create_app(settings)) as client:
            body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
            request = asyncio.create_task(client.post("/v1/completions", json=body))
            for _ in range(200):
                await asyncio.sleep(0.05)
                if doomed.load().num_running:
                    break
            await asyncio.sleep(0.3)  # some tokens out
            os.kill(doomed.proc.pid, signal.SIGKILL)
            r = await request
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[0]["choices"][0]["text"] is not None
        error = events[-1]["error"]
        assert error["code"] == 503
        assert error["type"] == "ServiceUnavailableError"
        assert "mid-generation" in error["message"]
    finally:
        kill_process(doomed.proc)
