"""The load benchmark's JSON as a markdown table (one row per run) and as plots: output
throughput and sessions held against C, one panel per family and context, one line per
variant."""

from __future__ import annotations

from pathlib import Path

from bench.core.plots import pyplot, save


def _f(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if x is None else f"{x * scale:,.{digits}f}"


def table(out: dict) -> str:
    head = ("| family | in | variant | C | sessions (peak / mean) | out tok/s | per request "
            "| TPOT ms p50 / p90 | TTFT s p50 / p90 | alloc wait share | reclaims | host B/tok "
            "| accept len |")  # fmt: skip
    lines = [f"Machine: {out['machine']}; output {out['output_len']} tokens.", "", head,
             "|" + "---|" * (head.count("|") - 1)]  # fmt: skip
    for r in out["runs"]:
        m = r["metrics"]
        tp, tt = m.get("tpot_s") or {}, m.get("ttft_s") or {}
        share = m.get("alloc_wait_share_of_ttft")
        rec = m.get("reclaim")
        variant = r["name"].split("@")[0] + (" (again)" if r["repeat"] else "")
        lines.append(
            f"| {r['family']} | {r['context']} | {variant} | {r['concurrency']} "
            f"| {m['sessions_admitted']} / {_f(m['mean_running'])} "
            f"| {_f(m['output_tokens_per_s'])} | {_f(m['per_request_tokens_per_s'])} "
            f"| {_f(tp.get('p50'), 1e3)} / {_f(tp.get('p90'), 1e3)} "
            f"| {_f(tt.get('p50'), 1, 2)} / {_f(tt.get('p90'), 1, 2)} "
            f"| {'–' if share is None else f'{share:.0%}'} "
            f"| {'–' if rec is None else rec['events']} "
            f"| {_f(m.get('host_read_bytes_per_token'), 1, 0)} "
            f"| {_f(m.get('acceptance_length'), 1, 2)} |"
        )
    lines.append("")
    for s in out.get("speculation", []):
        e = s["eq13"]
        if e:
            lines.append(f"eq. 13 {s['family']} in={s['context']} {s['mode']}/mtp-{s['spec']} "
                         f"C{s['concurrency']}: predicted {e['predicted_gain']:.3f}, measured "
                         f"{e['measured_gain']:.3f}")  # fmt: skip
    for n in out.get("noise", []):
        if n["relative_difference"] is not None:
            lines.append(f"noise {n['variant']}: {n['first']:.1f} vs {n['second']:.1f} tok/s "
                         f"({n['relative_difference']:.1%})")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(out: dict, prefix: str) -> list[str]:
    """PREFIX_throughput.png and PREFIX_sessions.png; returns their paths."""
    plt = pyplot()
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    panels = sorted({(r["family"], r["context"]) for r in out["runs"]})
    paths = []
    for name, metric, ylabel in (
        ("throughput", lambda m: m["output_tokens_per_s"], "output tokens/s"),
        ("sessions", lambda m: m["mean_running"], "sessions running (mean)"),
    ):
        fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4.5),
                                 squeeze=False)  # fmt: skip
        for ax, (fam, ctx) in zip(axes[0], panels, strict=False):
            series: dict[str, tuple[list[int], list[float]]] = {}
            for r in out["runs"]:
                if (r["family"], r["context"]) != (fam, ctx) or r["repeat"]:
                    continue
                xs, ys = series.setdefault(r["name"].split("@")[0], ([], []))
                xs.append(r["concurrency"])
                ys.append(metric(r["metrics"]))
            for label, (xs, ys) in sorted(series.items()):
                order = sorted(range(len(xs)), key=xs.__getitem__)
                ax.plot([xs[i] for i in order], [ys[i] for i in order], marker="o", label=label)
            ax.set(xscale="log", xlabel="concurrency C", ylabel=ylabel, title=f"{fam}, in={ctx}")
            if series:
                ax.legend(fontsize=7)
        fig.suptitle(f"{out['machine']}: {name} against C per mode, equal GPU memory")
        fig.tight_layout()
        paths.append(save(fig, f"{prefix}_{name}.png"))
    return paths
