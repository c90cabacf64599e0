"""Prefill against the compute limit: one prompt of a length, eager as the engine prefills it
(chunked as configured), per variant. First a profiled run with region labels (which also
compiles what the prompt's shapes need), then a timed one: time to first token. FLOPs are
the byte model's over the passes the labelled run made (2 x active parameters per token,
attention over min(index_topk, visible) rows, the indexer over every visible key)."""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.roofline import report
from bench.roofline.attribution import region
from bench.roofline.cost import Dims, passes_costs
from bench.roofline.limits import Limits
from bench.roofline.regions import Instruments, step_span
from bench.roofline.trace import kernels, ranges
from bench.roofline.variants import Served, Variant
from services.worker.request.request import SamplingParams

_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _until_first_token(served: Served, rid: str, labelled: bool = False) -> int:
    """Steps until ``rid`` emits; the steps taken (each in a step range when ``labelled``)."""
    n = 0
    while True:
        n += 1
        if labelled:
            with step_span():
                outs = served.eng.step()
        else:
            outs = served.eng.step()
        if any(o.request_id == rid and o.new_token_ids for o in outs):
            return n


def prefill(served: Served, length: int, dims: Dims, limits: Limits) -> dict:
    """Every variant prefilling one ``length``-token prompt, after the decode requests ended."""
    eng = served.eng
    served.keep(0)
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(0, 256, (length,), generator=g).tolist()
    out = {}
    for v in served.variants:
        out[v.name] = one(served, v, prompt, dims, limits)
        r = out[v.name]
        print(f"\n--- prefill {length} {v.name}: {r['ttft_s']:.3f} s to the first token "
              f"({r['passes']} passes, one sample), {r['flops'] / 1e9:.3f} GFLOP, "
              f"{report.fmt(r['frac_peak'], '.3f')} of the compute limit; "
              f"{r['kernels']} kernels")  # fmt: skip
        report.print_regions(r["regions"], limit=25)
    assert eng.num_running == 0
    return out


def one(served: Served, v: Variant, prompt: list[int], dims: Dims, limits: Limits) -> dict:
    eng = served.eng
    inst = Instruments(eng.model, eng.kv)
    acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if served.cuda else [])]
    with served.as_variant(v), inst.installed(), profile(activities=acts) as prof:
        eng.add_request(f"prefill-{v.name}-profiled", prompt, _PARAMS)
        passes = _until_first_token(served, f"prefill-{v.name}-profiled", labelled=True)
        served.sync()
    served.keep(0)
    events = prof.events()
    spans = ranges(events)
    timed: dict[str, tuple[float, float]] = {}
    ks = kernels(events, served.cuda)
    for k in ks:
        r = region(k, spans)
        n, us = timed.get(r, (0.0, 0.0))
        timed[r] = (n + 1, us + k.us)
    costs = passes_costs(dims, [p.shape() for p in inst.passes])
    with served.as_variant(v):
        served.sync()
        t0 = time.perf_counter()
        eng.add_request(f"prefill-{v.name}-timed", prompt, _PARAMS)
        _until_first_token(served, f"prefill-{v.name}-timed")
        served.sync()
        ttft = time.perf_counter() - t0
    served.keep(0)
    roof = report.roofline(costs, limits, ttft)
    return {
        "ttft_s": ttft, "passes": passes, "forward_passes": len(inst.passes),
        "flops": roof["flops"], "bytes": roof["bytes"],
        "frac_peak": roof["flops"] / (ttft * limits.compute), "roofline": roof,
        "kernels": len(ks), "regions": report.regions(timed, costs, limits),
    }  # fmt: skip
