"""``python -m bench load-projection``: sessions and decode tokens per second per GPU of the full
DeepSeek-V3.2 (61 layers) and GLM-5.2 (78 layers, every expert) on a node of 8 H200, per mode,
at 32K and 100K, from the roofline's measured per-region costs of their real-dimension presets
and ``dhisparse plan``'s sessions under the best layout (``projection``: the arithmetic).

    python -m bench load-projection \\
        --roofline docs/results/archive/13c7700/roofline_v32-scaled_8k.json \\
        --roofline docs/results/archive/13c7700/roofline_glm5-scaled_8k.json \\
        --out PREFIX.json --md PREFIX.md --plot PREFIX.png

Output JSON: benchmark, node, assumptions, host_shares (per context: the census the replayed
selections give a session, ``replay.mapped_census``),
anchors (the paper's and the public figures, with what they measured), families (per family:
full and scaled shapes, per variant ``fused`` / ``unfused`` and context: the plan's layout and
sessions per GPU per mode, and ``curve``: per mode and C, the sessions running, step ms split
into device / host / exchange, the device regions' ms, tokens per second per GPU), provenance
(the roofline files and the selection trace as inputs)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.core.output import write_result
from bench.core.plots import pyplot, save
from dhisparse.family.hf_dir import hf_family, read_config
from dhisparse.family.scaled import SCALED
from services.worker.hierarchy.tail import tail_rows

from .engines import MODES
from .pool import FULL, ROOT, plan_pool
from .projection import Measured, Node, Shape, step, tokens_per_s
from .replay import TRACE, load_traces, mapped_census

ARCHIVE = ROOT / "docs" / "results" / "archive" / "13c7700"
ROOFLINES = [ARCHIVE / "roofline_v32-scaled_8k.json", ARCHIVE / "roofline_glm5-scaled_8k.json"]
PAGE = 64  # the plan's page
WARMUP = 4  # decode steps before the census counts (bench census's default)
H200_COPY = 4.281e12  # an H200's HBM copy rate, read + write (bench/serving/scaling.py)
CAP = {"resident": "resident", "hisparse": "hierarchy", "adaptive": "hierarchy"}
GRID = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
ANCHORS = [
    {"what": "paper: sessions at 100K (GLM-5.3, 4 GPUs with their own sessions, pool 22.75 "
             "GiB/GPU), without / with a DFlash2 drafter",
     "sessions": [208, 140], "per_gpu": [52, 35], "source": "paper §5; docs/capacity.md A4"},
    {"what": "vLLM fork HiSparse, GLM-5.2-FP8, DP64 wide-EP decode (input length not given)",
     "sessions_per_gpu": 81, "tokens_per_s_per_gpu": 407,
     "source": "field-2026-12.md §Q5 (vLLM #46326)"},
    {"what": "vLLM HiSparse, 8×RTX PRO 6000 TP8 at 32K: sessions per node without / with",
     "sessions": [6, 54], "throughput_ratio": 3.00, "source": "field-2026-12.md §Q5 (#33075)"},
    {"what": "SGLang GLM-5.2-FP8 8×H200, ISL 8K / OSL 1K, tok/s per GPU at c64 / c256; "
             "DP-attention cell at c256",
     "tokens_per_s_per_gpu": {"c64": 219, "c256": 236, "c256_dp_attention": 2266},
     "source": "field-2026-12.md §Q5 (#28437, #31554)"},
    {"what": "vLLM TP8 GLM-5.2-FP8 8×H200 at 200K, c16", "tokens_per_s_per_gpu": 96,
     "source": "field-2026-12.md §Q5"},
]  # fmt: skip


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--roofline", action="append", help="roofline JSONs (default: 13c7700's)")
    ap.add_argument("--contexts", type=ints, default=[32768, 100_000])
    ap.add_argument("--trace", default=str(TRACE), help="the selections the host shares replay")
    ap.add_argument("--out", default=str(ARCHIVE / "projection_8xh200.json"))
    ap.add_argument("--md", help="the markdown table")
    ap.add_argument("--plot", help="PNG of tokens per second per GPU against C")


def shape_of(config: dict, producers: int) -> Shape:
    layers = int(config["num_hidden_layers"])
    types = config.get("mlp_layer_types")
    dense = types.count("dense") if types else int(config.get("first_k_dense_replace", 0))
    return Shape(layers=layers, producers=producers, moe_layers=layers - dense,
                 dense_layers=dense, experts=int(config["n_routed_experts"]),
                 top_k=int(config["num_experts_per_tok"]))  # fmt: skip


def shapes(family: str) -> tuple[Shape, Shape, int]:
    """(scaled, full, the full model's hidden size)."""
    preset = SCALED[family]
    scaled = shape_of(preset.config, len(preset.parse()[1].index_producers))
    src = FULL[family]
    config = read_config(src)
    return scaled, shape_of(config, len(hf_family(src)[1].index_producers)), config["hidden_size"]


def measured(decode: dict, variant: str) -> Measured:
    """A roofline family's decode points of ``variant`` (skipped C left out)."""
    pts = {int(c): x["variants"][variant] for c, x in decode.items() if "variants" in x}
    return Measured(
        regions={c: {r["region"]: r["us"] for r in v["regions"]} for c, v in pts.items()},
        step_ms={c: v["step"]["median_ms"] for c, v in pts.items()},
        device_us={c: v["device_us_per_step"] for c, v in pts.items()},
        experts_hit={c: statistics.fmean(v["experts"].values()) for c, v in pts.items()},
        visible_rows=statistics.fmean(v["visible_rows"] for v in pts.values()),
    )  # fmt: skip


def host_shares(path: Path, context: int, k: int) -> dict:
    """The census a hierarchy session shows at ``context`` under the replayed selections of
    the shipped model (``replay.mapped_census``: B = 2k hot rows, a tail of one page and a
    decode row, after the census's 4 warm-up steps)."""
    return mapped_census(load_traces(path), context, k, 2 * k, tail_rows(PAGE, 1), WARMUP)


def assumptions(node: Node) -> list[str]:
    return [
        "Device costs: measured on one H100 (13c7700, resident, 8K, CUDA graphs), each region "
        "scaled to the full model by its count (layers / index producers / MoE layers / dense "
        "layers / once a step), interpolated linearly in C between the measured C and "
        "extrapolated linearly beyond the largest (V3.2: 16, GLM-5.2: 64).",
        f"H200: every device region's time × {node.hbm_ratio:.4f} = the H100's measured copy "
        f"rate / the H200's {H200_COPY / 1e12:.3f} TB/s (the step is memory-bound at its "
        f"roofline); the time outside kernels is not scaled.",
        "indexer.select scales linearly with the visible rows (context / the measured ~8.4K); "
        "sparse attention reads k rows whatever the context; nothing else depends on it.",
        "Routed experts: the measured time per distinct expert read, times the distinct "
        "experts a GPU holding 1/8 of them reads when its node's 8·C tokens route uniformly "
        "(top-8 of 256); the scaled router is not uniform (measured distinct counts are used "
        "for the per-expert time only).",
        "Layout: the plan's best for the full model on 8 H200 (141 GiB, FP8 weights and KV; "
        "`layout` per context): each GPU runs its own sessions' attention (data-parallel "
        "attention) and holds 1/8 of the routed experts.",
        f"MoE exchange (not measured): 2 all-to-alls per MoE layer, each at least "
        f"{node.latency_s * 1e6:.0f} µs, {node.link_gbs:.0f} GB/s per GPU, FP8 dispatch and "
        f"bf16 combine of the 7/8 of routed copies that leave the GPU.",
        f"Host reads (hierarchy): the share of selected rows a session reads from the host "
        f"(`host_shares` per context: the shipped model's selections replayed at the context, "
        f"bench/load/replay.py, B = 2k hot rows, after 4 warm-up steps), k rows per layer of "
        f"{node.row_bytes} B at {node.pcie_gbs} GB/s per GPU, not overlapped with the device "
        f"(an upper bound; `_overlapped`: under it, the lower bound); adaptive: that share × "
        f"(1 − N_resident / C). The hierarchy's device work (lookups, hot-cache copies) is "
        f"taken as the resident step's: not measured at real dimensions.",
        "Sessions per GPU: dhisparse plan (capacity model) for the full model; adaptive holds "
        "what hisparse holds. A mode runs C sessions up to its sessions per GPU (its curve "
        "ends there); one token per session per step (no speculation).",
    ]


def project(args: argparse.Namespace) -> tuple[dict, list[Path]]:
    paths = [Path(p) for p in (args.roofline or ROOFLINES)]
    doc: dict = {"benchmark": "load-projection", "gpus": 8, "anchors": ANCHORS,
                 "host_shares": {}, "families": {}}  # fmt: skip
    for path in paths:
        roof = json.loads(path.read_text())
        node = Node(hbm_ratio=roof["limits"]["copy_bytes_per_s"] / H200_COPY)
        ((family, fam),) = roof["families"].items()
        scaled, full, hidden = shapes(family)
        node = Node(hbm_ratio=node.hbm_ratio, hidden=hidden)
        doc["node"] = {"gpus": node.gpus, "hbm_ratio": node.hbm_ratio, "pcie_gbs": node.pcie_gbs,
                       "link_gbs": node.link_gbs, "latency_s": node.latency_s,
                       "measured_on": roof["limits"]["device"]}  # fmt: skip
        doc["assumptions"] = assumptions(node)
        k = int(SCALED[family].config["index_topk"])
        out = {"roofline": str(path.relative_to(ROOT)), "scaled": scaled.__dict__,
               "full": full.__dict__, "variants": {}}  # fmt: skip
        for variant in roof["config"]["variants"]:
            m = measured(fam["decode"], variant)
            per_ctx = {}
            for ctx in args.contexts:
                plan = plan_pool(family, ctx)
                shares = doc["host_shares"].setdefault(
                    str(ctx), host_shares(Path(args.trace), ctx, k)
                )
                caps = {mode: plan.sessions_per_gpu[CAP[mode]] for mode in MODES}
                grid = sorted({*GRID, *caps.values()} - {0})
                curve = []
                for mode in MODES:
                    for c in grid:
                        n = min(c, caps[mode])
                        if c > caps[mode]:
                            continue  # a mode's curve ends at its sessions (flat beyond)
                        s = step(m, scaled, full, node, mode, n, ctx, k, caps, shares["host"])
                        curve.append({
                            "mode": mode, "concurrency": c, "sessions": n,
                            "step_ms": round(s.seconds * 1e3, 3),
                            "device_ms": round(sum(s.device.values()) * 1e3, 3),
                            "host_ms": round(s.host * 1e3, 3),
                            "exchange_ms": round(s.exchange * 1e3, 3),
                            "groups_ms": groups_ms(s.device),
                            "tokens_per_s_per_gpu": round(tokens_per_s(n, s.seconds), 2),
                            "tokens_per_s_per_gpu_overlapped": round(tokens_per_s(n, s.overlapped),
                                                                     2),
                        })  # fmt: skip
                top = max(caps.values())
                regions = step(m, scaled, full, node, "hisparse", top, ctx, k, caps, shares["host"])
                per_ctx[str(ctx)] = {
                    "layout": plan.layout, "sessions_per_gpu": caps, "plan": plan.formula,
                    "curve": curve,
                    # every region's device ms at the hierarchy's sessions per GPU
                    "regions_ms_at_hierarchy_capacity": {
                        r: round(v * 1e3, 4) for r, v in sorted(regions.device.items())
                    },
                }  # fmt: skip
            out["variants"][variant] = per_ctx
        doc["families"][family] = out
    return doc, paths


GROUPS = {"indexer.select": "indexer scores and top-k", "mlp.experts": "routed experts",
          "attn.sparse": "sparse attention", "launch": "outside kernels"}  # fmt: skip


def groups_ms(device: dict[str, float]) -> dict[str, float]:
    """Device ms by group: the four largest regions by name, the rest as ``other``."""
    out: dict[str, float] = {}
    for r, v in device.items():
        g = GROUPS.get(r, "other")
        out[g] = out.get(g, 0.0) + v * 1e3
    return {g: round(v, 3) for g, v in out.items()}


def at_capacity(curve: list[dict], mode: str) -> dict:
    return max((r for r in curve if r["mode"] == mode), key=lambda r: r["sessions"])


def offered(by_c: dict, top: dict, c: int) -> str:
    """Tokens per second per GPU with C sessions offered (a mode holding fewer: at capacity)."""
    r = by_c.get(c)
    return f"{top['tokens_per_s_per_gpu']:,.0f}\\*" if r is None else (
        f"{r['tokens_per_s_per_gpu']:,.0f}"
    )  # fmt: skip


def table(doc: dict, variant: str = "fused") -> str:
    lines = [
        f"Projection to 8 H200 ({variant} kernels), from {doc['node']['measured_on']} costs "
        f"× {doc['node']['hbm_ratio']:.3f}; every assumption in the JSON's `assumptions`.",
        "",
        "| model | context | mode | sessions / GPU | step ms at that load (device / host / "
        "exchange) | decode tok/s / GPU at capacity (host overlapped) | at C = 16 | at C = 64 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for family, f in doc["families"].items():
        for ctx, x in f["variants"][variant].items():
            for mode in MODES:
                top = at_capacity(x["curve"], mode)
                by_c = {r["concurrency"]: r for r in x["curve"] if r["mode"] == mode}
                lines.append(
                    f"| {family.removesuffix('-scaled')} full | {int(ctx) // 1000}K | {mode} "
                    f"| {top['sessions']} | {top['step_ms']:.1f} ({top['device_ms']:.1f} / "
                    f"{top['host_ms']:.1f} / {top['exchange_ms']:.1f}) "
                    f"| {top['tokens_per_s_per_gpu']:,.0f} "
                    f"({top['tokens_per_s_per_gpu_overlapped']:,.0f}) "
                    f"| {offered(by_c, top, 16)} | {offered(by_c, top, 64)} |"
                )
    lines += [
        "",
        "\\* the mode holds fewer sessions per GPU than C: its rate at capacity.",
        "",
    ]
    for family, f in doc["families"].items():
        for ctx, x in f["variants"][variant].items():
            caps = x["sessions_per_gpu"]
            best = {m: at_capacity(x["curve"], m)["tokens_per_s_per_gpu"] for m in MODES}
            lines.append(
                f"- {family.removesuffix('-scaled')} full at {int(ctx) // 1000}K ({x['layout']}): "
                f"hierarchy ÷ resident sessions {caps['hisparse'] / caps['resident']:.1f}×, "
                f"adaptive ÷ resident decode tok/s at capacity "
                f"{best['adaptive'] / best['resident']:.2f}×, adaptive ÷ hisparse "
                f"{best['adaptive'] / best['hisparse']:.2f}×"
            )
    lines += ["", "Anchors:"]
    lines += [f"- {a['what']}: " + ", ".join(f"{k} {v}" for k, v in a.items()
                                             if k not in ("what", "source"))
              + f" ({a['source']})" for a in doc["anchors"]]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: str, variant: str = "fused") -> str:
    plt = pyplot()
    fams = list(doc["families"])
    ctxs = list(doc["families"][fams[0]]["variants"][variant])
    fig, axes = plt.subplots(len(fams), len(ctxs), figsize=(5.5 * len(ctxs), 4.2 * len(fams)),
                             squeeze=False)  # fmt: skip
    panels = [(fam, ctx) for fam in fams for ctx in ctxs]
    for ax, (fam, ctx) in zip(axes.flat, panels, strict=True):
        curve = doc["families"][fam]["variants"][variant][ctx]["curve"]
        for mode in MODES:
            pts = [r for r in curve if r["mode"] == mode]
            line = ax.plot(
                [r["concurrency"] for r in pts],
                [r["tokens_per_s_per_gpu"] for r in pts],
                marker="o",
                label=mode,
            )
            if mode != "resident":  # host reads under the device's work: the lower bound
                ax.plot(
                    [r["concurrency"] for r in pts],
                    [r["tokens_per_s_per_gpu_overlapped"] for r in pts],
                    linestyle="--",
                    color=line[0].get_color(),
                    label=f"{mode}, host reads overlapped",
                )
        if fam.startswith("glm5"):
            ax.scatter([81], [407], marker="*", s=120, color="k",
                       label="vLLM fork HiSparse (81 sessions, 407 tok/s)")  # fmt: skip
        ax.set(xscale="log", xlabel="C per GPU", ylabel="decode tok/s per GPU",
               title=f"{fam.removesuffix('-scaled')} full, {int(ctx) // 1000}K")  # fmt: skip
        ax.legend(fontsize=7)
    fig.suptitle(f"8 H200, projected from {doc['node']['measured_on']} ({variant} kernels)")
    fig.tight_layout()
    return save(fig, path)


def run(args: argparse.Namespace) -> int:
    doc, paths = project(args)
    if args.plot:
        doc["plot"] = plot(doc, args.plot)
    md = table(doc)
    if args.md:
        Path(args.md).write_text(md)
    print(md)
    print(f"wrote {write_result(doc, args.out, inputs=[*paths, Path(args.trace)])}")
    return 0
