"""``dhisparse verify --model DIR``: our engine's model against transformers' on the first N
layers of a checkpoint, for operators whose checkpoints the project never loads itself.

Exit status: 0 when every layer passes (selection agreement and logit error within the
thresholds), 1 when one does not, 2 when the model cannot be verified (config, checkpoint,
prompt or transformers missing)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.worker.verify.compare import Verification

# what makes a model unverifiable: config, checkpoint, prompt, transformers or device
_ERRORS = (ValueError, OSError, ImportError, RuntimeError)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", required=True, help="Hugging Face model directory")
    p.add_argument("--layers", type=int, default=2, help="verify the first N layers (default 2)")
    p.add_argument(
        "--tokens",
        type=int,
        default=256,
        help="tokens in the sequence (default 256); above index_topk the selection is sparse",
    )
    p.add_argument("--prompt-file", help="text encoded with DIR's tokenizer (default: random ids)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random ids")
    p.add_argument("--device", default="cpu", help="torch device for both models (default cpu)")
    p.add_argument("--min-agreement", type=float, default=0.99)
    p.add_argument("--max-logit-error", type=float, default=1e-3)
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print JSON")


def prompt_ids(model_dir: str, args: argparse.Namespace, vocab_size: int) -> list[int]:
    """The first ``--tokens`` ids of the prompt file (DIR's tokenizer.json, else the byte
    tokenizer), or seeded uniform random ids below the vocabulary size."""
    if args.prompt_file is None:
        import torch

        g = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, vocab_size, (args.tokens,), generator=g).tolist()
    from dhisparse.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    ids = tok.encode_prompt(Path(args.prompt_file).read_text())
    ids = ids[: args.tokens]
    if not ids:
        raise ValueError(f"{args.prompt_file}: no tokens")
    if max(ids) >= vocab_size:
        raise ValueError(f"{args.prompt_file}: token id {max(ids)} >= vocab_size {vocab_size}")
    return ids


def main(args: argparse.Namespace) -> int:
    if args.layers < 1 or args.tokens < 1:
        print("dhisparse verify: error: --layers and --tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        import torch

        from dhisparse.family.hf_config import parse_config
        from services.worker.verify.compare import verify
        from services.worker.weights.hf_load import read_config

        if args.threads:
            torch.set_num_threads(args.threads)
        cfg = parse_config(read_config(args.model))
        ids = torch.tensor(prompt_ids(args.model, args, cfg.vocab_size))
        result = verify(args.model, min(args.layers, cfg.num_layers), ids, args.device)
    except _ERRORS as exc:
        print(f"dhisparse verify: error: {exc}", file=sys.stderr)
        return 2
    passed = result.passes(args.min_agreement, args.max_logit_error)
    if args.json:
        out = result.as_dict() | {
            "min_agreement": args.min_agreement,
            "max_logit_error": args.max_logit_error,
            "passed": passed,
        }
        print(json.dumps(out, indent=2))
    else:
        sys.stdout.write(render(result, args.min_agreement, args.max_logit_error, passed))
    return 0 if passed else 1


def render(result: Verification, min_agreement: float, max_logit_error: float, passed: bool) -> str:
    n = len(result.layers)
    lines = [
        f"dhisparse verify: {result.model} ({result.family}), layers 0-{n - 1} of "
        f"{result.model_layers}, {result.tokens} tokens, float32 on {result.device}",
        f"{'layer':>5}  {'index':<14}{'agreement':>10}{'logit error':>13}{'top-1':>8}",
    ]
    for c in result.layers:
        index = c.index if c.index == "producer" else f"follows {c.leader}"
        agreed = "-" if c.agreement is None else f"{c.agreement:.4f}"
        mark = "" if c.passes(min_agreement, max_logit_error) else "  FAIL"
        lines.append(
            f"{c.layer:>5}  {index:<14}{agreed:>10}{c.logit_error:>13.2e}{c.top1:>8.3f}{mark}"
        )
    verdict = "pass" if passed else "FAIL"
    lines.append(
        f"{verdict}: agreement >= {min_agreement} and logit error <= {max_logit_error:g} "
        "on every layer"
    )
    return "\n".join(lines) + "\n"
