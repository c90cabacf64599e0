"""Draws a run's training curve from DIR/history.jsonl: on the left the training LM loss (and
the MTP layer's, when it trains) and the held-out loss, in nats per token, against tokens
seen, with the dense -> sparse switch marked; on the right the last evaluation's held-out bits
per byte by position in the window (long context used reads as a falling line).

    python -m training.target.plot DIR --out curve.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from training.target.checkpoint import HISTORY_FILE


def read_history(run_dir: str | Path) -> list[dict]:
    lines = (Path(run_dir) / HISTORY_FILE).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def plot(run_dir: str | Path, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = read_history(run_dir)
    train = [h for h in history if "lm_loss" in h]
    evals = [h for h in history if "eval_loss" in h]
    fig, (ax, by_pos) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=(2, 1))
    tokens = [h["tokens"] for h in train]
    if train:
        ax.plot(tokens, [h["lm_loss"] for h in train], lw=1, label="train")
    mtp = [h for h in train if "mtp_loss" in h]
    if mtp:
        ax.plot([h["tokens"] for h in mtp], [h["mtp_loss"] for h in mtp], lw=1, label="MTP (t+2)")
    if evals:
        ax.plot([h["tokens"] for h in evals], [h["eval_loss"] for h in evals], "o-",
                label="held-out (sparse)")  # fmt: skip
        last = evals[-1]
        ax.set_title(
            f"{Path(run_dir).name}: held-out {last['eval_bpb']:.3f} bits/byte, "
            f"ppl {last['eval_ppl']:.2f}"
        )
        buckets = last.get("eval_bpb_by_position", {})
        if buckets:
            names = list(buckets)
            by_pos.plot(range(len(names)), [buckets[n] for n in names], "o-")
            by_pos.set_xticks(range(len(names)), names, rotation=30)
    switch = next((h["tokens"] for h in train if h.get("mode") == "sparse"), None)
    if switch is not None:
        ax.axvline(switch, color="grey", ls="--", lw=1, label="dense -> sparse")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    by_pos.set_xlabel("position in the window")
    by_pos.set_ylabel("held-out bits/byte")
    by_pos.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.target.plot", description=__doc__)
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None, help="PNG to write (default: RUN_DIR/curve.png)")
    a = ap.parse_args(argv)
    print(plot(a.run_dir, a.out or Path(a.run_dir) / "curve.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
