"""End to end, real processes (``dhisparse up --tensor-parallel-size 2``, CPU, gloo): a rank of
a worker's group SIGKILLed mid-stream loses no session — the supervisor stops the group, ``up``
restarts it, the new group resumes the session from the node's host store without recomputing
the prompt, and the client's stream completes with exactly the text of an uninterrupted run.
Tensor parallel: rank 0 resumes it (both ranks read one set of regions, rank 0 writing them).
Data-parallel attention: each rank resumes its own sessions (its own owner at the store), and
rank 0 streams every rank's to the re-attaching gateway. A tensor-parallel group's next turn
imports the pages the turn before left in the store."""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from dhisparse import metrics as names
from tests.e2e.test_durability import stream_sse, up_stack

PROMPT = "def merge_sorted(a, b):\n    out = []\n"
LONG = 160  # tokens: the kill lands well inside the stream
# fast leases and health polls, a resume deadline past a group's restart, one thread per rank
ENV = {
    "DHISPARSE_WORKER_LEASE_TTL_S": "1.5",
    "DHISPARSE_GATEWAY_RESUME_DEADLINE_S": "90",
    "DHISPARSE_GATEWAY_HEALTH_INTERVAL_S": "0.25",
    "OMP_NUM_THREADS": "1",
}
GROUP = ("--model", "tiny-glm", "--device", "cpu", "--kv-pool-mib", "48", "--max-model-len",
         "1024", "--mode", "hisparse", "--drafter", "none", "--tensor-parallel-size", "2")  # fmt: skip


def stream_completion(
    base: str, max_tokens: int, on_chunk=None, prompt: str = PROMPT
) -> tuple[str, list[dict]]:
    body = {"model": "tiny-glm", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    chunks = stream_sse(f"{base}/v1/completions", body, on_chunk)
    text = "".join(c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))
    return text, chunks


def _rank_pids(log: Path, rank: int) -> list[int]:
    return [int(p) for p in re.findall(rf"rank {rank} pid (\d+)", log.read_text())]


def test_a_rank_killed_mid_stream_the_group_restarts_and_the_stream_completes(
    tmp_path: Path,
) -> None:
    log = tmp_path / "up.log"
    with up_stack(log, *GROUP, env=ENV) as st:
        want, _ = stream_completion(st.base, LONG)  # uninterrupted
        (follower,) = _rank_pids(log, 1)
        killed: list[int] = []

        def kill_once(n: int) -> None:
            if n == 40 and not killed:
                os.kill(follower, signal.SIGKILL)
                killed.append(follower)

        text, chunks = stream_completion(st.base, LONG, kill_once)
        assert killed, "the stream ended before the kill"
        assert not [c for c in chunks if "error" in c], chunks[-3:]
        assert text == want  # token for token what the uninterrupted run gave
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len(st.pids("worker-0")) == 2  # `up` restarted the group
        assert len(_rank_pids(log, 1)) == 2
        assert re.search(r"rank 1 \(pid \d+\) exited with status -9", log.read_text())
        assert st.metric(st.worker_metrics, "dhisparse:sessions_resumed_total") == 1
        # the new group computed no prompt: it resumed from the host backups
        assert st.metric(st.worker_metrics, "dhisparse:prefill_tokens_computed_total") == 0

        # A next turn: the new group imports the pages the turn before left in the node's
        # store, rank 0 asking the store and copying them, both ranks seating them.
        history = PROMPT * 12
        first = _complete(st.base, history)
        usage = _complete(st.base, history + "    return out\n")
        # (the first already finds the pages of PROMPT's turns)
        hits = [u["prompt_tokens_details"]["cached_tokens"] for u in (first, usage)]
        assert hits[0] > 0 and hits[1] == first["prompt_tokens"] // 16 * 16, (first, usage)
        assert st.metric(st.worker_metrics, f"{names.PREFIX_CACHE_HITS}_total") == 2
        computed = st.metric(st.worker_metrics, "dhisparse:prefill_tokens_computed_total")
        assert computed == first["prompt_tokens"] + usage["prompt_tokens"] - sum(hits)


def _complete(base: str, prompt: str) -> dict:
    """The usage of a greedy completion of 8 tokens of ``prompt``."""
    body = {"model": "tiny-glm", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


SECOND = "class Heap:\n    def __init__(self):\n"


def _both(base: str, max_tokens: int, on_chunk=None) -> list[tuple[str, list[dict]]]:
    """Two concurrent streams (``PROMPT``'s with ``on_chunk``, then ``SECOND``'s): a
    data-parallel group places them on different ranks."""
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(stream_completion, base, max_tokens, on_chunk)
        second = pool.submit(stream_completion, base, max_tokens, None, SECOND)
        return [first.result(), second.result()]


def test_data_parallel_ranks_killed_mid_stream_each_resume_their_own_sessions(
    tmp_path: Path,
) -> None:
    """Two streams, one on each rank; rank 1 SIGKILLed mid-stream, then (in the restarted
    group) rank 0: each time both streams complete with the uninterrupted text, each rank
    having resumed its own session and computed no prompt."""
    log = tmp_path / "up.log"
    flags = (*GROUP, "--data-parallel-attention", "--expert-parallel")
    n = 120
    with up_stack(log, *flags, env=ENV) as st:
        want = [text for text, _ in _both(st.base, n)]  # uninterrupted
        for rank, groups in ((1, 2), (0, 3)):
            victim = _rank_pids(log, rank)[-1]
            killed: list[int] = []

            def kill_once(k: int, victim: int = victim, killed: list[int] = killed) -> None:
                if k == 30 and not killed:
                    os.kill(victim, signal.SIGKILL)
                    killed.append(victim)

            got = _both(st.base, n, kill_once)
            assert killed, "the stream ended before the kill"
            for (text, chunks), expected in zip(got, want, strict=True):
                assert not [c for c in chunks if "error" in c], chunks[-3:]
                assert text == expected  # token for token what the uninterrupted run gave
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert len(st.pids("worker-0")) == groups  # `up` restarted the group
            assert re.search(
                rf"rank {rank} \(pid {victim}\) exited with status -9", log.read_text()
            )
            # the new group: each rank resumed its own session (the gateway's leases put one
            # stream on each rank), and no rank computed a prompt
            resumed = re.findall(r"rank (\d) \S+adoption: resumed", log.read_text())
            assert sorted(resumed[-2:]) == ["0", "1"] and len(resumed) == 2 * (groups - 1)
            assert st.metric(st.worker_metrics, "dhisparse:sessions_resumed_total") == 2
            assert st.metric(st.worker_metrics, "dhisparse:prefill_tokens_computed_total") == 0


def test_a_drained_data_parallel_group_hands_every_ranks_streams_to_a_peer_group(
    tmp_path: Path,
) -> None:
    """Two workers, each a data-parallel-attention group of two ranks, on one node store; four
    streams, then worker 0's group is told to stop (SIGTERM: a rolling update): its ranks each
    release their own sessions and the peer group adopts every stream of both, each on a rank
    where its lease holds room. Every stream completes with the uninterrupted text; none waits
    for a restart."""
    log = tmp_path / "up.log"
    flags = (*GROUP, "--data-parallel-attention", "--workers", "2")
    env = {**ENV, "DHISPARSE_WORKER_LEASE_TTL_S": "30"}  # only a release frees a session at once
    with up_stack(log, *flags, env=env) as st:
        want, _ = stream_completion(st.base, LONG)
        drained: list[int] = []

        def drain_once(n: int) -> None:
            if n == 30 and not drained:
                os.kill(st.pids("worker-0")[-1], signal.SIGTERM)
                drained.append(0)

        with ThreadPoolExecutor(4) as pool:
            futures = [
                pool.submit(stream_completion, st.base, LONG, drain_once if i == 0 else None)
                for i in range(4)
            ]
            results = [f.result(timeout=600) for f in futures]
        assert drained, "the streams ended before the drain"
        for text, chunks in results:
            assert not [c for c in chunks if "error" in c], chunks[-3:]
            assert text == want
        gateway = f"{st.base}/metrics"
        adopted = st.metric(gateway, f"{names.ADOPTIONS}_total", outcome="adopted") or 0
        waited = st.metric(gateway, f"{names.ADOPTIONS}_total", outcome="no_peer") or 0
        assert adopted >= 1 and waited == 0, log.read_text()[-4000:]
        print(f"drained group: {adopted:.0f} streams adopted by the peer group")
        moved = [line for line in log.read_text().splitlines() if "adopted from" in line]
        assert len(moved) == adopted and all("adopted from worker-0/dp" in m for m in moved)
        print("\n".join(moved))
