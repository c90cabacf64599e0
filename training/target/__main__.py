"""Trains a sparse-attention target model from scratch on the packed stdlib corpus.

    python -m training.target --out DIR [--preset glm-10m | config.json] [--corpus stdlib.u8 |
        TOKENS_DIR] [--steps N | --steps 0 --time-budget-s S] [--resume] [--init-from RUN] ...

Writes DIR/history.jsonl (per logged step: loss, lm_loss, idx_kl, mtp_loss and the experts'
least / most share for a real family, lr, tokens, elapsed; per evaluation: held-out eval_loss
in nats/token, eval_bpb in bits/byte, eval_ppl, eval_bpb_by_position), DIR/ckpt.pt
(resumable), and at the end DIR/model/ (bf16 weights, sharded: the home-made format, or a
Hugging Face checkpoint for a config.json of DeepSeek-V3.2 / GLM-5; ``load_model(DIR/model)``)
and DIR/training.json. Plot with ``python -m training.target.plot DIR --out curve.png``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

import torch

from dhisparse.family.presets import PRESETS
from training.target.config import TrainConfig
from training.target.loop import train

CUDA_EVAL_TOKENS = 1 << 20  # all of the stdlib corpus's held-out part (~300 KB)
CPU_EVAL_TOKENS = 1 << 14  # a CPU smoke run should not spend minutes evaluating


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    ap = argparse.ArgumentParser(prog="python -m training.target", description=__doc__)
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.name != "out"}
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--preset",
        default=defaults["preset"],
        help=f"{', '.join(sorted(PRESETS))} or a model config JSON",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--init-from", default=None, help="a run directory whose weights start this")
    ap.add_argument("--betas", type=float, nargs=2, default=defaults["betas"])
    for flag in ("resume", "compile"):
        ap.add_argument(f"--{flag}", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--eval-tokens",
        type=int,
        default=None,
        help=f"held-out predictions per evaluation (default: {CUDA_EVAL_TOKENS} on CUDA, "
        f"{CPU_EVAL_TOKENS} on the CPU)",
    )
    special = {"preset", "device", "corpus", "init_from", "betas", "resume", "compile", "progress"}
    for name, value in defaults.items():
        if name in special or name == "eval_tokens":
            continue
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    a = vars(ap.parse_args(argv))
    a["progress"] = not a.pop("no_progress")
    if a["eval_tokens"] is None:
        cuda = a["device"].startswith("cuda")
        a["eval_tokens"] = CUDA_EVAL_TOKENS if cuda else CPU_EVAL_TOKENS
    a["betas"] = tuple(a["betas"])
    return TrainConfig(**a)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    tr = train(cfg)
    evals = [h for h in tr.history if "eval_loss" in h]
    summary = {"out": cfg.out, "step": tr.step, "planned_steps": tr.total}
    if evals:
        summary.update({k: evals[-1][k] for k in ("eval_loss", "eval_bpb", "eval_ppl")})
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
