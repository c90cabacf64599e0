"""One stream through the real stack as ``make run`` starts it (``python -m bench cpu-stream``):
kv-host-store, worker and gateway as processes, the worker with ``dhisparse up``'s defaults on
a CPU (the shipped model, adaptive mode with durable sessions, its MTP layer drafting at K_max 4
with the online width policy, a 256 MiB pool, 1 GiB host arena), beside the same stack with
plain decoding, in lockstep (run i of each variant back to back).

    python -m bench cpu-stream --out docs/results/cpu_stream.json

Each request is ``/v1/completions`` streamed, its prompt ``--prompt-len`` ids of the held-out
files (``bench/heldout.py``, a different window per run), ``--new-tokens`` generated with
``ignore_eos``, greedy. Reported per run: end-to-end tokens/s (new tokens over the request's
wall time), decode tokens/s (after the first token) and time to first token; the variant's
figure is the median of ``--runs``."""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.heldout import heldout_prompts
from bench.serving.stack import Stack
from dhisparse.up import DEFAULT_DRAFTER
from services.worker.engine.config import EngineConfig
from services.worker.speculative.config import SpeculationConfig

MODEL = "models/glm-dsa-mini"
MAKE_RUN = "make run"


def make_run_config(model: str, drafter: str | None) -> EngineConfig:
    """The engine ``dhisparse up`` starts on a CPU (``up.worker_argv``), ``drafter`` or plain."""
    spec = SpeculationConfig(drafter, 4, "online") if drafter else SpeculationConfig()
    return EngineConfig(
        model=model, device="cpu", mode="adaptive", kv_pool_mib=256.0, max_model_len=4096,
        speculation=spec,
    )  # fmt: skip


def one_request(base: str, model: str, prompt: list[int], new_tokens: int) -> dict:
    body = {
        "model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0,
        "stream": True, "ignore_eos": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    first = None
    chunks = 0
    with httpx.Client(timeout=600) as c, c.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                chunks += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    assert first is not None, "no tokens came back"
    return {
        "wall_s": end - t0,
        "ttft_s": first - t0,
        "tokens_per_s": new_tokens / (end - t0),
        "decode_tokens_per_s": (new_tokens - 1) / max(end - first, 1e-9),
        "chunks": chunks,
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--drafter", default=DEFAULT_DRAFTER, help="make run's (its default)")
    ap.add_argument("--also", default="", help="drafters to run beside it (comma-separated)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", default="docs/results/cpu_stream.json")


def run(args: argparse.Namespace) -> dict:
    prompts = heldout_prompts(args.model, args.runs + 1, args.prompt_len, args.seed)
    variants = {MAKE_RUN: None if args.drafter == "none" else args.drafter,
                "plain decoding": None}  # fmt: skip
    variants |= {f"drafter {d}": d for d in args.also.split(",") if d}
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    name = Path(args.model).name
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as up:
        stacks = {
            v: up.enter_context(Stack(make_run_config(args.model, d), args.model, 1 << 30, logs))
            for v, d in variants.items()
        }
        for s in stacks.values():  # warm-up: the first request compiles and maps
            one_request(s.base, name, prompts[-1], 8)
        for i in range(args.runs):
            for v, s in stacks.items():
                row = one_request(s.base, name, prompts[i], args.new_tokens)
                rows[v].append(row)
                print(v, json.dumps(row), flush=True)
    summary = {
        v: {
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "median_decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in rs),
            "median_ttft_s": statistics.median(r["ttft_s"] for r in rs),
            "spread_tokens_per_s": [min(r["tokens_per_s"] for r in rs),
                                    max(r["tokens_per_s"] for r in rs)],
        }
        for v, rs in rows.items()
    }  # fmt: skip
    for v, s in summary.items():
        print(f"{v}: {s['median_tokens_per_s']:.1f} tok/s end to end, "
              f"{s['median_decode_tokens_per_s']:.1f} decoding, TTFT {s['median_ttft_s']:.2f} s")  # fmt: skip
    return {
        "benchmark": "cpu-stream",
        "machine": platform.machine(),
        "model": args.model,
        "drafter": args.drafter,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "goal_tokens_per_s": 20.0,
        "meets_goal": summary[MAKE_RUN]["median_tokens_per_s"] >= 20.0,
        "summary": summary,
        "per_run": rows,
    }
