"""``python -m bench burst``: a burst of concurrent completions against ``make run``'s defaults.

    python -m bench burst --out docs/results/burst.json

Starts ``dhisparse up`` with no serving flags (``bench/core/up.py``), sends one untimed request
(kernels compile), then ``--requests`` completions of ``--max-tokens`` tokens at once (README's
completion prompt, greedy, end of sequence ignored so every served request computes the same
tokens). Each is either served or refused; the gateway refuses at once, with 429 and
``Retry-After`` from its measured service rate, what cannot be served within its queue
deadline. Records, per request, its status, latency and ``Retry-After``; in sum the requests
served and refused, the rate served (requests and tokens per second, from the burst's start to
the last one served), how long refusals took (the longest: none waits out the deadline to be
told no) and any other status (a 503 is one that waited out its deadline). Exit status 1 when a
request got a status other than 200 or 429."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.core import provenance
from bench.core.output import write_result
from bench.core.up import up_stack

# README's first completion example ("Try it")
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""'
MODEL = "glm-dsa-mini"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", type=int, default=120, help="completions sent at once")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--startup-s", type=float, default=600, help="for `up` to serve")
    ap.add_argument("--out", default="docs/results/burst.json")


def body(max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip


async def one(client: httpx.AsyncClient, base: str, payload: dict, t0: float) -> dict:
    """One request of the burst: status, seconds from the burst's start to its answer,
    ``Retry-After``, tokens."""
    r = await client.post(f"{base}/v1/completions", json=payload)
    done = time.perf_counter() - t0
    doc = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    retry = r.headers.get("retry-after")
    return {
        "status": r.status_code,
        "answered_s": round(done, 4),
        "retry_after_s": float(retry) if retry is not None else None,
        "completion_tokens": (doc.get("usage") or {}).get("completion_tokens"),
        "error": (doc.get("error") or {}).get("message") if r.status_code != 200 else None,
    }


async def burst(base: str, n: int, payload: dict) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await client.post(f"{base}/v1/completions", json=payload)  # untimed: kernels compile
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(client, base, payload, t0) for _ in range(n)))
    return list(got), t0


def summary(got: list[dict]) -> dict:
    served = [g for g in got if g["status"] == 200]
    refused = [g for g in got if g["status"] == 429]
    other = [g for g in got if g["status"] not in (200, 429)]
    span = max((g["answered_s"] for g in served), default=0.0)
    tokens = sum(g["completion_tokens"] or 0 for g in served)
    refusal_s = sorted(g["answered_s"] for g in refused)
    retry = [g["retry_after_s"] for g in refused if g["retry_after_s"] is not None]
    return {
        "served": len(served),
        "refused_429": len(refused),
        "other_statuses": sorted({g["status"] for g in other}),
        "other": len(other),
        "served_per_s": len(served) / span if span else None,
        "tokens_per_s": tokens / span if span else None,
        "served_last_s": span,
        "refusal_s": {
            "median": refusal_s[len(refusal_s) // 2] if refusal_s else None,
            "max": refusal_s[-1] if refusal_s else None,
        },
        "refusals_with_retry_after": len(retry),
        "retry_after_s": {"min": min(retry), "max": max(retry)} if retry else None,
    }


def run(args: argparse.Namespace) -> int:
    provenance.include_modules(provenance.STACK_MODULES)  # the code the stack's processes run
    payload = body(args.max_tokens)
    with (
        tempfile.TemporaryDirectory() as tmp,
        up_stack(Path(tmp) / "up.log", startup_s=args.startup_s) as stack,
    ):
        got, _ = asyncio.run(burst(stack.base, args.requests, payload))
    s = summary(got)
    doc = {
        "benchmark": "burst",
        "stack": "dhisparse up, no flags but free ports and a fresh arena path",
        "request": payload,
        "requests": args.requests,
        "summary": s,
        "results": got,
    }
    print(f"wrote {write_result(doc, args.out)}")
    rate = s["served_per_s"] or 0.0
    print(f"{s['served']} served ({rate:.2f} requests/s), {s['refused_429']} refused with 429 "
          f"(slowest refusal {s['refusal_s']['max']} s), {s['other']} other "
          f"{s['other_statuses']}")  # fmt: skip
    if s["other"]:
        print("some requests got neither 200 nor 429", file=sys.stderr)
        return 1
    return 0
