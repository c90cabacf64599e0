"""Draws a run's training curve from DIR/history.jsonl: training LM loss and held-out loss
(nats/byte) against tokens seen, with the dense -> sparse switch marked.

    python -m training.target.plot DIR --out curve.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from training.target.trainer import HISTORY_FILE


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
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if train:
        ax.plot([h["tokens"] for h in train], [h["lm_loss"] for h in train], lw=1, label="train")
    if evals:
        ax.plot(
            [h["tokens"] for h in evals],
            [h["eval_loss"] for h in evals],
            "o-",
            label="held-out (sparse)",
        )
        last = evals[-1]
        ax.set_title(
            f"{Path(run_dir).name}: held-out {last['eval_loss'] / math.log(2):.3f} bits/byte, "
            f"ppl {last['eval_ppl']:.2f}"
        )
    switch = next((h["tokens"] for h in train if h.get("mode") == "sparse"), None)
    if switch is not None:
        ax.axvline(switch, color="grey", ls="--", lw=1, label="dense -> sparse")
    ax.set_xlabel("tokens (bytes)")
    ax.set_ylabel("loss (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend()
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
