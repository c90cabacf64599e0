"""The gateway's own cost per request: the same small request through the HTTP gateway and
straight to the worker over gRPC, alternating request by request.

    python -m bench gateway --out gateway.json                      # 3 x 500 pairs per variant
    python -m bench gateway --requests 10 --repeats 1 --warmup 2    # a smoke run

A real ``dhisparse worker`` (``--model``, ``--device``) and a real ``dhisparse gateway`` in front
of it run as processes on loopback. One chat request (``--prompt`` as the user message,
``max_tokens``, temperature 0) goes to the gateway over one keep-alive HTTP connection
(``http.client``: the leanest client, so that little of the client's own time is counted), and
the ``GenerateRequest`` the gateway makes of it (built by the gateway's own preprocessing and
conversion code) goes to the worker over one gRPC channel (the generated sync stub). The two
paths alternate in lockstep, the first of each pair rotating, so that slow phases of the host
fall on both alike. Each latency runs from sending the request to the last byte of the answer
(the whole event stream for the streaming variant; the whole gRPC stream on the direct path,
which streams either way). Per-request overhead = gateway latency minus the direct latency of
the same pair.

The whole measurement (warm-up, then ``--requests`` pairs per variant) runs ``--repeats``
times; the result gives p50/p90/p99 of each path and of the overhead per repeat and pooled, and
the spread of the overhead's p50 across repeats (the run-to-run noise).

``run(args)`` returns the result as a JSON-able dict; ``python -m bench`` writes it to ``--out``
with its provenance.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.core import provenance
from bench.core.processes import HOST, free_port, wait_ready
from bench.core.processes import stop as stop_processes
from dhisparse.family.generation import GenerationDefaults
from dhisparse.rpc import worker_pb2, worker_pb2_grpc
from dhisparse.tokenizer import chat_formatter, load_tokenizer
from dhisparse.up import http_ok
from services.gateway import GatewaySettings, convert
from services.gateway.generation import GenerationInput
from services.gateway.preprocess import Limits, chat_prompt_ids, chat_sampling, resolve_max_tokens
from services.gateway.protocol import ChatCompletionRequest

GOAL_P50_MS = 2.0
VARIANTS = ("non_stream", "stream")
PERCENTILES = (50, 90, 99)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=500, help="pairs per variant and repeat")
    parser.add_argument("--warmup", type=int, default=50, help="unmeasured pairs first (50)")
    parser.add_argument("--repeats", type=int, default=3, help="whole measurements (3)")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="non_stream and/or stream (both)"
    )
    parser.add_argument("--prompt", default="Say hello.", help="the user message")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--model", default="tiny-glm", help="worker and gateway --model")
    parser.add_argument("--device", default="cpu", help="worker --device")
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="where the processes' logs go (a temp dir)"
    )


# --- processes --------------------------------------------------------------------------------


def _worker_ready(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            return bool(stub.Health(worker_pb2.HealthRequest(), timeout=1).ok)
    except grpc.RpcError:
        return False


@dataclass(frozen=True)
class Stack:
    worker: str  # host:port
    gateway_port: int


@contextlib.contextmanager
def stack(model: str, device: str, log_dir: Path) -> Iterator[Stack]:
    """A worker and a gateway in front of it, as processes; both stopped by PID on exit."""
    py = [sys.executable, "-m", "dhisparse.cli"]
    worker = f"{HOST}:{free_port()}"
    gateway_port = free_port()
    worker_argv = [*py, "worker", "--model", model, "--device", device, "--host", HOST,
                   "--port", worker.rpartition(":")[2], "--metrics-port", "0",
                   "--log-level", "WARNING"]  # fmt: skip
    gateway_argv = [*py, "gateway", "--workers", worker, "--model", model, "--host", HOST,
                    "--port", str(gateway_port), "--log-level", "warning"]  # fmt: skip
    env = dict(os.environ)
    if not device.startswith("cuda"):
        env.setdefault("TRITON_INTERPRET", "1")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for argv, ready, what in (
            (worker_argv, lambda: _worker_ready(worker), "worker"),
            (gateway_argv, lambda: http_ok(f"http://{HOST}:{gateway_port}/health"), "gateway"),
        ):
            log = log_dir / f"{what}.log"
            with log.open("wb") as out:
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env))
            wait_ready(ready, what, procs, log, 180)
        yield Stack(worker, gateway_port)
    finally:
        stop_processes(procs, grace_s=10)


# --- the two paths ----------------------------------------------------------------------------
def chat_body(args: argparse.Namespace, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
    }
    if stream:
        body["stream"] = True
    return body


def direct_request(
    args: argparse.Namespace, info: worker_pb2.ModelInfo
) -> worker_pb2.GenerateRequest:
    """What the gateway sends the worker for ``chat_body``, built by the gateway's own code."""
    settings = GatewaySettings(model=args.model)
    model_dir = settings.model_dir()
    tokenizer = load_tokenizer(model_dir)
    req = ChatCompletionRequest.model_validate(chat_body(args, stream=False))
    limits = Limits(
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size or tokenizer.vocab_size,
        max_n=settings.max_n,
        max_logprobs=settings.max_logprobs,
        default_max_tokens=settings.default_max_tokens,
        generation=GenerationDefaults.read(model_dir),
    )
    ids = chat_prompt_ids(chat_formatter(tokenizer, model_dir), req)
    max_tokens = resolve_max_tokens(len(ids), req.requested_max_tokens(), limits)
    sampling = chat_sampling(req, max_tokens, limits)
    return convert.generate_request(
        GenerationInput("direct", tuple(ids), sampling.for_choice(0), info.model_name)
    )


class GatewayPath:
    """One keep-alive HTTP connection to the gateway."""

    def __init__(self, port: int, body: dict[str, Any]) -> None:
        self.conn = http.client.HTTPConnection(HOST, port, timeout=60)
        self.payload = json.dumps(body).encode()
        self.headers = {"Content-Type": "application/json"}

    def __call__(self) -> bytes:
        self.conn.request("POST", "/v1/chat/completions", body=self.payload, headers=self.headers)
        response = self.conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"gateway answered {response.status}: {data[:300]!r}")
        return data

    def close(self) -> None:
        self.conn.close()


class DirectPath:
    """One gRPC channel to the worker; each call a fresh request id."""

    def __init__(self, address: str, request: worker_pb2.GenerateRequest) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.request = request
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        self.request.request_id = f"bench-direct-{os.getpid()}-{self.calls}"
        return "".join(r.text for r in self.stub.Generate(self.request, timeout=60))

    def close(self) -> None:
        self.channel.close()


def _timed(call: Callable[[], object]) -> float:
    t0 = time.perf_counter_ns()
    call()
    return (time.perf_counter_ns() - t0) / 1e6


def lockstep_pairs(
    gateway: Callable[[], object], direct: Callable[[], object], n: int
) -> tuple[list[float], list[float]]:
    """``n`` pairs of latencies in ms, the path that goes first alternating."""
    gw_ms, direct_ms = [], []
    for i in range(n):
        if i % 2 == 0:
            g = _timed(gateway)
            d = _timed(direct)
        else:
            d = _timed(direct)
            g = _timed(gateway)
        gw_ms.append(g)
        direct_ms.append(d)
    return gw_ms, direct_ms


# --- statistics -------------------------------------------------------------------------------
def summary(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    out = {f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}
    out["mean"] = float(a.mean())
    out["n"] = len(ms)
    return out


def measured(gw_ms: list[float], direct_ms: list[float]) -> dict[str, dict[str, float]]:
    overhead = [g - d for g, d in zip(gw_ms, direct_ms, strict=True)]
    return {
        "gateway_ms": summary(gw_ms),
        "direct_ms": summary(direct_ms),
        "overhead_ms": summary(overhead),
    }


def _first_text(sse_or_json: bytes, stream: bool) -> str:
    if not stream:
        return str(json.loads(sse_or_json)["choices"][0]["message"]["content"])
    text = []
    for frame in sse_or_json.decode().split("\n\n"):
        payload = frame.removeprefix("data: ")
        if frame.startswith("data: ") and payload != "[DONE]":
            for choice in json.loads(payload)["choices"]:
                text.append(choice["delta"].get("content", ""))
    return "".join(text)


def run_variant(args: argparse.Namespace, s: Stack, request: worker_pb2.GenerateRequest,
                stream: bool) -> dict[str, Any]:  # fmt: skip
    gateway = GatewayPath(s.gateway_port, chat_body(args, stream))
    direct = DirectPath(s.worker, request)
    try:
        # The same greedy token either way: the two paths run the same request.
        same = _first_text(gateway(), stream) == direct()
        repeats = []
        gw_all: list[float] = []
        direct_all: list[float] = []
        for _ in range(args.repeats):
            lockstep_pairs(gateway, direct, args.warmup)
            gw_ms, direct_ms = lockstep_pairs(gateway, direct, args.requests)
            repeats.append(measured(gw_ms, direct_ms))
            gw_all += gw_ms
            direct_all += direct_ms
    finally:
        gateway.close()
        direct.close()
    p50s = [r["overhead_ms"]["p50"] for r in repeats]
    return {
        "same_output": same,
        "repeats": repeats,
        "pooled": measured(gw_all, direct_all),
        "overhead_p50_spread_ms": {
            "min": min(p50s),
            "max": max(p50s),
            "range": max(p50s) - min(p50s),
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Starts the stack, measures each variant, stops the stack; returns the result."""
    provenance.include_modules(provenance.STACK_MODULES)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    started = time.time()
    with contextlib.ExitStack() as cleanup:
        log_dir = args.log_dir or Path(cleanup.enter_context(tempfile.TemporaryDirectory()))
        log_dir.mkdir(parents=True, exist_ok=True)
        s = cleanup.enter_context(stack(args.model, args.device, log_dir))
        with grpc.insecure_channel(s.worker) as ch:
            info = worker_pb2_grpc.WorkerStub(ch).GetModelInfo(worker_pb2.ModelInfoRequest())
        request = direct_request(args, info)
        results = {v: run_variant(args, s, request, v == "stream") for v in variants}
    overhead_p50 = {v: r["pooled"]["overhead_ms"]["p50"] for v, r in results.items()}
    return {
        "benchmark": "gateway_overhead",
        "config": {
            "requests": args.requests,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "model": args.model,
            "device": args.device,
            "endpoint": "/v1/chat/completions",
            "prompt": args.prompt,
            "prompt_tokens": len(request.prompt_token_ids),
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "http_client": "http.client, one keep-alive connection",
            "grpc_client": "worker_pb2_grpc.WorkerStub (sync), one channel",
            "cpus": os.cpu_count(),
        },
        "variants": results,
        "goal_p50_ms": GOAL_P50_MS,
        "meets_goal": all(p50 <= GOAL_P50_MS for p50 in overhead_p50.values()),
        "elapsed_s": time.time() - started,
    }
