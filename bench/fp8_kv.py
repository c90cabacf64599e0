"""``python -m bench fp8-kv``: what ``--kv-cache-dtype fp8`` costs against KV in the serving
dtype, end to end on a preset (CPU, seconds): the indexer's top-k selection recall and the
relative logit error, teacher-forced (both caches are fed the same tokens: the reference
run's greedy ones), so every position compares one step, not a diverged continuation.

Per producer layer and query token that sees more rows than k (else every row is selected
in both), recall = |S_fp8 ∩ S_ref| / |S_ref|; per position, the relative L2 error of the fp8
run's logits against the reference's, and whether the argmax agrees. Prefill positions (the
whole prompt) and decode steps are reported apart. Results in docs/fp8_kv.md."""

from __future__ import annotations

import argparse
import importlib
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dhisparse.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig
from services.worker.serving.cache import KVCache
from services.worker.weights.model_io import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# text prompts (``--text``): modules of the running Python's standard library, through the
# model directory's tokenizer (bytes for a preset); heapq is in the shipped model's training
# split, textwrap and fractions are held out (its corpus.json)
TEXTS = ("heapq", "textwrap", "fractions")


@dataclass
class Comparison:
    """fp8 KV against KV in the serving dtype, over one run."""

    recall: list[float] = field(default_factory=list)  # per (layer, query) with > k rows
    by_layer: dict[int, list[float]] = field(default_factory=dict)  # the same, per producer
    prefill_err: list[float] = field(default_factory=list)  # per prompt position
    decode_err: list[float] = field(default_factory=list)  # per decode step and request
    agree: list[bool] = field(default_factory=list)  # decode argmax agrees

    def summary(self) -> dict[str, float]:
        q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
        return {
            "recall_mean": statistics.fmean(self.recall),
            "recall_p05": q(self.recall, 0.05),
            "recall_min": min(self.recall),
            "prefill_logit_rel_err_mean": statistics.fmean(self.prefill_err),
            "prefill_logit_rel_err_max": max(self.prefill_err),
            "decode_logit_rel_err_mean": statistics.fmean(self.decode_err),
            "decode_logit_rel_err_max": max(self.decode_err),
            "decode_argmax_agreement": statistics.fmean(self.agree),
            "queries": len(self.recall),
            # the first producer's queries see the reference's own inputs (teacher-forced
            # tokens, no fp8 layer before it): its recall is the keys' quantization alone
            **{f"recall_mean_layer{i}": statistics.fmean(r) for i, r in self.by_layer.items()},
        }


def _recall(ref: torch.Tensor, got: torch.Tensor, visible: torch.Tensor, k: int) -> list[float]:
    out = []
    for a, b, n in zip(ref.tolist(), got.tolist(), visible.tolist(), strict=True):
        if n > k:
            out.append(len(set(a) & set(b)) / k)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return ((b - a).norm(dim=-1) / a.norm(dim=-1)).tolist()


def prompts_of(
    lens: tuple[int, ...], seed: int, text: bool, tokenizer: Tokenizer | None = None
) -> list[torch.Tensor]:
    """Random bytes, or ``lens[i]`` ids of ``TEXTS[i]`` (through ``tokenizer``, default the
    byte tokenizer) from an offset the seed picks."""
    g = torch.Generator().manual_seed(seed)
    if not text:
        return [torch.randint(0, 256, (n,), generator=g) for n in lens]
    tok = tokenizer or ByteTokenizer()
    out = []
    for i, n in enumerate(lens):
        module = importlib.import_module(TEXTS[i % len(TEXTS)])
        ids = tok.encode(Path(module.__file__).read_text())
        start = int(torch.randint(0, len(ids) - n, (1,), generator=g))
        out.append(torch.tensor(ids[start : start + n]))
    return out


def compare(
    name: str = "tiny-glm",
    seed: int = 0,
    lens: tuple[int, ...] = (300, 180, 420),
    steps: int = 16,
    dtype: torch.dtype = torch.float32,
    text: bool = False,
) -> Comparison:
    """Prefills ``lens`` prompts together (random bytes, or stdlib source with ``text``),
    then decodes ``steps`` greedy tokens of the reference run, in a resident cache in the
    serving ``dtype`` and in an fp8 one, side by side. ``name``: a preset (weights seeded by
    ``seed``) or a model directory."""
    model = load_model(name, dtype=dtype, seed=seed)
    cfg = model.cfg
    k = cfg.index_topk
    caches = []
    for kv_dtype in ("auto", "fp8"):
        kv_cfg = KVCacheConfig(
            max_slots=len(lens), max_model_len=max(lens) + steps + 1, kv_pool_bytes=64 << 20,
            max_prefill_tokens=sum(lens), dtype=dtype, kv_cache_dtype=kv_dtype,
        )  # fmt: skip
        caches.append(KVCache(cfg, kv_cfg))
    prompts = prompts_of(lens, seed, text, load_tokenizer(name if Path(name).is_dir() else None))
    slots = list(range(len(lens)))
    for kv in caches:
        for s, n in zip(slots, lens, strict=True):
            assert kv.admit(s, f"r{s}", n, n + steps + 1)
    out = Comparison()
    ids, starts, chunk = torch.cat(prompts), [0] * len(lens), list(lens)
    for step in range(steps + 1):
        batch = ForwardBatch.build(slots, starts, chunk, "cpu")
        logits, picks = [], []
        for kv in caches:
            if step:
                for s, n in zip(slots, starts, strict=True):
                    assert kv.ensure(s, n + 1)
            sel: dict[int, torch.Tensor] = {}
            hidden = model(ids, batch, kv, selections=sel)
            kv.commit(batch, [a + b for a, b in zip(starts, chunk, strict=True)])
            logits.append(model.logits(hidden))
            picks.append(sel)
        for i in cfg.index_producers:
            s = cfg.layers[i].source
            visible = (batch.positions + 1) // cfg.sources[s].compress
            got = _recall(picks[0][i], picks[1][i], visible, k)
            out.recall += got
            out.by_layer.setdefault(i, []).extend(got)
        err = _rel(logits[0], logits[1])
        if step == 0:
            out.prefill_err += err
            last = logits[0][batch.last_token_index]
            got = logits[1][batch.last_token_index]
        else:
            out.decode_err += err
            last, got = logits[0], logits[1]
        out.agree += (last.argmax(-1) == got.argmax(-1)).tolist()
        ids = last.argmax(-1)  # the reference's greedy tokens feed both caches
        starts = [a + b for a, b in zip(starts, chunk, strict=True)]
        chunk = [1] * len(lens)
    for kv in caches:
        kv.close()
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="tiny-glm", help="a preset or a model directory")
    ap.add_argument("--text", action="store_true", help="stdlib source prompts, not random")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="serving dtype")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="decode steps after the prompts")


def run(args: argparse.Namespace) -> int:
    rows = []
    for seed in range(args.seeds):
        r = compare(
            args.model, seed, steps=args.steps, dtype=DTYPES[args.dtype], text=args.text
        ).summary()
        rows.append(r)
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in r.items()))
    keys = rows[0].keys()
    mean = {k: statistics.fmean(r[k] for r in rows) for k in keys}
    what = "text" if args.text else "random bytes"
    print(f"{args.model} {args.dtype} ({what}), fp8 KV vs {args.dtype} KV, mean of "
          f"{args.seeds} seeds: "
          + ", ".join(f"{k} {v:.4f}" for k, v in mean.items()))  # fmt: skip
    return 0
