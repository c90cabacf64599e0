"""Prefix-affinity routing through the real gateway: two nodes (each a real `dhisparse
kv-host-store` process and a real CPU worker over it, hierarchy mode, prefix cache on), the
gateway in-process. A conversation's second turn goes to the node whose store holds its first
turn's pages and reports them in ``usage.prompt_tokens_details.cached_tokens``; without
affinity the least-loaded rotation sends it to the other node, which computes it all."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dhisparse.rpc import worker_pb2, worker_pb2_grpc
from services.gateway import GatewaySettings, create_app
from services.kv_host_store import KVHostStoreClient
from tests.gateway.conftest import (
    MODEL,
    RedisServer,
    WorkerProcess,
    gateway_client,
    kill_process,
    launch_worker,
    sse_events,
    until,
    wait_worker,
)
from tests.kv_host_store.conftest import StoreProcess, start_store_process

PAGE = 16  # the workers' default page size
CONVERSATIONS = 3


@dataclass
class Node:
    store: StoreProcess
    worker: WorkerProcess

    def prefix_hits(self) -> int:
        """Leases the node's store handed out on a cached prefix so far."""
        client = KVHostStoreClient(self.store.target)
        try:
            return client.stats().prefix_hits
        finally:
            client.close()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Node]]:
    """Two nodes: a store and a worker over it each (killed by PID, arenas removed)."""
    tmp = tmp_path_factory.mktemp("affinity")
    stores: list[StoreProcess] = []
    workers: list[WorkerProcess] = []
    try:
        for _ in range(2):
            arena = Path("/dev/shm") / f"dhisparse-test-affinity-{uuid.uuid4().hex}"
            stores.append(start_store_process(arena))
        logs = [tmp / f"worker-{i}.log" for i in range(2)]
        for i, store in enumerate(stores):
            args = ["--mode", "hisparse", "--kv-store", store.target, "--kv-pool-mib", "64"]
            workers.append(launch_worker(logs[i], *args, "--worker-id", f"node{i}-worker"))
        for w, log in zip(workers, logs, strict=True):
            wait_worker(w, log)
        yield [Node(s, w) for s, w in zip(stores, workers, strict=True)]
    finally:
        for w in workers:
            kill_process(w.proc)
        for s in stores:
            kill_process(s.proc)
            s.arena_path.unlink(missing_ok=True)


def settings(nodes: list[Node], **overrides: Any) -> GatewaySettings:
    workers = [n.worker.address for n in nodes]
    return GatewaySettings(workers=workers, model=MODEL, health_interval_s=0.5, **overrides)


async def chat(client: httpx.AsyncClient, messages: list[dict], **kw: Any) -> dict:
    body = {"messages": messages, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **kw}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if kw.get("stream"):
        events = sse_events(r.text)
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
        return {"text": text, "usage": events[-1]["usage"]}
    return {"text": r.json()["choices"][0]["message"]["content"], "usage": r.json()["usage"]}


async def conversation(client: httpx.AsyncClient, topic: str, stream: bool) -> tuple[dict, dict]:
    """A first turn, then the second turn with the first's answer in its history."""
    first = [
        {"role": "system", "content": f"You answer questions about {topic}, briefly. " * 3},
        {"role": "user", "content": f"What is the first thing to know about {topic}?"},
    ]
    one = await chat(client, first)
    second = [*first, {"role": "assistant", "content": one["text"]}]
    second.append({"role": "user", "content": "And the second?"})
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    two = await chat(client, second, **extra)
    return one["usage"], two["usage"]


async def metric(client: httpx.AsyncClient, name: str, **labels: str) -> float:
    text = (await client.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"{name} {labels} not exported")


def test_each_worker_reports_its_nodes_store_and_its_prefix_cache(nodes: list[Node]) -> None:
    ids = []
    for n in nodes:
        client = KVHostStoreClient(n.store.target)
        try:
            ids.append(client.get_arena().store_id)
        finally:
            client.close()
        with grpc.insecure_channel(n.worker.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            assert stub.GetModelInfo(worker_pb2.ModelInfoRequest(), timeout=5).prefix_cache
        assert n.worker.load().kv_store_id == ids[-1]
    assert len(set(ids)) == 2 and all(ids)


async def test_the_next_turn_goes_to_the_node_that_holds_its_prefix(
    nodes: list[Node],
) -> None:
    async with gateway_client(create_app(settings(nodes))) as client:
        for i in range(CONVERSATIONS):
            one, two = await conversation(client, f"affinity topic {i}", stream=i == 0)
            cached = two["prompt_tokens_details"]["cached_tokens"]
            # at least the first turn's whole pages: its prompt opens the second's
            assert cached >= one["prompt_tokens"] // PAGE * PAGE > 0, (one, two)
            assert cached < two["prompt_tokens"]
            if i == 0:  # later first turns share the system prompt's opening with it
                assert one["prompt_tokens_details"]["cached_tokens"] == 0
        routed = {
            reason: await metric(
                client, "dhisparse:routing_decisions_total", model=MODEL, reason=reason
            )
            for reason in ("affinity", "load", "load-over-affinity")
        }
        # the first first turn had no predicted hit; the others share its opening pages
        assert routed["load"] >= 1 and routed["affinity"] >= CONVERSATIONS
        assert sum(routed.values()) == 2 * CONVERSATIONS and routed["load-over-affinity"] == 0
        predicted = await metric(client, "dhisparse:prefix_affinity_predicted_tokens_total")
        hits = await metric(client, "dhisparse:prompt_tokens_cached_total", model=MODEL)
        assert hits >= CONVERSATIONS * PAGE and predicted >= hits
        assert await metric(client, "dhisparse:prefix_affinity_index_pages", model=MODEL) > 0


async def completion(client: httpx.AsyncClient, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return {"text": r.json()["choices"][0]["text"], "usage": r.json()["usage"]}


async def test_second_turns_follow_first_turns_spread_over_both_nodes(nodes: list[Node]) -> None:
    """Prompts that differ from their first token, whose first turns run at once (load spreads
    them over both nodes): each second turn goes where its first turn went."""
    before = [n.prefix_hits() for n in nodes]
    prompts = [
        f"{i}{i}{i} is the number of story {i}, which begins like this: " * 2 for i in range(4)
    ]
    async with gateway_client(create_app(settings(nodes))) as client:
        ones = await asyncio.gather(*(completion(client, p) for p in prompts))
        twos = await asyncio.gather(
            *(
                completion(client, f"{p}{one['text']} Then")
                for p, one in zip(prompts, ones, strict=True)
            )
        )
    for one, two in zip(ones, twos, strict=True):
        cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= one["usage"]["prompt_tokens"] // PAGE * PAGE > 0, (one, two)
    gained = [n.prefix_hits() - b for n, b in zip(nodes, before, strict=True)]
    assert sum(gained) == len(prompts) and min(gained) >= 1, gained


async def test_without_affinity_the_next_turn_may_miss(nodes: list[Node]) -> None:
    """The control: the least-loaded rotation alternates idle workers, so a second turn lands
    on the node that did not serve its first and computes its first turn's pages again there
    (it may still find the pages it shares with other conversations)."""
    async with gateway_client(create_app(settings(nodes, prefix_affinity=False))) as client:
        missed = 0
        for i in range(CONVERSATIONS):
            one, two = await conversation(client, f"plain topic {i}", stream=False)
            own = one["prompt_tokens"] // PAGE * PAGE
            missed += two["prompt_tokens_details"]["cached_tokens"] < own
        assert missed >= 1
        # no decision is counted as affinity's: none was made
        name = "dhisparse:routing_decisions_total"
        assert await metric(client, name, model=MODEL, reason="affinity") == 0


async def test_a_turn_another_replica_routes_finds_its_first_turns_node(
    nodes: list[Node], redis_server: RedisServer
) -> None:
    """Two gateway replicas on the ledger's Redis (one deployment's prefix): each first turn
    goes through replica A, each second turn through replica B, which learned where the first
    went from A's records on the shared affinity feed."""
    shared = {"redis_url": redis_server.url, "ledger_prefix": redis_server.prefix()}
    a_app, b_app = create_app(settings(nodes, **shared)), create_app(settings(nodes, **shared))
    async with gateway_client(a_app) as a, gateway_client(b_app) as b:
        feed = b_app.state.affinity_feed
        assert feed is not None and a_app.state.affinity_feed is not None
        for i in range(CONVERSATIONS):
            first = [
                {"role": "system", "content": f"Replica {i} answers on {i} things, briefly. " * 3},
                {"role": "user", "content": f"What is thing {i}?"},
            ]
            applied = feed.stats.applied
            one = await chat(a, first)
            await until(lambda: feed.stats.applied > applied)  # noqa: B023
            second = [*first, {"role": "assistant", "content": one["text"]}]
            second.append({"role": "user", "content": "And then?"})
            two = await chat(b, second)
            cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= one["usage"]["prompt_tokens"] // PAGE * PAGE > 0, (one, two)
        assert (
            await metric(b, "dhisparse:routing_decisions_total", model=MODEL, reason="affinity")
            >= CONVERSATIONS
        )
        feed_records = "dhisparse:prefix_affinity_feed_records_total"
        assert await metric(b, feed_records, outcome="applied") >= CONVERSATIONS
        assert await metric(a, feed_records, outcome="sent") >= CONVERSATIONS
        assert await metric(a, feed_records, outcome="dropped") == 0
