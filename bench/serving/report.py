"""A serving benchmark's JSON as a markdown table and as plots: throughput vs C per mode, TPOT
vs C, TTFT split into allocation wait and prefill, acceptance length per drafter/schedule."""

from __future__ import annotations

from pathlib import Path

from bench.core.plots import pyplot


def _f(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if x is None else f"{x * scale:,.{digits}f}"


def _mean(m: dict, key: str) -> float | None:
    return m[key]["mean"] if m.get(key) else None


def table(out: dict) -> str:
    """One row per run; – where a metric does not apply or was not measured."""
    head = (
        "| engine | in | C | sessions | out tok/s | TPOT ms (mean / p90) | TTFT s | alloc wait s "
        "| wait share | direct / hot / host | host KB/tok | accept len | reclaims (mean ms) "
        "| done |"
    )
    lines = [
        f"Machine: {out['machine']}; model {out['model']['name']} ({out['model']['spec']}); "
        f"level {out['level']}; output {out['load']['output_len']} tokens, "
        f"T={out['load']['temperature']}.",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in out["runs"]:
        m, run = r["metrics"], r["run"]
        cen = m.get("census")
        census = "–" if not cen else f"{cen['direct']:.0%} / {cen['hot']:.0%} / {cen['host']:.0%}"
        tp = m.get("tpot_s") or {}
        rec = m.get("reclaim")
        lat = _mean(m, "reclaim_latency_s")
        reclaims = "–" if rec is None else f"{rec['events']} ({_f(lat, 1e3)})"
        share = m.get("alloc_wait_share_of_ttft")
        lines.append(
            f"| {r['engine']} | {run['input_len']} | {run['concurrency']} "
            f"| {m.get('sessions_admitted', '–')} | {_f(m['output_tokens_per_s'])} "
            f"| {_f(tp.get('mean'), 1e3)} / {_f(tp.get('p90'), 1e3)} "
            f"| {_f(_mean(m, 'ttft_s'), 1, 2)} | {_f(_mean(m, 'alloc_wait_s'), 1, 2)} "
            f"| {'–' if share is None else f'{share:.0%}'} | {census} "
            f"| {_f(m.get('host_read_bytes_per_token'), 1e-3)} "
            f"| {_f(m.get('acceptance_length'), 1, 2)} | {reclaims} "
            f"| {m['requests']['completed']}/{m['requests']['issued']} |"
        )
    if out.get("skipped"):
        lines += ["", f"Skipped (time limit): {', '.join(s['name'] for s in out['skipped'])}."]
    return "\n".join(lines) + "\n"


COLOR = {"off": "black", "dflash": "tab:blue", "dspark": "tab:orange", "dflash2": "tab:green"}
DASH = {"fixed": "-", "paper": "--", "online": ":"}
MARK = "osD^v<>"


def _series(out: dict, mode: str, metric) -> dict[tuple, tuple[list[int], list[float]]]:
    """(drafter, schedule, input_len) -> (C, value) over one mode's runs."""
    series: dict[tuple, tuple[list[int], list[float]]] = {}
    for r in out["runs"]:
        run, v = r["run"], metric(r["metrics"])
        if run["mode"] != mode or v is None:
            continue
        cs, vs = series.setdefault((run["drafter"], run["schedule"], run["input_len"]), ([], []))
        cs.append(run["concurrency"])
        vs.append(v)
    return series


def plot(out: dict, prefix: str) -> list[str]:
    """Writes PREFIX_{throughput,tpot,ttft,acceptance}.png; returns their paths."""
    plt = pyplot()

    title = f"{out['machine']}, {out['model']['name']}, {out['level']} level"
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    paths = []
    modes = [m for m in ("resident", "hisparse", "adaptive")
             if any(r["run"]["mode"] == m for r in out["runs"])]  # fmt: skip
    lens = sorted({r["run"]["input_len"] for r in out["runs"]})
    all_c = sorted({r["run"]["concurrency"] for r in out["runs"]})

    def lines(name: str, metric, ylabel: str, log_y: bool = False) -> None:
        """One panel per mode: speculation off in black, drafters in colour, schedules dashed."""
        fig, axes = plt.subplots(1, max(1, len(modes)), figsize=(5 * max(1, len(modes)), 4.5),
                                 sharey=True, squeeze=False)  # fmt: skip
        for ax, mode in zip(axes[0], modes, strict=False):
            for (d, sched, n), (cs, vs) in _series(out, mode, metric).items():
                label = ("no speculation" if d == "off" else f"{d}/{sched}") + (
                    f" in={n}" if len(lens) > 1 else ""
                )
                mark = MARK[lens.index(n) % len(MARK)]
                dash = DASH[sched] if d != "off" else "-"
                ax.plot(cs, vs, dash, color=COLOR[d], marker=mark, markersize=4, label=label)
            ax.set(xscale="log", xlabel="concurrency C (closed-loop clients)", title=mode)
            ax.set_xticks(all_c, [str(c) for c in all_c], minor=False)
            ax.set_xticks([], minor=True)
            if log_y:
                ax.set_yscale("log")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
            else:
                ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes)
        axes[0][0].set_ylabel(ylabel)
        fig.suptitle(title)
        fig.tight_layout()
        path = f"{prefix}_{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)

    lines("throughput", lambda m: m["output_tokens_per_s"], "output tokens/s (window)")
    lines("tpot", lambda m: (m["tpot_s"] or {}).get("mean"), "TPOT mean (s)", log_y=True)

    # TTFT: allocation wait (solid part) and prefill (the rest) per engine, stacked per C.
    base = [r for r in out["runs"] if r["run"]["drafter"] == "off" and r["metrics"]["ttft_s"]]
    keys = sorted({(r["engine"], r["run"]["input_len"]) for r in base})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    cs = sorted({r["run"]["concurrency"] for r in base})
    width = 0.8 / max(1, len(keys))
    for i, key in enumerate(keys):
        rows = {r["run"]["concurrency"]: r["metrics"] for r in base
                if (r["engine"], r["run"]["input_len"]) == key}  # fmt: skip
        xs = [j + i * width for j, c in enumerate(cs) if c in rows]
        wait = [_mean(rows[c], "alloc_wait_s") for c in cs if c in rows]
        pre = [_mean(rows[c], "prefill_s") for c in cs if c in rows]
        bars = ax.bar(xs, wait, width, label=f"{key[0]} in={key[1]}: allocation wait")
        ax.bar(xs, pre, width, bottom=wait, color=bars.patches[0].get_facecolor(), alpha=0.4,
               label=f"{key[0]} in={key[1]}: prefill")  # fmt: skip
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cs))], [str(c) for c in cs])
    ax.set(xlabel="concurrency C", ylabel="TTFT mean (s)", title=f"TTFT split, {title}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(f"{prefix}_ttft.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    # Acceptance length: one group of bars per speculative engine, one bar per C.
    spec = [r for r in out["runs"] if r["metrics"].get("acceptance_length") is not None]
    engines = sorted({(r["engine"], r["run"]["input_len"]) for r in spec})
    cs = sorted({r["run"]["concurrency"] for r in spec})
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(engines) + 2), 4.5))
    width = 0.8 / max(1, len(cs))
    for j, c in enumerate(cs):
        vals = {(r["engine"], r["run"]["input_len"]): r["metrics"]["acceptance_length"]
                for r in spec if r["run"]["concurrency"] == c}  # fmt: skip
        xs = [i + j * width for i, e in enumerate(engines) if e in vals]
        ax.bar(xs, [vals[e] for e in engines if e in vals], width, label=f"C={c}")
    names = [e + (f" in={n}" if len(lens) > 1 else "") for e, n in engines]
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(engines))], names, rotation=30,
                  ha="right", fontsize=7)  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(ylabel="acceptance length (1 + accepted / drafts)", title=f"acceptance, {title}")
    if spec:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no speculative runs", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    paths.append(f"{prefix}_acceptance.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
