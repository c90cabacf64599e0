"""End to end, real processes (``dhisparse up --workers 2``: a host store, a gateway and two CPU
workers): the worker serving a stream is SIGKILLed mid-stream and its live peer adopts the
session from the node's store — the client's stream completes with exactly the text of an
uninterrupted run, the peer computes no prompt token, and the gateway counts one adoption. The
stall the client saw is printed, not asserted (it depends on the machine's load)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.core.up import UpStack as Stack
from dhisparse import metrics as names
from tests.e2e.test_durability import LONG, stream_chat, up_stack
from tests.e2e.test_stack import offline_greedy


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Stack]:
    """Two hisparse workers on one store, leases long enough that only fencing frees a dead
    worker's sessions at once, a quick gateway health poll."""
    env = {
        "DHISPARSE_WORKER_LEASE_TTL_S": "30",
        "DHISPARSE_GATEWAY_RESUME_DEADLINE_S": "60",
        "DHISPARSE_GATEWAY_HEALTH_INTERVAL_S": "0.25",
    }
    flags = ("--workers", "2", "--kv-pool-mib", "128", "--max-model-len", "1024",
             "--mode", "hisparse", "--drafter", "none")  # fmt: skip
    with up_stack(tmp_path / "up.log", *flags, env=env) as st:
        yield st


def metrics_url(stack: Stack, index: int) -> str:
    """Worker ``index``'s metrics (``up`` gives worker i the metrics port of worker 0 + 10 i)."""
    base, port = stack.worker_metrics.rsplit(":", 1)
    return f"{base}:{int(port.split('/')[0]) + 10 * index}/metrics"


def serving(stack: Stack) -> int:
    """The index of the worker running the one request in flight."""
    running = [stack.metric(metrics_url(stack, i), names.NUM_REQUESTS_RUNNING) or 0 for i in (0, 1)]
    assert sorted(running) == [0, 1], running
    return running.index(1)


def test_a_live_peer_adopts_the_stream_of_a_killed_worker(pair: Stack) -> None:
    want = offline_greedy(LONG)
    killed: list[int] = []
    arrivals: list[float] = []

    def kill_serving_worker(n: int) -> None:
        arrivals.append(time.monotonic())
        if n == 40 and not killed:
            victim = serving(pair)
            pid = pair.pids(f"worker-{victim}")[-1]
            os.kill(pid, signal.SIGKILL)
            killed.append(victim)

    text, chunks = stream_chat(pair.base, LONG, kill_serving_worker)
    assert killed, "the stream ended before the kill"
    assert not [c for c in chunks if "error" in c], chunks[-3:]
    assert text == want  # token for token what an uninterrupted run gives
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    after = [b - a for a, b in zip(arrivals[39:], arrivals[40:], strict=False)]
    print(f"stall after the SIGKILL: {max(after):.3f} s (chunk gaps after it)")
    peer = metrics_url(pair, 1 - killed[0])
    assert pair.metric(peer, f"{names.SESSIONS_RESUMED}_total") == 1
    assert pair.metric(peer, f"{names.PREFILL_TOKENS_COMPUTED}_total") == 0  # no prompt token
    gateway = f"{pair.base}/metrics"
    assert pair.metric(gateway, f"{names.ADOPTIONS}_total", outcome="adopted") == 1
    assert pair.metric(gateway, f"{names.STREAMS_RESUMED}_total", outcome="resumed") == 0
    # the next request is served as usual (the killed worker comes back, or the peer takes it)
    r = httpx.post(
        f"{pair.base}/v1/completions",
        json={"model": chunks[0]["model"], "prompt": "hi", "max_tokens": 4}, timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
