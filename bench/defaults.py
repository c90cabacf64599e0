"""``python -m bench defaults``: ``make run``'s defaults end to end, as a result.

    python -m bench defaults --out docs/results/defaults.json

Starts ``dhisparse up`` with no serving flags (free ports and a fresh arena path only:
``bench/core/up.py``), reads what the worker chose (``dhisparse:worker_config_info``: device,
mode, CUDA graphs, drafter, durable sessions; its KV pool from the flag ``up`` gave it, the
``dhisparse:kv_pool_bytes`` classes and the start-up lines that name it), then streams README's
chat example (``REQUEST``, greedy) through the gateway: once whole (after one untimed request:
the first compiles kernels and captures graphs), then ``--kills`` times with worker 0 SIGKILLed
mid-stream, after the chunk ``--kill-at`` of the way through the whole run's chunks. ``up``
restarts the worker each time and the new process resumes the session from the host store.
Records the whole run's text and tokens/s and, per kill, whether the text is identical, the
stall (seconds from the kill to the next chunk), and the sessions the new worker resumed and
the prompt tokens it computed; the ``DHISPARSE_*`` variables set. The result is written
whatever the outcome; the exit status is 1 when a text differs or fewer kills landed than
asked."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.core import provenance
from bench.core.output import write_result
from bench.core.up import UpStack, up_stack
from dhisparse import metrics as m

# README's chat example ("Try it"); usage asked for, so the tokens are counted
REQUEST = {
    "model": "glm-dsa-mini", "max_tokens": 32, "temperature": 0, "stream": True,
    "messages": [{"role": "user", "content": "Hello!"}],
}  # fmt: skip
POOL_CLASSES = ("required", "optional", "reserve", "free")
# what the worker chose, of its ``worker_config_info`` labels
CHOSEN = ("device", "mode", "cuda_graphs", "graphs_off_reason", "drafter", "durable_sessions",
          "kv_cache_dtype")  # fmt: skip
PID_WAIT_S = 300  # for `up` to start the next worker when a kill lands before it has


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--kills", type=int, default=3, help="streams, each with its worker killed")
    ap.add_argument("--kill-at", type=float, default=0.25,
                    help="where in the stream, as a share of the whole run's chunks")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=REQUEST["max_tokens"])
    ap.add_argument("--startup-s", type=float, default=600, help="for `up` to serve")
    ap.add_argument("--out", default="docs/results/defaults.json")


def stream(base: str, body: dict, on_chunk: Callable[[int], None] | None = None) -> dict:
    """One streamed chat completion: its text, content chunks, arrival time of each (from
    the request's start, ``started``: the monotonic clock then), completion tokens (from
    usage) and wall time."""
    t0 = time.monotonic()
    text, times, usage, finish = "", [], None, None
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:2000]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
                content = choice["delta"].get("content")
                if content:
                    text += content
                    times.append(time.monotonic() - t0)
                    if on_chunk is not None:
                        on_chunk(len(times))
    wall = time.monotonic() - t0
    tokens = usage["completion_tokens"] if usage else None
    return {
        "text": text, "started": t0, "chunks": len(times), "completion_tokens": tokens,
        "finish_reason": finish,
        "wall_s": wall, "ttft_s": times[0] if times else None, "chunk_times_s": times,
        "tokens_per_s": tokens / wall if tokens else None,
        "decode_tokens_per_s": (tokens - 1) / (wall - times[0])
        if tokens and tokens > 1 and wall > times[0] else None,
    }  # fmt: skip


class Killer:
    """An ``on_chunk`` that SIGKILLs the newest worker 0 once, after content chunk ``at``,
    waiting for ``up`` to have started one not in ``dead`` (killed before); records when (the
    monotonic clock) and whom."""

    def __init__(self, stack: UpStack, at: int, dead: set[int]) -> None:
        self.stack, self.at, self.dead = stack, at, dead
        self.kill: dict | None = None

    def __call__(self, n: int) -> None:
        if n != self.at or self.kill is not None:
            return
        deadline = time.monotonic() + PID_WAIT_S
        while (pid := self.stack.pids("worker-0")[-1]) in self.dead:
            if time.monotonic() > deadline:
                raise TimeoutError("up started no new worker after a kill")
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        self.dead.add(pid)
        self.kill = {"after_chunk": n, "pid": pid, "at": time.monotonic()}


def wait_listed(base: str, model: str, timeout_s: float = PID_WAIT_S) -> float:
    """Seconds until the gateway lists ``model`` again (it lists no model while its worker is
    unhealthy, as after a kill); raises ``TimeoutError`` past ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(httpx.HTTPError):
            listed = httpx.get(f"{base}/v1/models", timeout=5).json().get("data", [])
            if any(d.get("id") == model for d in listed):
                return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"the gateway did not list {model} in {timeout_s:.0f} s")
        time.sleep(0.2)


def trial(stack: UpStack, body: dict, at: int, want: str, dead: set[int]) -> dict:
    """One stream with worker 0 SIGKILLed after content chunk ``at``, once the gateway lists
    the model again (``ready_wait_s``): whether the kill landed, the stall (seconds from the
    kill to the next chunk; None: the stream ended first), whether the text is ``want``; the
    restarted worker's sessions resumed and prompt tokens computed."""
    ready = wait_listed(stack.base, body["model"])
    killer = Killer(stack, at, dead)
    try:
        out = stream(stack.base, body, killer)
    except (RuntimeError, TimeoutError, httpx.HTTPError) as e:  # recorded, not raised
        return {"error": f"{type(e).__name__}: {e}", "killed": killer.kill is not None,
                "text_identical": False, "stall_s": None, "ready_wait_s": ready}  # fmt: skip
    kill = killer.kill
    stall = None
    if kill is not None:
        at_s = kill.pop("at") - out["started"]
        kill["at_s"] = at_s
        stall = next((t - at_s for t in out["chunk_times_s"] if t > at_s), None)
    return {
        "ready_wait_s": ready, "killed": kill is not None, **(kill or {}), "stall_s": stall,
        "text_identical": out["text"] == want, "text": out["text"],
        **{k: out[k] for k in ("chunks", "completion_tokens", "finish_reason", "wall_s",
                               "tokens_per_s")},
        "sessions_resumed": stack.metric(stack.worker_metrics, f"{m.SESSIONS_RESUMED}_total"),
        "prefill_tokens_computed": stack.metric(
            stack.worker_metrics, f"{m.PREFILL_TOKENS_COMPUTED}_total"
        ),
    }  # fmt: skip


def kv_pool(stack: UpStack) -> dict:
    """What worker 0's KV pool is: the flag ``up`` gave it, its bytes by class, the start-up
    lines that name it."""
    argv = stack.argv("worker-0")
    flag = argv[argv.index("--kv-pool-mib") + 1] if "--kv-pool-mib" in argv else None
    by_class = {c: stack.metric(stack.worker_metrics, m.KV_POOL_BYTES, **{"class": c})
                for c in POOL_CLASSES}  # fmt: skip
    known = [v for v in by_class.values() if v is not None]
    lines = [ln.strip() for ln in stack.log.read_text().splitlines()
             if re.search(r"(?i)kv[ _-]?pool", ln) and not ln.startswith("[up] worker-")
             ]  # fmt: skip
    return {
        "kv_pool_mib_flag": flag, "bytes": sum(known) if known else None,
        "bytes_by_class": by_class, "startup_lines": lines[:5],
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    provenance.include_modules(provenance.STACK_MODULES)  # the code the stack's processes run
    body = {**REQUEST, "max_tokens": args.max_tokens, "stream_options": {"include_usage": True}}
    with (
        tempfile.TemporaryDirectory() as tmp,
        up_stack(Path(tmp) / "up.log", startup_s=args.startup_s) as stack,
    ):
        first = stream(stack.base, body)  # kernels compile, graphs capture: not timed below
        config = stack.info(m.WORKER_CONFIG_INFO)
        pool = kv_pool(stack)  # sampled once a step ran
        whole = stream(stack.base, body)
        at = max(1, round(whole["chunks"] * args.kill_at))
        dead: set[int] = set()
        trials = [trial(stack, body, at, whole["text"], dead) for _ in range(args.kills)]
        workers = len(stack.pids("worker-0"))
        log_tail = stack.log.read_text().splitlines()[-40:]
    landed = [t for t in trials if t["killed"]]
    identical = all(t["text_identical"] for t in trials)
    doc = {
        "benchmark": "defaults",
        "stack": "dhisparse up, no flags but free ports and a fresh arena path",
        "environment": {k: v for k, v in os.environ.items() if k.startswith("DHISPARSE_")},
        **{k: config.get(k) for k in CHOSEN},
        "kv_pool": pool,
        "request": body,
        "kills_asked": args.kills,
        "kills": len(landed),
        "kill_after_chunk": at,
        "text_identical": identical,
        "stalls_s": [t["stall_s"] for t in landed],
        "tokens_per_s": whole["tokens_per_s"],
        "decode_tokens_per_s": whole["decode_tokens_per_s"],
        "first_request": {k: first[k] for k in ("wall_s", "ttft_s", "completion_tokens")},
        "whole": whole,
        "trials": trials,
        "workers_started": workers,
        "log_tail": log_tail,
    }
    print(f"wrote {write_result(doc, args.out)}")
    print(f"{config.get('device')}, {config.get('mode')}, graphs {config.get('cuda_graphs')}, "
          f"drafter {config.get('drafter')}, KV pool {pool['bytes']} B; text identical: "
          f"{identical} in {len(landed)} kills, stalls {doc['stalls_s']}")  # fmt: skip
    if not identical or len(landed) < args.kills:
        print("the text differs or fewer kills landed than asked", file=sys.stderr)
        return 1
    return 0
