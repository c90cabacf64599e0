"""Trains the shipped model pair end to end (issue 10): the ``glm-10m`` sparse-attention target
from scratch on the packed stdlib corpus, then its DFlash, DSpark and DFlash2 drafters against
it, each within a wall-clock budget, and exports what ships.

    python -m bench train-pair --out models/glm-10m --corpus data/stdlib.u8 \\
        --target-budget-s 280 --drafter-budget-s 55

Writes OUT/ (config.json, sharded bf16 weights, training.json, history.jsonl), OUT/drafters/
{dflash,dspark,dflash2}/ (weights, config, history) and the training curve PNG. The target run
is resumable (``python -m training.target --out WORK/target --resume``); its checkpoint
stays in ``--work``. Acceptance is measured separately by ``python -m bench acceptance``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRAFTERS = ("dflash", "dspark", "dflash2")
SHIPPED = ("config.json", "model.safetensors", "model.safetensors.index.json")


def sh(*args: str) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="models/glm-10m")
    ap.add_argument("--work", default="out/train", help="checkpoints and logs")
    ap.add_argument("--corpus", default="data/stdlib.u8")
    ap.add_argument("--preset", default="glm-10m")
    ap.add_argument("--target-budget-s", type=float, default=280)
    ap.add_argument("--target-args", default="", help="extra flags for the target trainer")
    ap.add_argument("--drafter-budget-s", type=float, default=55)
    ap.add_argument("--drafter-batch", type=int, default=16)
    ap.add_argument("--drafter-seq-len", type=int, default=512)
    ap.add_argument("--kinds", default=",".join(DRAFTERS))
    ap.add_argument("--skip-target", action="store_true", help="reuse OUT's target weights")


def run(args: argparse.Namespace) -> int:
    out, work = Path(args.out), Path(args.work)
    if not Path(args.corpus).exists():
        sh("-m", "training.target.corpus", "--out", args.corpus)
    if not args.skip_target:
        tdir = work / "target"
        sh(
            "-m", "training.target", "--out", str(tdir), "--preset", args.preset,
            "--corpus", args.corpus, "--steps", "0", "--time-budget-s", str(args.target_budget_s),
            *args.target_args.split(),
        )  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        for f in (tdir / "model").iterdir():
            shutil.copy2(f, out / f.name)
        for f in ("training.json", "history.jsonl"):
            shutil.copy2(tdir / f, out / f)
        sh("-m", "training.target.plot", str(tdir), "--out", str(out / "training.png"))
    for kind in args.kinds.split(","):
        ddir = out / "drafters" / kind
        sh(
            "-m", "training.drafter.train", "--target", str(out), "--drafter", kind,
            "--corpus", args.corpus, "--data", "corpus", "--steps", "1000000",
            "--time-budget-s", str(args.drafter_budget_s), "--batch-size", str(args.drafter_batch),
            "--seq-len", str(args.drafter_seq_len), "--blocks-per-seq", "32", "--no-progress",
            "--out", str(ddir),
        )  # fmt: skip
        (ddir / "trainer.pt").unlink(missing_ok=True)  # optimizer state: not shipped
    sizes = {
        str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()
    }
    print(json.dumps(sizes, indent=2))
    return 0
