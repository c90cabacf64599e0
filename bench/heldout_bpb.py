"""Bits per byte of a shipped model on its held-out files, with the weights that ship (FP8 as
stored) and the attention it serves with (the indexer's top-k), through the serving model's
own prefill (``python -m bench heldout-bpb``).

    python -m bench heldout-bpb --model models/glm-dsa-mini --out docs/results/heldout_bpb.json

Windows of ``--seq-len`` + 1 ids overlap by one (every held-out id after the first is
predicted once, as training's evaluation does); the result is overall and by position bucket
(``training/target/evaluate.py``). The held-out text is this machine's standard library
(``bench/heldout.py``): the training run's own figures (``training.json``) are on the corpus
machine's copies, so the two are close, not identical."""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.heldout import heldout_of
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig
from services.worker.serving.cache import KVCache
from services.worker.weights.model_io import load_model
from training.target.data import heldout_windows
from training.target.evaluate import heldout_metrics


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="models/glm-dsa-mini")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=1 << 20, help="predictions, at most")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="docs/results/heldout_bpb.json")


def run(args: argparse.Namespace) -> dict:
    held = heldout_of(args.model)
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model, device=args.device, dtype=dtype)
    windows = heldout_windows(held.stream, args.seq_len + 1, args.max_tokens)
    t = args.seq_len
    bar = tqdm(total=len(windows), desc="held-out windows", unit="window")

    @torch.no_grad()
    def logits_of(tokens: torch.Tensor) -> torch.Tensor:
        out = []
        for row in tokens:
            kv_cfg = KVCacheConfig(
                kv_pool_bytes=256 << 20, max_slots=1, max_model_len=t, max_prefill_tokens=t,
                dtype=dtype, device=args.device,
            )  # fmt: skip
            kv = KVCache(model.cfg, kv_cfg)
            assert kv.admit(0, "window", t, t)
            batch = ForwardBatch.build([0], [0], [t], args.device)
            hidden = model(row.to(args.device), batch, kv)
            kv.close()
            out.append(model.logits(hidden).float())
            bar.update(1)
        return torch.stack(out)

    t0 = time.perf_counter()
    metrics = heldout_metrics(logits_of, windows.to(args.device), held.byte_lengths, 1)
    bar.close()
    return {
        "benchmark": "heldout-bpb",
        "model": args.model,
        "weights": "as shipped (FP8 where stored)",
        "dtype": args.dtype,
        "attention": f"sparse (index_topk {model.cfg.index_topk})",
        "machine": torch.cuda.get_device_name() if args.device == "cuda" else platform.machine(),
        "seq_len": t,
        "windows": len(windows),
        "predictions": len(windows) * t,
        "heldout_files": list(held.files),
        "heldout_ids": len(held.stream),
        "heldout_bytes": held.bytes,
        "python_read": held.python,
        "corpus_python": held.corpus_python,
        "wall_s": time.perf_counter() - t0,
        **metrics,
        "model_files": sorted(p.name for p in Path(args.model).glob("*.safetensors")),
    }
