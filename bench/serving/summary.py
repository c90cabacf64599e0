"""A run's metrics from what the loop recorded. Only what the engine exposes, or what follows
from it; anything else is reported as unavailable, never estimated.

Populations (duration runs: the window is the last ``duration_s``; request-count runs: the
whole run): TTFT, allocation wait and prefill over the requests whose first token came in the
window; TPOT over the requests with two tokens or more whose latest token came in the window
(finished or still running: a long output need not finish inside a short window); end-to-end
latency over the requests that finished in the window; throughput counts the tokens emitted
by the steps that returned in it."""

from __future__ import annotations

import statistics

from .loop import Counters, LoopResult, RequestRecord, StepRecord

COMPLETE = ("length", "stop")


def stats(values: list[float]) -> dict | None:
    """mean, p50, p90, p99, max and n, or None for no values."""
    if not values:
        return None
    s = sorted(values)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, round(q * (len(s) - 1)))]

    return {"mean": statistics.fmean(s), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
            "max": s[-1], "n": len(s)}  # fmt: skip


def tpot(rec: RequestRecord) -> float | None:
    """Mean time per output token after the first, so far (the worker's definition, which
    takes it at the finish)."""
    if rec.first is None or rec.last is None or rec.tokens < 2:
        return None
    return (rec.last - rec.first) / (rec.tokens - 1)


def request_counts(recs: list, done: list, output_len: int) -> dict:
    """What happened to the issued requests (engine and HTTP levels alike)."""
    return {
        "issued": len(recs),
        "completed": sum(r.finish_reason in COMPLETE for r in recs),
        "completed_in_window": len(done),
        "exact_length": all(r.tokens == output_len for r in recs if r.finish_reason in COMPLETE),
        "errors": sum(r.error is not None for r in recs),
        "in_flight_at_end": sum(r.finish_reason == "end" for r in recs),
    }


def summarize(res: LoopResult, row_bytes: int, page_size: int, output_len: int) -> dict:
    w0, w1 = res.window
    span = max(w1 - w0, 1e-9)
    inw = [s for s in res.steps if w0 < s.t <= w1]
    recs = res.records
    started = [r for r in recs if r.first is not None and w0 < r.first <= w1]
    done = [r for r in recs if r.finish_reason in COMPLETE and r.finish and w0 < r.finish <= w1]
    tokens = sum(s.tokens for s in inw)
    waits = [r.admitted - r.arrival for r in started]  # type: ignore[operator]
    ttfts = [r.first - r.arrival for r in started]  # type: ignore[operator]
    never = [w1 - r.arrival for r in recs if r.admitted is None]
    out: dict = {
        "window_s": span,
        "requests": request_counts(recs, done, output_len) | {"never_admitted": len(never)},
        "output_tokens_per_s": tokens / span,
        "requests_per_s": len(done) / span,
        "sessions_admitted": res.peak_running,
        "mean_running": statistics.fmean([s.decode_batch + s.prefills for s in inw]) if inw else 0,
        "ttft_s": stats(ttfts),
        "alloc_wait_s": stats(waits),
        "prefill_s": stats([t - w for t, w in zip(ttfts, waits, strict=True)]),
        "alloc_wait_share_of_ttft": sum(waits) / sum(ttfts) if ttfts and sum(ttfts) else None,
        "oldest_unadmitted_wait_s": max(never) if never else 0.0,  # censored: still waiting
        "tpot_s": stats([x for r in recs if r.last and w0 < r.last <= w1 and (x := tpot(r))]),
        "e2e_s": stats([r.finish - r.arrival for r in done]),  # type: ignore[operator]
        **decode_costs(inw),
        **counter_metrics(res.start, res.end, tokens, row_bytes, page_size),
        "reclaim_latency_s": stats(res.reclaim_latencies),
        "optional_bytes_peak": res.mem_peak_optional,
        "width_steps": width_histogram(inw),
    }
    return out


def decode_costs(steps: list[StepRecord]) -> dict:
    """Decode step time against the decode batch: per batch size (steps, seconds, tokens) and
    a least-squares line ``decode_s = fixed + per_request * batch`` (the projection's input)."""
    by: dict[int, list[float]] = {}
    for s in steps:
        if s.decode_batch:
            b = by.setdefault(s.decode_batch, [0, 0.0, 0])
            b[0], b[1], b[2] = b[0] + 1, b[1] + s.decode_s, b[2] + s.decode_tokens
    pts = [(s.decode_batch, s.decode_s) for s in steps if s.decode_batch]
    fit = None
    if len({x for x, _ in pts}) >= 2:
        mx = statistics.fmean(x for x, _ in pts)
        my = statistics.fmean(y for _, y in pts)
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
        fit = {"fixed_s": my - slope * mx, "per_request_s": slope, "points": len(pts)}
    dsum = sum(s.decode_s for s in steps)
    return {
        "decode_steps": len(pts),
        "decode_step_s_mean": dsum / len(pts) if pts else None,
        "decode_tokens_per_s": sum(s.decode_tokens for s in steps) / dsum if dsum else None,
        "decode_step_by_batch": {str(k): v for k, v in sorted(by.items())},
        "decode_step_fit": fit,
    }


def counter_metrics(a: Counters, b: Counters, tokens: int, row_bytes: int, page: int) -> dict:
    out: dict = {}
    if a.census is None or b.census is None:
        out["census"] = None  # resident serving resolves nothing: no census
        out["host_read_bytes_per_token"] = None
    else:
        direct, hot, host, copied = (y - x for x, y in zip(a.census, b.census, strict=True))
        total = max(1, direct + hot + host)
        out["census"] = {"direct": direct / total, "hot": hot / total, "host": host / total,
                         "rows": direct + hot + host, "rows_copied": copied}  # fmt: skip
        out["host_read_bytes_per_token"] = copied * row_bytes / max(tokens, 1)
    if a.residency is None or b.residency is None:
        out["reclaim"] = None  # only adaptive residency reclaims
        out["repopulate_bytes_per_token"] = None
    else:
        ev, pages, repop, waited, _ = (y - x for x, y in zip(a.residency, b.residency, strict=True))
        out["reclaim"] = {"events": ev, "pages": pages, "repopulated_pages": repop,
                          "admissions_waited": waited}  # fmt: skip
        out["repopulate_bytes_per_token"] = repop * page * row_bytes / max(tokens, 1)
    if a.spec is None or b.spec is None:
        out["spec"] = None
        out["acceptance_length"] = None
    else:
        drafts, draft_tokens, accepted = (y - x for x, y in zip(a.spec, b.spec, strict=True))
        out["spec"] = {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted}
        out["acceptance_length"] = 1.0 + accepted / drafts if drafts else None
    return out


def width_histogram(steps: list[StepRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in steps:
        if s.decode_batch:
            out[str(s.width)] = out.get(str(s.width), 0) + 1
    return out
