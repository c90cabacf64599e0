"""End to end, real processes (``dhisparse up --workers 2``: a host store, a gateway and two CPU
workers): the worker serving a stream is SIGKILLed mid-stream and its live peer adopts the
session from the node's store — the client's stream completes with exactly the text of an
uninterrupted run, the peer computes no prompt token, and the gateway counts one adoption. The
stall the client saw is printed, not asserted (it depends on the machine's load). Then: the
adopter killed in turn; the adopter killed inside ``Adopt`` (a test-only fault of the worker),
and a sampled stream's text across the moves; a drain (SIGTERM) under load; a rolling restart
of both workers under steady load — none drops a stream."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from bench.adoption import worker_metrics as metrics_url
from bench.core.up import UpStack as Stack
from dhisparse import metrics as names
from tests.e2e.test_durability import LONG, stream_chat, up_stack
from tests.e2e.test_stack import offline_greedy


@contextmanager
def two_workers(tmp_path: Path, **env: str) -> Iterator[Stack]:
    """Two hisparse workers on one store, leases long enough that only fencing frees a dead
    worker's sessions at once, a quick gateway health poll; ``env``: more settings."""
    env = {
        "DHISPARSE_WORKER_LEASE_TTL_S": "30",
        "DHISPARSE_GATEWAY_RESUME_DEADLINE_S": "60",
        "DHISPARSE_GATEWAY_HEALTH_INTERVAL_S": "0.25",
    } | env
    flags = ("--workers", "2", "--kv-pool-mib", "128", "--max-model-len", "1024",
             "--mode", "hisparse", "--drafter", "none")  # fmt: skip
    with up_stack(tmp_path / "up.log", *flags, env=env) as st:
        yield st


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Stack]:
    with two_workers(tmp_path) as st:
        yield st


def running(stack: Stack, index: int) -> float:
    """Requests worker ``index`` runs (0 while it is down)."""
    try:
        return stack.metric(metrics_url(stack, index), names.NUM_REQUESTS_RUNNING) or 0
    except httpx.HTTPError:
        return 0


def story(stack: Stack) -> str:
    """The stack's log lines about breaks, adoptions, resumes and health: what a failed
    assertion prints."""
    words = ("adopt", "re-attach", "moving it again", "resumed", "health", "healthy", "fenc")
    lines = stack.log.read_text(errors="replace").splitlines()
    return "\n".join(line for line in lines if any(w in line for w in words))


def serving(stack: Stack) -> int:
    """The index of the worker running the one request in flight."""
    counts = [running(stack, i) for i in (0, 1)]
    assert sorted(counts) == [0, 1], counts
    return counts.index(1)


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
    assert (
        pair.metric(f"{pair.base}/metrics", f"{names.ADOPTIONS}_total", outcome="adopted") == 1
    ), story(pair)
    assert not [c for c in chunks if "error" in c], chunks[-3:]
    assert text == want  # token for token what an uninterrupted run gives
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    after = [b - a for a, b in itertools.pairwise(arrivals[39:])]
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


def test_an_adopter_killed_in_turn_leaves_the_session_to_its_successor(pair: Stack) -> None:
    """The peer that adopted the stream is SIGKILLed too, before the first victim is back: no
    live peer remains, so the stream waits for the adopter's restart, which resumes the session
    it had adopted (the store's owner is the adopter now, not the first victim)."""
    want = offline_greedy(LONG)
    killed: list[int] = []

    def kill_twice(n: int) -> None:
        if n in (30, 60) and len(killed) < 2:
            victim = serving(pair)
            os.kill(pair.pids(f"worker-{victim}")[-1], signal.SIGKILL)
            killed.append(victim)

    text, chunks = stream_chat(pair.base, LONG, kill_twice)
    assert len(killed) == 2 and killed[0] != killed[1], story(pair)
    assert not [c for c in chunks if "error" in c], chunks[-3:]
    assert text == want
    gateway = f"{pair.base}/metrics"
    assert pair.metric(gateway, f"{names.ADOPTIONS}_total", outcome="adopted") == 1
    assert pair.metric(gateway, f"{names.ADOPTIONS}_total", outcome="no_peer") == 1
    assert pair.metric(gateway, f"{names.STREAMS_RESUMED}_total", outcome="resumed") == 1
    back = metrics_url(pair, killed[1])  # the adopter's successor
    assert pair.metric(back, f"{names.SESSIONS_RESUMED}_total") == 1
    assert pair.metric(back, f"{names.PREFILL_TOKENS_COMPUTED}_total") == 0


SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}


def test_a_kill_inside_adopt_and_the_sampling_law_across_adoptions(tmp_path: Path) -> None:
    """A sampled (seeded) stream: its text with the moves below equals an uninterrupted run's,
    token for token — the sampling law holds across an adoption.

    First the serving worker is SIGKILLed and its peer, asked to ``Adopt`` the stream, dies
    inside the call once the store moved the session to it, before streaming any of it (the
    worker's test-only fault, ``test_kill_in_adopt``, fires once). The gateway looks for the
    session at that peer, whose successor resumed it. Then, both back, the serving worker is
    SIGKILLed again and its live peer adopts the stream. Without the prefix cache, so that the
    uninterrupted run leaves the others nothing to import (an import computes the prompt's tail
    in a pass of another size)."""
    marker = tmp_path / "killed-in-adopt"
    env = {"DHISPARSE_WORKER_TEST_KILL_IN_ADOPT": str(marker),
           "DHISPARSE_WORKER_PREFIX_CACHE": "false"}  # fmt: skip
    with two_workers(tmp_path, **env) as stack:
        gateway = f"{stack.base}/metrics"
        want, _ = stream_chat(stack.base, LONG, **SAMPLED)
        killed: list[int] = []

        def kill_serving_worker(n: int) -> None:
            if n == 40:
                victim = serving(stack)
                os.kill(stack.pids(f"worker-{victim}")[-1], signal.SIGKILL)
                killed.append(victim)

        text, chunks = stream_chat(stack.base, LONG, kill_serving_worker, **SAMPLED)
        assert killed, "the stream ended before the kill"
        assert marker.exists(), story(stack)  # the peer died inside Adopt
        assert "test fault: SIGKILL adopted" in stack.log.read_text(), story(stack)
        assert not [c for c in chunks if "error" in c], (chunks[-3:], story(stack))
        assert text == want, story(stack)
        assert stack.metric(gateway, f"{names.ADOPTIONS}_total", outcome="adopted") == 0
        assert stack.metric(gateway, f"{names.STREAMS_RESUMED}_total", outcome="resumed") == 1
        broken = metrics_url(stack, 1 - killed[0])  # the adopter that died: its successor
        assert stack.metric(broken, f"{names.SESSIONS_RESUMED}_total") == 1, story(stack)
        assert stack.metric(broken, f"{names.PREFILL_TOKENS_COMPUTED}_total") == 0

        for index in (0, 1):
            wait_serving(stack, index)
        killed.clear()
        text, chunks = stream_chat(stack.base, LONG, kill_serving_worker, **SAMPLED)
        assert killed, "the stream ended before the kill"
        assert not [c for c in chunks if "error" in c], (chunks[-3:], story(stack))
        assert text == want, story(stack)
        adopted = stack.metric(gateway, f"{names.ADOPTIONS}_total", outcome="adopted")
        assert adopted == 1, story(stack)


def test_a_drained_worker_hands_its_streams_to_its_peer_and_drops_none(pair: Stack) -> None:
    """SIGTERM (a rolling update) under load: the worker stops admitting, hands its sessions
    over and exits; every stream completes with the uninterrupted text."""
    want = offline_greedy(LONG)
    drained: list[int] = []

    def drain_once(n: int) -> None:
        if n == 40 and not drained:
            counts = [running(pair, i) for i in (0, 1)]
            victim = counts.index(max(counts))
            os.kill(pair.pids(f"worker-{victim}")[-1], signal.SIGTERM)
            drained.append(victim)

    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(stream_chat, pair.base, LONG, drain_once if i == 0 else None)
            for i in range(4)
        ]
        results = [f.result(timeout=600) for f in futures]
    assert drained, "the streams ended before the drain"
    for text, chunks in results:
        assert not [c for c in chunks if "error" in c], chunks[-3:]
        assert text == want
    log = pair.log.read_text()
    assert f"[up] worker-{drained[0]} exited (0)" in log  # it drained and exited cleanly
    gateway = f"{pair.base}/metrics"
    adopted = pair.metric(gateway, f"{names.ADOPTIONS}_total", outcome="adopted") or 0
    resumed = pair.metric(gateway, f"{names.STREAMS_RESUMED}_total", outcome="resumed") or 0
    assert adopted + resumed >= 1  # moved to the peer, or (no room) to the successor
    print(f"drain: {adopted:.0f} streams adopted by the peer, {resumed:.0f} by the successor")


def wait_serving(stack: Stack, index: int, timeout_s: float = 180) -> None:
    """Until worker ``index``'s successor serves (its metrics answer) and the gateway's
    ``/health`` lists every worker healthy: a rolling restart's readiness gate (draining the
    next worker before the gateway routes to this one would leave none to route to)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(metrics_url(stack, index), timeout=2).raise_for_status()
            workers = httpx.get(f"{stack.base}/health", timeout=2).json()["workers"]
            if len(workers) >= 2 and set(workers.values()) == {"healthy"}:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"worker-{index} did not come back"
        time.sleep(0.2)


def test_a_rolling_restart_under_steady_load_drops_no_stream(pair: Stack) -> None:
    """Every worker drained in turn (SIGTERM, then its successor serves) while clients keep
    streaming: every stream completes with the uninterrupted text."""
    n = 120
    want = offline_greedy(n)
    stop = threading.Event()
    results: list[tuple[str, list[dict]]] = []

    def client() -> None:
        while not stop.is_set():
            results.append(stream_chat(pair.base, n))

    with ThreadPoolExecutor(3) as pool:
        clients = [pool.submit(client) for _ in range(3)]
        time.sleep(3.0)  # steady load first
        for index in (0, 1):
            pids = pair.pids(f"worker-{index}")
            os.kill(pids[-1], signal.SIGTERM)
            while len(pair.pids(f"worker-{index}")) == len(pids):  # `up` restarts it
                time.sleep(0.2)
            wait_serving(pair, index)
        stop.set()
        for c in clients:
            c.result(timeout=600)
    log = pair.log.read_text()
    assert "[up] worker-0 exited (0)" in log and "[up] worker-1 exited (0)" in log
    assert len(results) >= 6
    for text, chunks in results:
        assert not [c for c in chunks if "error" in c], chunks[-3:]
        assert text == want
    gateway = f"{pair.base}/metrics"
    adopted = pair.metric(gateway, f"{names.ADOPTIONS}_total", outcome="adopted") or 0
    print(f"rolling restart: {len(results)} streams, {adopted:.0f} moved to a peer")
