"""The HTTP-level closed loop: C asyncio clients streaming ``/v1/completions`` from the gateway
(httpx), each keeping one request in flight. Token times come from the SSE stream: each request
asks for ``logprobs: 0`` so that every token arrives in a chunk that lists it, even one that is
not yet readable text. What the client cannot see (allocation wait, census, reclaims,
acceptance, generated tokens) comes from the gateway's and the worker's Prometheus metrics,
read at the window's edges. Sessions admitted is the larger of two lower bounds: the peak of
the worker's running gauge, sampled every 0.25 s, and the most streams between their first
and last token at once."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dhisparse import metrics as names

from .config import Load
from .loop import RequestRecord
from .summary import COMPLETE, request_counts, stats, tpot

Samples = dict[tuple[str, frozenset], float]


def samples_of(text: str) -> Samples:
    """Every sample of a Prometheus exposition ``text`` by (name, labels)."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


async def scrape(client: httpx.AsyncClient, url: str) -> Samples:
    return samples_of((await client.get(url)).text)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lb), v in samples.items() if n == name and want <= lb)


async def _request(http: httpx.AsyncClient, body: dict, rec: RequestRecord) -> None:
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            rec.error, rec.finish_reason = f"HTTP {r.status_code}: {await r.aread()!r}", "error"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.monotonic()
            if "error" in chunk:
                rec.error, rec.finish_reason = str(chunk["error"]), "error"
                return
            for ch in chunk.get("choices") or ():
                lp = ch.get("logprobs") or {}
                n = len(lp.get("tokens") or ())
                if n:
                    rec.first = rec.first or now
                    rec.last = now
                    rec.tokens += n
                if ch.get("finish_reason"):
                    rec.finish, rec.finish_reason = now, ch["finish_reason"]


async def http_closed_loop(
    base: str,
    worker_metrics: str,
    model: str,
    prefixes: list[list[int]],
    concurrency: int,
    load: Load,
    mode: str,
) -> dict:
    """Runs the closed loop against a serving stack; returns the run's metrics."""
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(None, connect=30.0)
    records: list[RequestRecord] = []
    t_start = time.monotonic()
    if load.duration_s is not None:
        w0, w1 = t_start + load.warmup_s, t_start + load.warmup_s + load.duration_s
    else:
        w0, w1 = t_start, float("inf")
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as http:
        gw0, wk0 = await scrape(http, base + "/metrics"), await scrape(http, worker_metrics)

        async def client(c: int) -> None:
            j = 0
            while (
                j < load.requests_per_client
                if load.requests_per_client is not None
                else time.monotonic() < w1
            ):
                prefix = (c + j * concurrency) % len(prefixes)
                rec = RequestRecord(c, j, prefix, time.monotonic())
                records.append(rec)
                body = {"model": model, "prompt": prefixes[prefix], "max_tokens": load.output_len,
                        "temperature": load.temperature, "ignore_eos": True, "stream": True,
                        "logprobs": 0, "seed": load.request_seed(c, j)}  # fmt: skip
                try:
                    await _request(http, body, rec)
                except httpx.HTTPError as e:  # recorded; the client goes on with its next
                    rec.error, rec.finish_reason = f"{type(e).__name__}: {e}", "error"
                j += 1

        peak = 0
        tasks = [asyncio.create_task(client(c)) for c in range(concurrency)]
        edge: tuple[Samples, Samples] | None = None
        while not all(t.done() for t in tasks):
            now = time.monotonic()
            if edge is None and now >= w0:
                edge = (await scrape(http, base + "/metrics"), await scrape(http, worker_metrics))
            if now >= w1:
                break
            wk = await scrape(http, worker_metrics)
            peak = max(peak, int(total(wk, names.NUM_REQUESTS_RUNNING)))
            await asyncio.sleep(0.25)
        w1 = min(w1, time.monotonic())
        gw1, wk1 = await scrape(http, base + "/metrics"), await scrape(http, worker_metrics)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:  # surface a client that failed rather than being cancelled
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    for r in records:
        if r.finish_reason is None:
            r.finish_reason = "end"
    gw0, wk0 = edge or (gw0, wk0)
    peak = max(peak, most_streaming(records))
    return summarize_http(records, (w0, w1), (gw0, gw1), (wk0, wk1), peak, load.output_len, mode)


def most_streaming(records: list[RequestRecord]) -> int:
    """The most requests between their first and last token at one time."""
    events = sorted(
        [(r.first, 1) for r in records if r.first is not None]
        + [(r.last, -1) for r in records if r.last is not None]
    )
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


def summarize_http(
    recs: list[RequestRecord],
    window: tuple[float, float],
    gw: tuple[Samples, Samples],
    wk: tuple[Samples, Samples],
    peak: int,
    output_len: int,
    mode: str,
) -> dict:
    w0, w1 = window
    span = max(w1 - w0, 1e-9)

    def delta(pair: tuple[Samples, Samples], name: str, **labels: str) -> float:
        return total(pair[1], name, **labels) - total(pair[0], name, **labels)

    started = [r for r in recs if r.first is not None and w0 < r.first <= w1]
    done = [r for r in recs if r.finish_reason in COMPLETE and r.finish and w0 < r.finish <= w1]
    ttfts = [r.first - r.arrival for r in started]  # type: ignore[operator]
    tokens = delta(wk, names.GENERATION_TOKENS + "_total")
    waits = delta(gw, names.ALLOCATION_WAIT + "_count")
    wait_mean = delta(gw, names.ALLOCATION_WAIT + "_sum") / waits if waits else None
    ttft = stats(ttfts)
    rows = {p: delta(wk, names.RESOLVER_ROWS + "_total", path=p) for p in ("direct", "hot", "host")}
    n_rows = sum(rows.values())
    lat_n = delta(wk, names.RECLAIM_LATENCY + "_count")
    drafts = delta(wk, names.SPEC_DRAFTS + "_total")
    accepted = delta(wk, names.SPEC_ACCEPTED_TOKENS + "_total")
    host_bytes = delta(wk, names.HOST_READ_BYTES + "_total")
    lat_sum = delta(wk, names.RECLAIM_LATENCY + "_sum")
    return {
        "window_s": span,
        "requests": request_counts(recs, done, output_len),
        "output_tokens_per_s": tokens / span,
        "requests_per_s": len(done) / span,
        "sessions_admitted": peak,
        "ttft_s": ttft,
        # The gateway's allocation wait over the admissions in the window (no per-request split).
        "alloc_wait_s": None if wait_mean is None else {"mean": wait_mean, "n": int(waits)},
        "prefill_s": {"mean": ttft["mean"] - wait_mean} if ttft and wait_mean is not None else None,
        "alloc_wait_share_of_ttft": wait_mean / ttft["mean"] if ttft and wait_mean else None,
        "tpot_s": stats([x for r in recs if r.last and w0 < r.last <= w1 and (x := tpot(r))]),
        "e2e_s": stats([r.finish - r.arrival for r in done]),  # type: ignore[operator]
        "census": {**{p: v / n_rows for p, v in rows.items()}, "rows": n_rows} if n_rows else None,
        "host_read_bytes_per_token": host_bytes / tokens if tokens and n_rows else None,
        "reclaim": None  # only adaptive residency reclaims
        if mode != "adaptive"
        else {
            "events": delta(wk, names.RECLAIM_EVENTS + "_total"),
            "pages": delta(wk, names.RECLAIM_PAGES + "_total"),
            "repopulated_pages": delta(wk, names.REPOPULATED_PAGES + "_total"),
        },
        "reclaim_latency_s": {"mean": lat_sum / lat_n, "n": int(lat_n)} if lat_n else None,
        "acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "spec": {"drafts": drafts, "accepted": accepted} if drafts else None,
    }
