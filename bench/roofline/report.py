"""The roofline's rows: per region its kernels, time, the bytes and FLOPs it must move and its
fractions of the device's limits; per step its time against the roofline
max(Σ bytes / copy rate, Σ FLOPs / compute limit). And the printed tables a person reads."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from bench.roofline.cost import Cost, total
from bench.roofline.limits import Limits


def spread(times_s: Sequence[float]) -> dict[str, float]:
    """Median, min, max and interquartile range of step times, in ms."""
    ms = sorted(t * 1e3 for t in times_s)
    q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0], ms[0], ms[0]]
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1],
            "q1_ms": q[0], "q3_ms": q[2], "samples": len(ms)}  # fmt: skip


def regions(
    timed: Mapping[str, tuple[float, float]], costs: Mapping[str, Cost], limits: Limits
) -> list[dict]:
    """One row per region that ran kernels or must move bytes: ``timed`` region -> (kernels,
    µs) per step or pass; fractions are None where the region took no time."""
    rows = []
    for r in sorted(set(timed) | set(costs), key=lambda r: -timed.get(r, (0, 0.0))[1]):
        n, us = timed.get(r, (0.0, 0.0))
        c = costs.get(r, Cost())
        s = us * 1e-6
        rows.append({
            "region": r, "kernels": n, "us": us, "bytes": c.bytes, "flops": c.flops,
            "frac_copy_rate": c.bytes / (s * limits.copy_bytes_per_s) if s > 0 else None,
            "frac_peak": c.flops / (s * limits.compute) if s > 0 else None,
        })  # fmt: skip
    return rows


def roofline(costs: Mapping[str, Cost], limits: Limits, measured_s: float) -> dict:
    """The pass's roofline and ``ratio`` = roofline / measured (1 is at the limit)."""
    t = total(costs)
    mem = t.bytes / limits.copy_bytes_per_s
    comp = t.flops / limits.compute
    bound = max(mem, comp)
    return {
        "bytes": t.bytes, "flops": t.flops, "memory_s": mem, "compute_s": comp,
        "roofline_s": bound, "bound": "memory" if mem >= comp else "compute",
        "measured_s": measured_s, "ratio": bound / measured_s if measured_s > 0 else None,
    }  # fmt: skip


def fmt(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def print_regions(rows: Sequence[dict], limit: int = 40) -> None:
    print(f"  {'region':<30}{'kern':>7}{'µs':>10}{'MB':>10}{'GFLOP':>10}{'bw':>7}{'peak':>7}")
    for row in rows[:limit]:
        print(
            f"  {row['region']:<30}{row['kernels']:>7.1f}{row['us']:>10.1f}"
            f"{row['bytes'] / 1e6:>10.2f}{row['flops'] / 1e9:>10.3f}"
            f"{fmt(row['frac_copy_rate'], '.2f'):>7}{fmt(row['frac_peak'], '.2f'):>7}"
        )
    if len(rows) > limit:
        print(f"  ... {len(rows) - limit} more regions in the JSON")


def print_kernels(rows: Sequence[dict], limit: int = 15) -> None:
    print(f"  {'kernel':<70}{'n/step':>8}{'µs/step':>10}  region")
    for row in rows[:limit]:
        region = max(row["regions"], key=row["regions"].get)
        print(f"  {row['name'][:68]:<70}{row['count']:>8.1f}{row['us']:>10.1f}  {region}")


def print_summary(families: Mapping[str, dict]) -> None:
    """One line per (family, C, variant) and per prefill: the run at a glance."""
    print(f"\n{'family':<14}{'C':>5} {'variant':<9}{'step ms':>10} {'IQR ms':<19}{'roof ms':>9}"
          f"{'ratio':>7}{'kern':>7}{'/layer':>8}{'launch µs':>11}")  # fmt: skip
    for fam, r in families.items():
        for c, stage in r["decode"].items():
            if "skipped" in stage:
                print(f"{fam:<14}{c:>5} skipped: {stage['skipped']}")
                continue
            for v, d in stage["variants"].items():
                s, roof = d["step"], d["roofline"]
                print(
                    f"{fam:<14}{c:>5} {v:<9}{s['median_ms']:>10.3f} "
                    f"{s['q1_ms']:.3f}-{s['q3_ms']:<9.3f}{roof['roofline_s'] * 1e3:>9.3f}"
                    f"{fmt(roof['ratio'], '.3f'):>7}{d['kernels_per_step']:>7.0f}"
                    f"{d['kernels_per_layer']:>8.1f}{fmt(d['graph_launch_us_per_step'], '.0f'):>11}"
                )
        for n, variants in r["prefill"].items():
            if "skipped" in variants:
                print(f"{fam:<14} prefill {n}: skipped: {variants['skipped']}")
                continue
            for v, d in variants.items():
                print(f"{fam:<14} prefill {n} {v}: {d['ttft_s']:.3f} s to the first token, "
                      f"{fmt(d['frac_peak'], '.3f')} of the compute limit")  # fmt: skip
