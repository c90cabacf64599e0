"""End to end: ``dhisparse up`` starts kv-host-store, worker and gateway as real processes; the
test talks HTTP to the gateway and compares with offline generation on the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import torch

from bench.core.up import stop_stack, wait_serving
from dhisparse.tokenizer import load_tokenizer
from dhisparse.tokenizer.formatter import chat_formatter
from services.kv_host_store.client import KVHostStoreClient
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams
from tests.conftest import free_port

MESSAGES = [{"role": "user", "content": "Write a haiku about sparse attention."}]
# What `make run` serves: the shipped trained target (and on a CPU, by default, its MTP layer).
MODEL_DIR, MODEL_NAME = "models/glm-dsa-mini", "glm-dsa-mini"
CODE_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""'


@dataclass(frozen=True)
class Stack:
    base: str
    store: str
    mode: str


@pytest.fixture(scope="module", params=["resident", "hisparse", "adaptive"])
def stack(request, tmp_path_factory) -> Iterator[Stack]:
    """The whole stack per serving mode; both must give the offline resident engine's text."""
    mode = request.param
    http, worker, store, store_metrics, metrics = (free_port() for _ in range(5))
    arena = f"/dev/shm/dhisparse-e2e-{os.getpid()}-{http}"
    log = tmp_path_factory.mktemp("stack") / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dhisparse.cli", "up", "--port", str(http),
             "--worker-port", str(worker), "--kv-store-port", str(store), "--arena-path", arena,
             "--kv-store-metrics-port", str(store_metrics), "--worker-metrics-port", str(metrics),
             "--kv-pool-mib", "256", "--mode", mode, "--no-restart"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{http}"
    try:
        wait_serving(proc, log)
        yield Stack(base, f"127.0.0.1:{store}", mode)
    finally:
        stop_stack(proc, log, arena)


def offline_greedy(max_tokens: int) -> str:
    tok = load_tokenizer(MODEL_DIR)
    prompt = chat_formatter(tok, MODEL_DIR).encode(MESSAGES)
    req = Engine(EngineConfig(model=MODEL_DIR, kv_pool_mib=8)).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )[0]
    return req.text.detok.text[: req.text.emitted]


def test_all_three_services_are_up(stack: Stack) -> None:
    assert httpx.get(f"{stack.base}/health").status_code == 200
    models = httpx.get(f"{stack.base}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]


def test_chat_completion_matches_offline_engine(stack: Stack) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(f"{stack.base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["content"] == offline_greedy(24)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 24


def test_streaming_chat_completion(stack: Stack) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    chunks, done, regions = [], False, None
    url = f"{stack.base}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as r, KVHostStoreClient(stack.store) as c:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                done = True
                break
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 3:  # mid-stream: the request's host backups are in the store
                regions = c.stats().regions
    assert done
    # One region per KV source (6 layers, and the MTP layer's when it drafts), and for the
    # durable session one per index producer (4 "full" indexer layers, and the MTP layer), its
    # manifest and, with the MTP layer, its page carries.
    mtp = 0 if torch.cuda.is_available() else 1  # `make run`'s drafter: MTP on a CPU only
    assert regions == (0 if stack.mode == "resident" else (6 + mtp) + (4 + mtp) + 1 + mtp)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == offline_greedy(24)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24
    assert len(chunks) > 3  # tokens arrived incrementally


def test_trained_model_continues_code_coherently(stack: Stack) -> None:
    """The shipped weights serve through the stack (with speculation, the default) and
    continue a code prompt the way the corpus does."""
    body = {"model": MODEL_NAME, "prompt": CODE_PROMPT, "max_tokens": 32, "temperature": 0}
    r = httpx.post(f"{stack.base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("\n    if not isinstance(n, int):\n")


def test_client_error_is_a_400_with_openai_shape(stack: Stack) -> None:
    r = httpx.post(
        f"{stack.base}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 100_000},
        timeout=30,
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert "maximum context length" in err["message"] and err["code"] == 400
