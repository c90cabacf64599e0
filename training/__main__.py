"""The shipped model's training, one resumable command:

    python -m training run --out DIR [--recipe glm-dsa-mini] [--budget-s 420] [--device cuda]

Runs the pipeline's next stages (``training.pipeline``: corpus, the target's phases, the
release) within ``--budget-s`` seconds, then prints where it stands as one JSON line; run it
again with the same DIR to go on. ``DIR/release/<name>`` is the model directory that ships.
The parts run alone too: ``python -m training.corpus``, ``python -m training.target``,
``python -m training.drafter.train``.
"""

from __future__ import annotations

import argparse
import json

import torch

from training.pipeline import PipelineConfig, run
from training.recipe import RECIPES, SHIPPED


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training", description=__doc__)
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the next stages of the pipeline")
    r.add_argument("--out", required=True)
    r.add_argument("--recipe", default=SHIPPED.name, choices=sorted(RECIPES))
    r.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="this invocation's wall time (start-up and trainer set-up come on top)",
    )
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--root", action="append", default=None, help="corpus source root")
    r.add_argument(
        "--min-stage-s",
        type=float,
        default=45.0,
        help="a training stage left less time than this waits for the next call",
    )
    r.add_argument(
        "--target-s",
        type=float,
        default=None,
        help="the target's training time over its phases (default: the recipe's); "
        "fixed by the run's first invocation",
    )
    r.add_argument(
        "--drafter-s",
        type=float,
        default=None,
        help="each drafter's training time (default: the recipe's)",
    )
    r.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    cfg = PipelineConfig(
        out=a.out,
        recipe=RECIPES[a.recipe],
        budget_s=a.budget_s,
        device=a.device,
        progress=not a.no_progress,
        corpus_roots=tuple(a.root) if a.root else None,
        min_stage_s=a.min_stage_s,
        target_s=a.target_s,
        drafter_s=a.drafter_s,
    )
    print(json.dumps(run(cfg)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
