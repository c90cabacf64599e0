"""``python -m bench adoption``: a live peer adopts a SIGKILLed worker's streams (issue 46), end
to end, as a result.

    python -m bench adoption --out docs/results/adoption.json

Starts ``dhisparse up --workers 2`` (a host store, a gateway, two workers; ``--device`` names
one device for both, as two workers share one GPU; ``--kv-pool-mib`` each worker's pool, large
enough that the peer has room for the victim's streams) with its serving defaults otherwise and
the prefix cache off (an imported prefix is computed in passes of other sizes, which on a GPU
rounds otherwise: the texts compared here would differ for that reason, not adoption's).
Streams ``--streams`` greedy chat completions of distinct prompts at once: first untimed on
both workers (kernels compile, graphs capture), then whole (the texts to compare with), then
``--kills`` times with the worker running the most of them SIGKILLed once stream 0 has
``--kill-at`` of its chunks and every stream its first. ``up`` restarts the killed worker; the
next trial waits until its successor serves and the gateway reports both healthy. Per kill it
records each stream's longest wait for a chunk from the kill on (``delays``: the stall of the
streams the victim held; the others' is a usual chunk gap, also recorded), whether every text equals the whole run's, the gateway's adoptions by outcome and
adoption latency (break to the peer's first token), and the prompt tokens the peer computed
after the kill (an adoption computes none). The result is written whatever the outcome; the
exit status is 1 when a stream fails or fewer kills landed than asked."""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.core import provenance
from bench.core.output import write_result
from bench.core.up import UpStack, up_stack
from bench.defaults import stream
from dhisparse import metrics as m

WORKERS = 2
READY_S = 300  # for a killed worker's successor to serve again
LOG_TAIL = 200  # lines of the stack's log the result keeps


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--streams", type=int, default=4, help="concurrent streams per trial")
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--kill-at", type=float, default=0.3,
                    help="where in stream 0, as a share of its whole run's chunks")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--device", default=None,
                    help="both workers' device (one GPU: cuda:0); default: up's")  # fmt: skip
    # up's CPU default (256 MiB) admits two sessions a worker: a peer would have no room
    ap.add_argument("--kv-pool-mib", type=float, default=1024, help="each worker's")
    ap.add_argument("--startup-s", type=float, default=600, help="for `up` to serve")
    ap.add_argument("--out", default="docs/results/adoption.json")


def body(i: int, max_tokens: int) -> dict:
    """Stream ``i``'s request: greedy, its own prompt, usage asked for."""
    return {
        "model": "glm-dsa-mini", "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"Tell me a story about lighthouse {i}."}],
    }  # fmt: skip


def worker_metrics(stack: UpStack, index: int) -> str:
    """Worker ``index``'s metrics URL (``up`` gives worker i worker 0's port + 10 i)."""
    base, port = stack.worker_metrics.rsplit(":", 1)
    return f"{base}:{int(port.split('/')[0]) + 10 * index}/metrics"


def sample(stack: UpStack, url: str, name: str, **labels: str) -> float:
    """A counter or gauge's value, 0 where the process or the sample is absent."""
    try:
        return stack.metric(url, name, **labels) or 0.0
    except httpx.HTTPError:
        return 0.0


def serving(stack: UpStack, index: int, dead: set[int]) -> bool:
    """Whether the last process ``up`` started as worker ``index`` serves (its start-up line)
    and is not one of the ``dead`` (killed before: ``up`` may not have noticed yet, and the
    gateway lists a killed worker healthy until its polls have missed a few times)."""
    pids = stack.pids(f"worker-{index}")
    said = len(
        re.findall(rf"worker worker-{index} serving ", stack.log.read_text(errors="replace"))
    )
    return bool(pids) and pids[-1] not in dead and said >= len(pids)


def wait_healthy(stack: UpStack, dead: set[int], timeout_s: float = READY_S) -> float:
    """Seconds until every worker's last process serves, none of them one of the ``dead``, and
    the gateway's ``/health`` lists every worker healthy."""
    t0 = time.monotonic()
    while True:
        try:
            workers = httpx.get(f"{stack.base}/health", timeout=2).json().get("workers", {})
            up = all(serving(stack, i, dead) for i in range(WORKERS))
            if up and len(workers) >= WORKERS and set(workers.values()) == {"healthy"}:
                return time.monotonic() - t0
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"the workers were not healthy in {timeout_s:.0f} s")
        time.sleep(0.2)


def streams(
    stack: UpStack, n: int, max_tokens: int, on_chunk: Callable[[int, int], None] | None = None
) -> list[dict]:
    """``n`` streams at once; ``on_chunk(i, c)`` follows stream ``i``'s ``c``-th chunk."""
    with ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(stream, stack.base, body(i, max_tokens),
                            None if on_chunk is None else functools.partial(on_chunk, i))
                for i in range(n)]  # fmt: skip
        return [f.result() for f in futs]


class Killer:
    """An ``on_chunk`` for every stream: once stream 0 has ``at`` chunks and every stream its
    first (no stream is still waiting to be admitted or prefilled: a kill then only moves
    sessions that hold tokens), SIGKILLs the worker running the most requests (its newest
    PID) and adds it to ``dead``; records when (the monotonic clock), whom, and the peer's
    counters then."""

    def __init__(self, stack: UpStack, at: int, n: int, dead: set[int]) -> None:
        self.stack, self.at, self.dead = stack, at, dead
        self.started = [False] * n
        self.lead = 0  # stream 0's chunks so far
        self.kill: dict | None = None
        self.lock = threading.Lock()

    def __call__(self, i: int, c: int) -> None:
        with self.lock:
            self.started[i] = True
            self.lead = c if i == 0 else self.lead
            if self.kill is not None or self.lead < self.at or not all(self.started):
                return
            running = [sample(self.stack, worker_metrics(self.stack, w), m.NUM_REQUESTS_RUNNING)
                       for w in range(WORKERS)]  # fmt: skip
            victim = max(range(WORKERS), key=lambda w: running[w])
            pid = self.stack.pids(f"worker-{victim}")[-1]
            peer = worker_metrics(self.stack, 1 - victim)
            computed = sample(self.stack, peer, f"{m.PREFILL_TOKENS_COMPUTED}_total")
            os.kill(pid, signal.SIGKILL)
            self.dead.add(pid)
            self.kill = {"at": time.monotonic(), "victim": victim, "pid": pid,
                         "after_chunk": self.lead, "running": running,
                         "peer_computed_before": computed}  # fmt: skip


def gateway_counts(stack: UpStack) -> dict:
    """The gateway's adoption counters and latency histogram's sum and count."""
    url = f"{stack.base}/metrics"
    return {
        "adopted": sample(stack, url, f"{m.ADOPTIONS}_total", outcome="adopted"),
        "no_peer": sample(stack, url, f"{m.ADOPTIONS}_total", outcome="no_peer"),
        "resumed": sample(stack, url, f"{m.STREAMS_RESUMED}_total", outcome="resumed"),
        "latency_sum": sample(stack, url, f"{m.ADOPTION_LATENCY}_sum"),
        "latency_count": sample(stack, url, f"{m.ADOPTION_LATENCY}_count"),
    }


def delays(outs: list[dict], kill_at: float) -> list[float | None]:
    """Per stream, the longest wait for a chunk from the kill on: from the kill to its next
    chunk, or between two chunks after it (None: it had ended). Chunks the victim sent before
    it died may still arrive after the kill (buffered on the way), so the stall of a stream
    it held is the gap after them, not the wait for the first chunk."""
    out = []
    for o in outs:
        at = kill_at - o["started"]
        after = [t for t in o["chunk_times_s"] if t > at]
        gaps = [b - a for a, b in itertools.pairwise([at, *after])]
        out.append(max(gaps) if gaps else None)
    return out


def usual_gap(outs: list[dict]) -> float:
    """The median gap between consecutive chunks of the whole run's streams."""
    gaps = [b - a for o in outs for a, b in itertools.pairwise(o["chunk_times_s"])]
    return statistics.median(gaps) if gaps else 0.0


def trial(
    stack: UpStack, args: argparse.Namespace, at: int, want: list[str], dead: set[int]
) -> dict:
    ready = wait_healthy(stack, dead)
    before = gateway_counts(stack)
    killer = Killer(stack, at, args.streams, dead)
    try:
        outs = streams(stack, args.streams, args.max_tokens, killer)
    except (RuntimeError, TimeoutError, httpx.HTTPError) as e:  # recorded, not raised
        return {"error": f"{type(e).__name__}: {e}", "killed": killer.kill is not None,
                "ready_wait_s": ready}  # fmt: skip
    kill = killer.kill
    after = gateway_counts(stack)
    counts = {k: after[k] - before[k] for k in after}
    if kill is None:
        return {"killed": False, "ready_wait_s": ready}
    peer = worker_metrics(stack, 1 - kill["victim"])
    computed = sample(stack, peer, f"{m.PREFILL_TOKENS_COMPUTED}_total")
    delay = delays(outs, kill.pop("at"))
    return {
        "ready_wait_s": ready, "killed": True, **kill,
        "delays_s": delay, "stall_s": max((d for d in delay if d is not None), default=None),
        "texts_identical": [o["text"] == w for o, w in zip(outs, want, strict=True)],
        "adoptions": {k: counts[k] for k in ("adopted", "no_peer", "resumed")},
        "adoption_latency_mean_s": counts["latency_sum"] / counts["latency_count"]
        if counts["latency_count"] else None,
        "peer_prompt_tokens_computed": computed - kill.pop("peer_computed_before"),
        "completion_tokens": [o["completion_tokens"] for o in outs],
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    provenance.include_modules(provenance.STACK_MODULES)  # the code the stack's processes run
    flags = ["--workers", str(WORKERS)]
    if args.device:
        flags += ["--device", args.device]
    flags += ["--kv-pool-mib", f"{args.kv_pool_mib:g}"]
    env = {"DHISPARSE_WORKER_PREFIX_CACHE": "false"}
    with (
        tempfile.TemporaryDirectory() as tmp,
        up_stack(Path(tmp) / "up.log", *flags, env=env, startup_s=args.startup_s) as stack,
    ):
        dead: set[int] = set()  # the PIDs killed so far
        wait_healthy(stack, dead)
        streams(stack, 2 * args.streams, args.max_tokens)  # both workers warm: not timed
        whole = streams(stack, args.streams, args.max_tokens)
        want = [o["text"] for o in whole]
        at = max(1, round(whole[0]["chunks"] * args.kill_at))
        trials = [trial(stack, args, at, want, dead) for _ in range(args.kills)]
        log_tail = stack.log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
    landed = [t for t in trials if t.get("killed") and "error" not in t]
    stalls = [t["stall_s"] for t in landed if t["stall_s"] is not None]
    doc = {
        "benchmark": "adoption",
        "stack": f"dhisparse up {' '.join(flags)}, the prefix cache off",
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "kills_asked": args.kills,
        "kills": len(landed),
        "kill_after_chunk": at,
        "usual_chunk_gap_s": usual_gap(whole),
        "whole_tokens_per_s": [o["tokens_per_s"] for o in whole],
        "stalls_s": stalls,
        "texts_identical": all(all(t["texts_identical"]) for t in landed),
        "adopted": sum(t["adoptions"]["adopted"] for t in landed),
        "peer_prompt_tokens_computed": sum(t["peer_prompt_tokens_computed"] for t in landed),
        "trials": trials,
        "log_tail": log_tail,
    }
    print(f"wrote {write_result(doc, args.out)}")
    print(f"{len(landed)} kills of {args.kills}; stalls {[round(s, 3) for s in stalls]} s "
          f"(usual chunk gap {doc['usual_chunk_gap_s'] * 1e3:.1f} ms); adopted "
          f"{doc['adopted']:.0f}; prompt tokens the peer computed "
          f"{doc['peer_prompt_tokens_computed']:.0f}; texts identical: "
          f"{doc['texts_identical']}")  # fmt: skip
    if len(landed) < args.kills:
        print("fewer kills landed than asked, or a stream failed", file=sys.stderr)
        return 1
    return 0
