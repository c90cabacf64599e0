"""``python -m bench ratios``: the short table of ratios that README's "Measured results" quotes,
read from the three result JSONs (resolver, capacity in three modes, speculation against plain
decoding), each row with the commit and the command that measured it. A result that is not
there reads "not yet measured"."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

Rows = list[tuple[str, str]]  # (what the ratio compares, its value)


def _x(v: float) -> str:
    return f"{v:.2f}×"


def _span(vs: list[float]) -> str:
    lo, hi = min(vs), max(vs)
    return _x(lo) if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}×"


def resolver_rows(doc: dict) -> Rows:
    rs = doc["results"]
    hit = sorted((r for r in rs if r["miss_rate"] == 0), key=lambda r: r["batch"])
    batches = " / ".join(str(r["batch"]) for r in hit)
    rows = [(
        f"resolver: all-hit resolve / plain gather, batch {batches}",
        " / ".join(_x(r["graph_total_ms"] / r["graph_plain_gather_ms"]) for r in hit),
    )]  # fmt: skip
    many = [r for r in rs if r["misses_per_step"] >= 4096 and r.get("recovery_over_bulk")]
    if many:
        rows.append((
            "resolver: host recovery / bulk copy, steps of ≥ 4,096 missed rows",
            f"{min(r['recovery_over_bulk'] for r in many):.0%}–"
            f"{max(r['recovery_over_bulk'] for r in many):.0%}",
        ))  # fmt: skip
    return rows


def capacity_rows(doc: dict) -> Rows:
    s = doc["summary"]
    rows = []
    if "capacity_sessions" in s:
        cap = s["capacity_sessions"]
        rows.append((
            "capacity: sessions held, adaptive / resident",
            f"{_x(s['capacity_ratio_adaptive_over_resident'])} ({cap['adaptive']} / "
            f"{cap['resident']})",
        ))  # fmt: skip
        fits = s["adaptive_vs_resident_where_resident_fits"]
        rows.append((f"capacity: adaptive / resident decode rate where resident fits (C = "
                     f"{', '.join(fits)})", _span(list(fits.values()))))  # fmt: skip
    if "adaptive_vs_hisparse" in s:
        vs = s["adaptive_vs_hisparse"]
        rows.append((f"capacity: adaptive / hisparse decode rate (C = {', '.join(vs)})",
                     _span(list(vs.values()))))  # fmt: skip
    return rows


def spec_rows(doc: dict) -> Rows:
    tps = {(r["config"], r["concurrency"]): r["decode_tokens_per_s"] for r in doc["results"]}
    cs = sorted({c for _, c in tps})
    drafters = sorted({k.split("/")[0] for k, _ in tps if k != "none"})
    rows = []
    for d in drafters:
        for policy in ("paper", "online"):
            if (f"{d}/{policy}", cs[0]) in tps:
                ratios = [_x(tps[(f"{d}/{policy}", c)] / tps[("none", c)]) for c in cs]
                rows.append((f"spec: {d} {policy} / plain decoding, C = "
                             f"{' / '.join(map(str, cs))}", " / ".join(ratios)))  # fmt: skip
    cells = [v for v in doc.get("summary", {}).values() if "within_3pct_of_the_better" in v]
    if cells:
        met = sum(bool(v["within_3pct_of_the_better"]) for v in cells)
        rows.append(("spec: online policy within 3% of the better of plain and paper",
                     f"{met} of {len(cells)} cells"))  # fmt: skip
    return rows


TABLES: dict[str, Callable[[dict], Rows]] = {
    "resolver": resolver_rows,
    "capacity": capacity_rows,
    "spec": spec_rows,
}


def table(paths: dict[str, Path]) -> str:
    """The markdown table over the results at ``paths`` (name in ``TABLES`` -> JSON path)."""
    lines = ["| ratio | measured | commit | command |", "|---|---|---|---|"]
    for name, path in paths.items():
        if not path.exists():
            lines.append(f"| {name} | not yet measured | – | – |")
            continue
        doc = json.loads(path.read_text())
        prov = doc.get("provenance") or {}
        commit = (prov.get("commit") or "–")[:12] + (" (dirty)" if prov.get("dirty") else "")
        command = f"`{prov['command']}`" if prov.get("command") else "–"
        for what, value in TABLES[name](doc):
            lines.append(f"| {what} | {value} | {commit} | {command} |")
    return "\n".join(lines) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    for name in TABLES:
        ap.add_argument(f"--{name}", default=f"docs/results/{name}.json", help="result JSON")


def run(args: argparse.Namespace) -> int:
    print(table({name: Path(getattr(args, name)) for name in TABLES}), end="")
    return 0
