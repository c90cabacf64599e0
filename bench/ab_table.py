"""A table of capacity runs side by side (``bench/gpu_run.sh ab``): per run and concurrency,
each mode's aggregate and median decode rate, adaptive / hisparse, the garbage collector's
pauses inside each mode's steps, and where adaptive's decode time went by step kind.

    python bench/ab_table.py docs/results/ab_*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(path: Path) -> list[str]:
    out = json.loads(path.read_text())
    by = {m["mode"]: {r["concurrency"]: r for r in m["rows"]} for m in out["modes"]}
    lines = []
    for c in sorted(by.get("adaptive", {})):
        a, h = by["adaptive"][c], by.get("hisparse", {}).get(c)
        ratio = a["decode_tokens_per_s"] / h["decode_tokens_per_s"] if h else float("nan")
        med = (
            a["decode_tokens_per_s_median"] / h["decode_tokens_per_s_median"] if h else float("nan")
        )
        split = ", ".join(
            f"{k} {a['steps_by_kind'][k]}/{a['decode_s_by_step'][k]:.2f}s"
            for k in a["decode_s_by_step"]
            if a["steps_by_kind"][k]
        )
        hs = h["decode_tokens_per_s"] if h else float("nan")
        gc = (  # the collector's pauses inside each mode's steps, where recorded
            f"{h['gc_pause_s']:.3f} / {a['gc_pause_s']:.3f}"
            if h and "gc_pause_s" in a and "gc_pause_s" in h
            else "-"
        )
        lines.append(
            f"| {path.stem} | {c} | {hs:,.0f} | {a['decode_tokens_per_s']:,.0f} | {ratio:.3f} "
            f"| {med:.3f} | {gc} | {split} |"
        )
    return lines


def main(paths: list[str]) -> int:
    print("| run | C | hisparse tok/s | adaptive tok/s | adaptive/hisparse | median ratio "
          "| GC pause s (his / ada) | adaptive steps/decode s by kind |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for p in paths:
        try:
            print("\n".join(rows(Path(p))))
        except (OSError, KeyError, ValueError) as e:
            print(f"| {Path(p).stem} | failed: {e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
