"""End to end under plain ``make run``: ``dhisparse up`` with no mode, device or drafter flags
serves adaptive mode with durable sessions (and, on a CPU, speculative decoding with the
shipped DFlash drafter). A worker SIGKILLed mid-stream loses nothing: ``up`` restarts it, the
new process resumes the session from the host store, and the client's stream completes with
exactly the text of an uninterrupted run. The worker sizes its KV pool itself (on a GPU from the
memory free once the model is loaded) and says what it chose; on a GPU the stack serves the
README's first example.

The stack gets only free ports and a fresh arena path (so it can run beside others on one
machine); every serving setting, and every timing knob, is the default."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from itertools import pairwise

import httpx
import pytest
import torch

from dhisparse import metrics as m
from dhisparse.up import DEFAULT_DRAFTER
from tests.e2e.test_durability import Stack, stream_chat, up_stack
from tests.e2e.test_readme import EXAMPLES, run

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


def test_the_worker_sizes_its_kv_pool_and_says_so(stack: Stack) -> None:
    said = re.search(r"KV pool: (\d+) MiB \(auto: ([^)]*)\)", stack.log.read_text())
    assert said is not None, stack.log.read_text()[-3000:]
    if torch.cuda.is_available():
        assert "free on cuda:0 once the model is loaded" in said.group(2)
    else:
        # 256 MiB for sessions beside what does not grow with them (staging, scratch, maps)
        fixed = re.search(r"256 MiB for sessions beside (\d+) MiB", said.group(2))
        assert "the CPU default" in said.group(2) and fixed is not None, said.group(0)
        assert 256 < int(said.group(1)) <= 256 + int(fixed.group(1)) + 1, said.group(0)


@pytest.mark.gpu
def test_the_defaults_serve_the_readmes_first_example_on_the_gpu(stack: Stack) -> None:
    """`make run` on a GPU: no flags, the README's first request answered in full."""
    example = EXAMPLES[0]
    assert "/v1/completions" in example.code
    body = json.loads(run(example, stack))
    choice = body["choices"][0]
    assert choice["text"].strip() and choice["finish_reason"] == "length", body
    max_tokens = re.search(r'"max_tokens": (\d+)', example.code)
    assert max_tokens is not None and body["usage"]["completion_tokens"] == int(max_tokens[1])
    assert config_info(stack)["device"] == "cuda:0"


def test_worker_killed_mid_stream_loses_nothing_under_the_defaults(
    stack: Stack, record_property
) -> None:
    # The uninterrupted run: the same request through the same stack (that the stack's greedy
    # text is the offline engine's is tests/e2e/test_stack.py's business).
    want, _ = stream_chat(stack.base, LONG)
    (first,) = stack.pids("worker-0")
    killed: list[int] = []
    drafts_before: list[float | None] = []
    arrivals: list[float] = []

    def kill_once(n: int) -> None:
        arrivals.append(time.monotonic())
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
    # the client's wait across the restart: the longest gap between two chunks
    record_property("stall_s", max(b - a for a, b in pairwise(arrivals)))
