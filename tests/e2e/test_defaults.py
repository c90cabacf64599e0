"""End to end under plain ``make run``: ``dhisparse up`` with no mode, device or drafter flags
serves adaptive mode with durable sessions (and, on a CPU, speculative decoding with the
shipped DFlash drafter). A worker SIGKILLed mid-stream loses nothing: ``up`` restarts it, the
new process resumes the session from the host store, and the client's stream completes with
exactly the text of an uninterrupted run.

The stack gets only free ports and a fresh arena path (so it can run beside others on one
machine); every serving setting, and every timing knob, is the default."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from dhisparse import metrics as m
from dhisparse.up import DEFAULT_DRAFTER
from tests.e2e.test_durability import Stack, stream_chat, up_stack

LONG = 240  # tokens: the kill lands well inside the stream
KILL_AT = 30  # content chunks (with speculation, a chunk can carry several tokens)


def config_info(stack: Stack) -> dict[str, str]:
    """The labels of the worker's ``worker_config_info`` sample."""
    for line in httpx.get(stack.worker_metrics, timeout=5).text.splitlines():
        if line.startswith(m.WORKER_CONFIG_INFO + "{"):
            body = line[line.index("{") + 1 : line.rindex("}")]
            return dict(kv.split("=", 1) for kv in body.replace('"', "").split(","))
    raise AssertionError(f"no {m.WORKER_CONFIG_INFO} at {stack.worker_metrics}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack for the module: the configuration is read before the kill test runs."""
    with up_stack(tmp_path_factory.mktemp("defaults") / "up.log") as st:
        yield st


def test_the_defaults_are_adaptive_durable_and_speculative_on_a_cpu(stack: Stack) -> None:
    info = config_info(stack)
    gpu = torch.cuda.is_available()
    assert info["mode"] == "adaptive" and info["durable_sessions"] == "on"
    assert info["device"] == ("cuda:0" if gpu else "cpu")
    assert info["drafter"] == ("none" if gpu else DEFAULT_DRAFTER)
    assert info["cuda_graphs"] == ("on" if gpu else "off")
    assert "[up] device " in stack.log.read_text()


def test_worker_killed_mid_stream_loses_nothing_under_the_defaults(stack: Stack) -> None:
    # The uninterrupted run: the same request through the same stack (that the stack's greedy
    # text is the offline engine's is tests/e2e/test_stack.py's business).
    want, _ = stream_chat(stack.base, LONG)
    (first,) = stack.pids("worker-0")
    killed: list[int] = []
    drafts_before: list[float | None] = []

    def kill_once(n: int) -> None:
        if n == KILL_AT and not killed:
            drafts_before.append(stack.metric(stack.worker_metrics, f"{m.SPEC_DRAFTS}_total"))
            os.kill(first, signal.SIGKILL)
            killed.append(first)

    t0 = time.monotonic()
    text, chunks = stream_chat(stack.base, LONG, kill_once)
    assert killed, "the stream ended before the kill"
    assert not [c for c in chunks if "error" in c], chunks[-3:]
    assert text == want  # token for token what an uninterrupted run gives
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(stack.pids("worker-0")) == 2  # `up` restarted it
    assert stack.metric(stack.worker_metrics, f"{m.SESSIONS_RESUMED}_total") == 1
    # The new process computed no prompt: it resumed from host backups.
    assert stack.metric(stack.worker_metrics, f"{m.PREFILL_TOKENS_COMPUTED}_total") == 0
    assert (
        stack.metric(f"{stack.base}/metrics", f"{m.STREAMS_RESUMED}_total", outcome="resumed") == 1
    )
    if not torch.cuda.is_available():  # the default there: speculation, before and after
        assert (drafts_before[0] or 0) > 0
        assert (stack.metric(stack.worker_metrics, f"{m.SPEC_DRAFTS}_total") or 0) > 0
    assert time.monotonic() - t0 < 90
