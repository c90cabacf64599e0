"""End to end, real processes (``dhisparse up``): a worker SIGKILLed mid-stream loses no session
— ``up`` restarts it, the new process resumes the session from the host store without
recomputing the prompt, and the client's stream completes with exactly the text of an
uninterrupted run; a SIGKILLed host store gives clear errors, no hang and no leaked capacity."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from bench.core import up
from bench.core.up import UpStack as Stack
from dhisparse.up import restart_delay
from tests.conftest import free_port
from tests.e2e.test_stack import MESSAGES, MODEL_NAME, offline_greedy

LONG = 240  # tokens: the kill lands well inside the stream


@contextmanager
def up_stack(log: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[Stack]:
    """``dhisparse up`` (``bench/core/up.py``) on ports of this xdist worker's own slice, with
    those its second worker derives (its port + 1, its metrics + 10) kept free too."""
    with up.up_stack(log, *flags, env=env, free_port=lambda: free_port(also=(1, 10))) as st:
        yield st


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """``up --mode hisparse`` with short leases and a quick gateway health poll."""
    env = {
        "DHISPARSE_WORKER_LEASE_TTL_S": "1.5",
        "DHISPARSE_GATEWAY_RESUME_DEADLINE_S": "60",
        "DHISPARSE_GATEWAY_HEALTH_INTERVAL_S": "0.25",
    }
    flags = ("--kv-pool-mib", "128", "--max-model-len", "1024", "--mode", "hisparse",
             "--drafter", "none")  # fmt: skip
    with up_stack(tmp_path / "up.log", *flags, env=env) as st:
        yield st


def _body(max_tokens: int, **extra: object) -> dict:
    return {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True} | extra  # fmt: skip


def stream_chat(
    base: str, max_tokens: int, on_chunk=None, **extra: object
) -> tuple[str, list[dict]]:
    """Streams a greedy chat completion (``extra``: other body fields, the model's name and
    messages among them); ``on_chunk(n)`` runs after the n-th content chunk."""
    chunks = stream_sse(f"{base}/v1/chat/completions", _body(max_tokens, **extra), on_chunk)
    text = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
    )
    return text, chunks


def stream_sse(url: str, body: dict, on_chunk=None) -> list[dict]:
    """The chunks of a streamed completion POSTed to ``url``; ``on_chunk(n)`` runs after the
    n-th chunk with choices."""
    chunks: list[dict] = []
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            if on_chunk is not None and "choices" in chunk:
                on_chunk(len(chunks))
    return chunks


def killer(pid: int, at: int = 40) -> tuple[Callable[[int], None], list[int]]:
    """(an ``on_chunk`` that SIGKILLs ``pid`` once, after the ``at``-th chunk; the PIDs it
    killed)."""
    killed: list[int] = []

    def kill_once(n: int) -> None:
        if n == at and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    return kill_once, killed


def test_worker_killed_mid_stream_loses_nothing(stack: Stack) -> None:
    want = offline_greedy(LONG)
    (first,) = stack.pids("worker-0")
    kill_once, killed = killer(first)
    t0 = time.monotonic()
    text, chunks = stream_chat(stack.base, LONG, kill_once)
    assert killed, "the stream ended before the kill"
    assert not [c for c in chunks if "error" in c], chunks[-3:]
    assert text == want  # token for token what an uninterrupted run gives
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(stack.pids("worker-0")) == 2  # `up` restarted it
    resumed = stack.metric(stack.worker_metrics, "dhisparse:sessions_resumed_total")
    prefill = stack.metric(stack.worker_metrics, "dhisparse:prefill_tokens_computed_total")
    assert resumed == 1
    assert prefill == 0  # the new process computed no prompt: it resumed from host backups
    assert (
        stack.metric(f"{stack.base}/metrics", "dhisparse:streams_resumed_total", outcome="resumed")
        == 1
    )
    assert time.monotonic() - t0 < 90


def test_host_store_killed_gives_clear_errors_and_no_leak(stack: Stack) -> None:
    (store,) = stack.pids("kv-host-store")
    killed: list[int] = []
    failures: list[httpx.Response] = []

    def kill_store_then_try(n: int) -> None:
        if n != 20 or killed:
            return
        os.kill(store, signal.SIGKILL)
        killed.append(store)
        # Until the running stream ends the worker cannot re-attach to the restarted store: a
        # new request is refused with a clear reason, at once.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            r = httpx.post(
                f"{stack.base}/v1/chat/completions", json={**_body(4), "stream": False},
                timeout=30,
            )  # fmt: skip
            if r.status_code == 503:
                failures.append(r)
                return
            time.sleep(0.2)

    text, _ = stream_chat(stack.base, 160, kill_store_then_try)
    assert killed
    # The running request finished: its rows live in the worker's mapping of the arena.
    assert text == offline_greedy(160)
    assert failures, "no request was refused while the host store was gone"
    message = failures[0].json()["error"]["message"]
    assert "host KV store" in message, message
    # Once the stream is over, the worker re-attaches to the restarted store and serves again.
    deadline = time.monotonic() + 60
    while True:
        r = httpx.post(
            f"{stack.base}/v1/chat/completions", json={**_body(8), "stream": False}, timeout=30
        )
        if r.status_code == 200:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.3)
    assert r.json()["choices"][0]["message"]["content"] == offline_greedy(8)
    # No capacity leaked: the gateway's ledger holds nothing for the worker any more (its
    # gauges refresh on the next poll of the workers).
    deadline = time.monotonic() + 10
    while stack.metric(f"{stack.base}/metrics", "dhisparse:admitted_bytes") != 0:
        assert time.monotonic() < deadline, "admitted bytes stayed above zero"
        time.sleep(0.2)


def test_up_restarts_a_dead_child_at_once_then_backs_off() -> None:
    delays = [restart_delay(n) for n in range(1, 10)]
    assert delays[0] <= 0.1  # a crashed worker's sessions are waiting for its successor
    assert delays == sorted(delays) and delays[-1] == 30.0
