"""Scaling projection (issue 11): sessions admitted and decode throughput of resident /
hisparse / adaptive serving of GLM-5.3 at 100K on an 8-GPU node, from the capacity model and
the per-step costs a serving run measured, and which resource binds.

    python -m bench projection --serving docs/results/serving.json \
        --out docs/results/projection.json --md docs/results/projection.md

Sessions come from ``dhisparse.capacity`` (GLM-5.3 profile; per-GPU pool 22.75 GiB, the one
the paper's 208/140 sessions imply; 4.3 TB host), capped by what the host can back up. Step
time comes from ``bench/serving/scaling.py``: bytes and FLOPs per step over the H200's
measured ceilings (roofline), with the share of selected bytes served from the host (f) and
the acceptance length measured in the serving run. A second, "as measured" step time scales
the serving run's own fit ``decode_s = fixed + per_request · batch``: the fixed part by layer
count (per-layer launches), the per-request part by the bytes one session's step reads. Every
assumption is in the output's ``assumptions``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.core.output import write_result
from bench.serving.scaling import (
    Hardware,
    TargetModel,
    index_bytes,
    pcie_break_even,
    selected_bytes,
    step,
)
from dhisparse.capacity import (
    Deployment,
    build_plan,
    glm53,
    glm53_paper_deployment,
    host_sessions,
    profile_from_model_config,
    speculation_pays,
)
from dhisparse.family.config import ModelConfig

CONTEXT = 100_000
CAPACITY_MODE = {"resident": "resident", "hisparse": "hierarchy", "adaptive": "hierarchy"}
ELEM = {"float32": 4, "bfloat16": 2, "float16": 2}
ASSUMPTIONS = [
    "Sessions per GPU: the capacity model on the GLM-5.3 profile (DESIGN §6) with the per-GPU "
    "pool the paper's counts imply (22.75 GiB, docs/capacity.md A4); every GPU of the node "
    "holds its own sessions; adaptive admits what hisparse admits (optional history only uses "
    "room no session needs).",
    "Host: sessions whose backups fit the node's host memory (4.3 TB) cap the hierarchy modes.",
    "Weights (GLM-5-like: 744B total, 40B active, FP8) are read once per step per GPU, all "
    "experts, spread evenly over the node's GPUs.",
    "HBM traffic per session-step: the k selected rows of every payload source, every index "
    "key, and rows recovered from host written into the hot cache; HBM at the measured "
    "4,281 GB/s (copy, read+write).",
    "Compute: 2 x active params + MLA attention over k rows (64 heads) + the indexer over "
    "every key (64 heads x 128) per token, at 50% of the H200's dense FP8 peak.",
    "PCIe: host recovery at 25.2 GB/s per GPU, the resolver's measured rate for scattered rows "
    "(256 requests x 10% misses); copies overlap GPU work (overlapped) or not (serialized).",
    "f, the share of selected bytes read from host, is the serving run's at its highest C "
    "(host_read_bytes_per_token over the small model's selected bytes) and carries over to "
    "GLM-5.3 unchanged; with random weights it is far above a trained model's.",
    "Every drafter is sized as the paper's DFlash2 (W=2048, K_max=8, 12,288 B rows, 6.6 GiB "
    "fixed), the only drafter in the GLM-5.3 profile.",
    "Speculation: a verify round of width K multiplies attention, indexer and FLOPs by K, not "
    "weights or host copies (deduplicated per round, eq. 6); tokens per round = the measured "
    "acceptance length.",
    "'As measured' step: the larger of the roofline step and the engine's own floor, the "
    "serving fit (fixed + per-request x sessions) x (78 / the small model's layers): on a small "
    "model that fit is host (Python, launch) overhead per layer, not bytes; "
    "measured_per_request_gbs (the small model's bytes per session-step / the fitted slope) "
    "shows how far below HBM bandwidth it ran.",
]


def fit(runs: list[dict]) -> dict | None:
    """Weighted least squares of decode step time on batch over the runs' batch tables."""
    pts = []  # (batch, steps, mean step seconds)
    for r in runs:
        for b, (steps, seconds, _) in (r["metrics"].get("decode_step_by_batch") or {}).items():
            if steps:
                pts.append((int(b), steps, seconds / steps))
    if len({b for b, _, _ in pts}) < 2:
        return None
    w = sum(n for _, n, _ in pts)
    mx = sum(b * n for b, n, _ in pts) / w
    my = sum(y * n for _, n, y in pts) / w
    sxx = sum(n * (b - mx) ** 2 for b, n, _ in pts)
    slope = sum(n * (b - mx) * (y - my) for b, n, y in pts) / sxx
    return {"fixed_s": my - slope * mx, "per_request_s": slope, "steps": w}


def _tpot(run: dict | None) -> float | None:
    return None if run is None else (run["metrics"].get("tpot_s") or {}).get("mean")


def measured(serving: dict) -> dict:
    """What the projection takes from a serving run (its longest input): per mode the step fit
    and, at the highest C, the host share f; per speculative engine, at its highest C, the
    acceptance length, the width mostly used and TPOT over the same mode's without speculation."""
    cfg = ModelConfig.from_dict(serving["model"]["config"])
    small = profile_from_model_config(cfg, kv_dtype_bytes=ELEM[serving["model"]["dtype"]])
    longest = max(serving["prompts"]["input_lens"])
    ctx = longest + serving["load"]["output_len"] // 2
    runs = [r for r in serving["runs"] if r["run"]["input_len"] == longest]
    base = {(r["run"]["mode"], r["run"]["concurrency"]): r for r in runs
            if r["run"]["drafter"] == "off"}  # fmt: skip
    out: dict = {
        "model": cfg.name, "layers": len(cfg.layers), "context": ctx,
        "session_step_bytes": selected_bytes(small) + index_bytes(small, ctx),
        "selected_bytes": selected_bytes(small), "modes": {}, "spec": {},
    }  # fmt: skip
    for mode in CAPACITY_MODE:
        mine = [r for (m, _), r in base.items() if m == mode]
        if not mine:
            continue
        top = max(mine, key=lambda r: r["run"]["concurrency"])
        hb = top["metrics"].get("host_read_bytes_per_token")
        out["modes"][mode] = {
            "fit": fit(mine), "at_concurrency": top["run"]["concurrency"],
            "host_fraction": 0.0 if hb is None else hb / selected_bytes(small),
            "census": top["metrics"].get("census"), "tpot_s": _tpot(top),
        }  # fmt: skip
    for r in sorted(runs, key=lambda r: r["run"]["concurrency"]):  # the highest C stays
        run, m = r["run"], r["metrics"]
        if run["drafter"] == "off" or m.get("acceptance_length") is None:
            continue
        tp, tb = _tpot(r), _tpot(base.get((run["mode"], run["concurrency"])))
        widths = m.get("width_steps") or {}
        width = int(max(widths, key=widths.__getitem__)) if widths else serving["spec_width"]
        out["spec"][r["engine"]] = {
            "mode": run["mode"], "drafter": run["drafter"], "at_concurrency": run["concurrency"],
            "acceptance_length": m["acceptance_length"], "width": width,
            "tpot_ratio": tp / tb if tp and tb else None,
        }  # fmt: skip
    return out


def project(serving: dict, hw: Hardware, model: TargetModel, context: int = CONTEXT) -> dict:
    prof = glm53()
    dflash2 = prof.drafter("dflash2")
    dep = Deployment(pool_bytes=hw.pool_bytes, gpus=hw.gpus, host_bytes=hw.host_bytes)
    plan = build_plan(prof, context, dflash2, dep)
    paper = build_plan(prof, CONTEXT, dflash2, glm53_paper_deployment())
    meas = measured(serving)
    host_cap = host_sessions(prof, context, hw.host_bytes)
    modes: dict = {}
    for mode, m in meas["modes"].items():
        cap = CAPACITY_MODE[mode]
        per_gpu = plan.admitted(cap, False).per_gpu  # type: ignore[union-attr]
        gpu_total = per_gpu * hw.gpus
        total = gpu_total if cap == "resident" else min(gpu_total, host_cap)
        admission_binds = "gpu_memory" if total == gpu_total else "host_memory"
        n = -(-total // hw.gpus)  # sessions on one GPU
        f = m["host_fraction"] if cap == "hierarchy" else 0.0
        s = step(prof, model, hw, context, n, f)
        row = {
            "sessions_per_gpu": per_gpu, "sessions_node": total,
            "host_memory_sessions": None if cap == "resident" else host_cap,
            "admission_binds": admission_binds, "host_fraction": f, "step": s.as_dict(),
            "throughput_binds": s.binds,
            "decode_tokens_per_s_node": total / s.overlapped_s,
            "decode_tokens_per_s_node_serialized": total / s.serialized_s,
            "tpot_s": s.overlapped_s,
            "pcie_break_even_host_fraction": pcie_break_even(prof, model, hw, context, n),
        }  # fmt: skip
        if m["fit"]:
            fixed, slope = max(0.0, m["fit"]["fixed_s"]), max(0.0, m["fit"]["per_request_s"])
            floor = (fixed + n * slope) * model.layers / meas["layers"]
            row["engine_floor_step_s"] = floor
            row["measured_per_request_gbs"] = (
                meas["session_step_bytes"] / slope / 1e9 if slope else None
            )
            row["as_measured_step_s"] = max(s.overlapped_s, floor)
            row["as_measured_tokens_per_s_node"] = total / row["as_measured_step_s"]
        modes[mode] = row
    spec: dict = {}
    base_hier = plan.admitted("hierarchy", False).total  # type: ignore[union-attr]
    for name, sp in meas["spec"].items():
        cap = CAPACITY_MODE[sp["mode"]]
        adm = plan.admitted(cap, True)
        assert adm is not None
        total = min(adm.total, host_cap) if cap == "hierarchy" else adm.total
        n = -(-total // hw.gpus)
        f = (
            meas["modes"].get(sp["mode"], {}).get("host_fraction", 0.0)
            if cap == "hierarchy"
            else 0.0
        )
        s = step(prof, model, hw, context, n, f, width=max(1, sp["width"]))
        spec[name] = {
            **sp, "sessions_node": total, "step": s.as_dict(), "throughput_binds": s.binds,
            "decode_tokens_per_s_node": total * sp["acceptance_length"] / s.overlapped_s,
            "eq13_pays_at_full_load": None if sp["tpot_ratio"] is None
            else speculation_pays(total, base_hier, sp["tpot_ratio"]),
        }  # fmt: skip
    return {
        "context": context, "profile": prof.name, "hardware": hw.__dict__, "model": model.__dict__,
        "paper_check": {f"{a.mode}{'+' + a.drafter if a.drafter else ''}": a.total
                        for a in paper.admissions},
        "capacity": {f"{a.mode}{'+' + a.drafter if a.drafter else ''}": {"per_gpu": a.per_gpu,
                     "node": a.total} for a in plan.admissions},
        "host_memory_sessions": host_cap, "measured": meas, "modes": modes, "spec": spec,
        "verdict": verdict(modes), "assumptions": ASSUMPTIONS,
        "serving_command": (serving.get("provenance") or {}).get("command", serving.get("command")),
    }  # fmt: skip


def verdict(modes: dict) -> str:
    lines = []
    for mode, r in modes.items():
        s = r["step"]
        lines.append(
            f"{mode}: {r['sessions_node']} sessions ({r['admission_binds'].replace('_', ' ')} "
            f"binds admission); a step at {s['sessions']} sessions/GPU takes "
            f"{s['overlapped_s'] * 1e3:.1f} ms (HBM {(s['weights_s'] + s['kv_s']) * 1e3:.1f}, "
            f"compute {s['compute_s'] * 1e3:.1f}, PCIe {s['pcie_s'] * 1e3:.1f}): "
            f"{s['binds']} binds throughput at f = {r['host_fraction']:.1%} host share "
            f"(PCIe binds above f = {r['pcie_break_even_host_fraction']:.1%})."
        )
    hier = [r for m, r in modes.items() if m != "resident"]
    if hier:
        gpu = all(r["admission_binds"] == "gpu_memory" for r in hier)
        lines.append(
            "Paper's claim (GPU memory binds): "
            + ("holds for admission" if gpu else "does not hold: host memory binds admission")
            + ("; throughput is PCIe-bound at the measured host share"
               if any(r["throughput_binds"] == "pcie" for r in hier) else "")
            + "."
        )  # fmt: skip
    return "\n".join(lines)


def markdown(p: dict) -> str:
    out = [f"# Projection: {p['profile']} at {p['context']:,} tokens, "
           f"{p['hardware']['gpus']} GPUs\n", "| mode | sessions | admission binds | step ms | "
           "HBM / compute / PCIe ms | throughput binds | f | f break-even | tok/s (node) "
           "| as measured tok/s |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for mode, r in p["modes"].items():
        s = r["step"]
        am = r.get("as_measured_tokens_per_s_node")
        out.append(
            f"| {mode} | {r['sessions_node']} | {r['admission_binds']} | "
            f"{s['overlapped_s'] * 1e3:.1f} | {(s['weights_s'] + s['kv_s']) * 1e3:.1f} / "
            f"{s['compute_s'] * 1e3:.1f} / {s['pcie_s'] * 1e3:.1f} | {s['binds']} | "
            f"{r['host_fraction']:.1%} | {r['pcie_break_even_host_fraction']:.1%} | "
            f"{r['decode_tokens_per_s_node']:,.0f} | {'–' if am is None else f'{am:,.0f}'} |"
        )
    out.append("")
    for name, r in p["spec"].items():
        out.append(f"- {name}: {r['sessions_node']} sessions, K={r['width']}, acceptance "
                   f"{r['acceptance_length']:.2f}: {r['decode_tokens_per_s_node']:,.0f} tok/s; "
                   f"eq. 13 pays at full load: {r['eq13_pays_at_full_load']}")  # fmt: skip
    out += ["", "Paper deployment check (4 GPUs): " + json.dumps(p["paper_check"]), "",
            p["verdict"], "", "Assumptions:", *(f"- {a}" for a in p["assumptions"])]  # fmt: skip
    return "\n".join(out) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--serving", required=True, help="a serving result JSON")
    ap.add_argument("--context", type=int, default=CONTEXT)
    ap.add_argument("--gpus", type=int, default=Hardware.gpus)
    ap.add_argument("--pool-gib", type=float, default=Hardware.pool_bytes / 2**30)
    ap.add_argument("--host-tb", type=float, default=Hardware.host_bytes / 1e12)
    ap.add_argument("--pcie-gbs", type=float, default=Hardware.pcie_gbs)
    ap.add_argument("--hbm-gbs", type=float, default=Hardware.hbm_gbs)
    ap.add_argument("--mfu", type=float, default=Hardware.mfu)
    ap.add_argument("--out", default="docs/results/projection.json")
    ap.add_argument("--md", default=None, help="markdown (default: --out with .md)")


def run(a: argparse.Namespace) -> int:
    hw = Hardware(
        hbm_gbs=a.hbm_gbs, pcie_gbs=a.pcie_gbs, mfu=a.mfu, gpus=a.gpus,
        pool_bytes=round(a.pool_gib * 2**30), host_bytes=round(a.host_tb * 1e12),
    )  # fmt: skip
    p = project(json.loads(Path(a.serving).read_text()), hw, TargetModel(), a.context)
    print(f"wrote {write_result({'benchmark': 'projection', **p}, a.out, inputs=[a.serving])}")
    md = markdown(p)
    Path(a.md or str(Path(a.out).with_suffix(".md"))).write_text(md)
    print(md)
    return 0
