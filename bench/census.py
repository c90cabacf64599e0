"""``python -m bench census``: where a trained model's selections fall, against the same model
with random weights (issue 26's selection census).

    python -m bench census --contexts 4096,16384 --out docs/results/census.json

For each context L of ``--contexts`` and each of the weights (the model's, and random ones of
its config at the same k and B, ``random_twin``), one prompt of L ids of the model's held-out
files (``bench/heldout.py``) is prefilled and ``--decode-steps`` greedy tokens decoded:

- **selection**, in a resident cache with the model alone: per decode step and index producer,
  the k positions selected (written to ``--trace`` for later benchmarks to replay); the share
  of them more than ``--far`` tokens behind the query; per layer (producers and the followers
  that attend their leader's selection over payloads of their own), the *top-k recall of the
  dense attention mass*: the softmax mass, over every visible row, of the rows selected (mean
  over heads), from the query the layer attended with;
- **census**, through the engine in ``hisparse`` and ``adaptive`` mode (a pool of
  ``--pool-mib``, B rows of hot cache per request and source): the decode steps' selected rows
  resolved direct (tail or resident history) / from the hot cache / from the host, and the hot
  cache's hit rate hot / (hot + host), after ``--warmup-steps`` steps that fill the hot cache
  from empty. The engine's greedy tokens are checked against the
  resident run's (the hierarchy is exact).

The model's ``index_topk`` is k, and must be at most L / 8."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bench.core import UsageError
from bench.core.progress import progress
from bench.heldout import heldout_prompts
from dhisparse.family.hf_dir import hf_family, read_config
from dhisparse.family.presets import FamilyPreset
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig, bytes_per_token
from services.worker.request.request import SamplingParams
from services.worker.serving.cache import KVCache
from services.worker.weights.hf_export import save_hf_checkpoint
from services.worker.weights.model_io import build_model, load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PAD = np.iinfo(np.uint16).max  # a trace's padding (positions below it: contexts to 64K)
CHUNK = 4096  # prefill tokens per pass of the resident run


def random_twin(model_dir: Path, dst: Path, seed: int) -> Path:
    """A model directory of ``model_dir``'s config (no MTP layer, bf16 storage) and tokenizer
    with seeded random weights (``io.build_model``'s initialisation)."""
    config = {k: v for k, v in read_config(model_dir).items() if k != "quantization_config"}
    config["num_nextn_predict_layers"] = 0
    name = f"{model_dir.resolve().name}-random"
    config["_name_or_path"] = name
    mask = hf_family(model_dir)[1].mask_token_id
    model = build_model(FamilyPreset(name, config, mask), seed=seed, dtype=torch.bfloat16)
    save_hf_checkpoint(model, dst, config)
    for f in TOKENIZER_FILES:
        if (model_dir / f).exists():
            shutil.copy(model_dir / f, dst / f)
    return dst


class AttentionProbe:
    """Wraps a model's ``attention_fn``: while ``on``, keeps each call's (queries, scale) in
    layer order (one call a layer when the cache stores rows as computed)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.on = False
        self.calls: list[tuple[torch.Tensor, float]] = []

    def __call__(self, q, pool, at, d_v, scale, win_pool=None, win_locs=None):
        if self.on:
            self.calls.append((q, scale))
        return self.fn(q, pool, at, d_v, scale, win_pool, win_locs)


@dataclass
class Selection:
    """The resident run's selections over the decode steps."""

    tokens: list[int] = field(default_factory=list)  # greedy, the first from the prefill
    trace: list[np.ndarray] = field(default_factory=list)  # per step [producers, k] uint16
    far: list[float] = field(default_factory=list)  # per (step, producer)
    mass: dict[int, list[float]] = field(default_factory=dict)  # layer -> per step

    def summary(self) -> dict:
        by_layer = {str(i): statistics.fmean(m) for i, m in sorted(self.mass.items())}
        return {
            "far_share": statistics.fmean(self.far),
            "dense_mass_recall": statistics.fmean(v for m in self.mass.values() for v in m),
            "dense_mass_recall_min": min(v for m in self.mass.values() for v in m),
            "dense_mass_recall_by_layer": by_layer,
        }


def select(model, prompt: list[int], steps: int, k: int, far: int, device: str) -> Selection:
    """Prefills ``prompt`` in a resident cache (chunks of ``CHUNK``), then decodes ``steps``
    greedy tokens with the attention probe on (module docstring)."""
    cfg = model.cfg
    n = len(prompt)
    kv = KVCache(cfg, KVCacheConfig(
        max_slots=1, max_model_len=n + steps + 1, kv_pool_bytes=_pool_bytes(cfg, n + steps + 1),
        max_prefill_tokens=CHUNK, dtype=model.dtype, device=device,
        page_size=16,
    ))  # fmt: skip
    assert kv.admit(0, "census", n, n + steps + 1)
    probe = AttentionProbe(model.attention_fn)
    model.attention_fn = probe
    out = Selection()
    producers = list(cfg.index_producers)
    ids = torch.tensor(prompt, device=device)
    try:
        for a in range(0, n, CHUNK):
            chunk = ids[a : a + CHUNK]
            batch = ForwardBatch.build([0], [a], [len(chunk)], device, prefill=True)
            hidden = model(chunk, batch, kv)
            kv.commit(batch, [a + len(chunk)])
        token = int(model.logits(hidden[-1:]).argmax(-1))
        for step in range(steps):
            out.tokens.append(token)
            pos = n + step
            assert kv.ensure(0, pos + 1)
            batch = ForwardBatch.build([0], [pos], [1], device)
            sel: dict[int, torch.Tensor] = {}
            probe.calls.clear()
            probe.on = True
            hidden = model(torch.tensor([token], device=device), batch, kv, selections=sel)
            probe.on = False
            kv.commit(batch, [pos + 1])
            assert len(probe.calls) == cfg.n_layers, "one attention call per layer"
            rows = torch.stack([sel[i][0] for i in producers])  # [P, k]
            assert rows.shape[1] == k, (rows.shape, k)
            valid = rows >= 0
            out.far += ((pos - rows > far) & valid).sum(1).div(valid.sum(1)).tolist()
            out.trace.append(torch.where(valid, rows, PAD).cpu().numpy().astype(np.uint16))
            every = torch.arange(pos + 1, device=device).view(1, -1)
            for i, (q, scale) in enumerate(probe.calls):
                s = cfg.layers[i].source
                pool, at = kv.attention_rows(s, kv.payload.resolve(i, s, batch, every))
                scores = torch.einsum("hd,kd->hk", q[0].float(), pool[at[0]].float()) * scale
                probs = torch.softmax(scores, dim=-1)
                chosen = sel[i][0]
                mass = probs[:, chosen[chosen >= 0]].sum(-1).mean()
                out.mass.setdefault(i, []).append(float(mass))
            token = int(model.logits(hidden).argmax(-1))
    finally:
        model.attention_fn = probe.fn
        kv.close()
    return out


def _pool_bytes(cfg, tokens: int) -> int:
    """A resident pool for ``tokens`` of one request, every source's rows and keys (fp32)."""
    return int(bytes_per_token(cfg, 4, payload=True) * (tokens + 64) * 1.25) + (16 << 20)


def census(args, model: str, prompt: list[int], mode: str) -> dict:
    """The engine's census over the decode steps of one request (module docstring)."""
    n = len(prompt)
    eng = Engine(EngineConfig(
        model=model, device=args.device, dtype=args.dtype, mode=mode,
        kv_pool_mib=args.pool_mib, host_arena_mib=args.host_mib,
        hot_cache_rows=args.hot_cache_rows, max_num_seqs=1,
        max_model_len=n + args.decode_steps + 16, max_prefill_tokens=8192,
        durable_sessions=False,
    ))  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps, ignore_eos=True)
        req = eng.add_request("census", prompt, params)
        # the prefill (its chunks, which emit the first token) and the warm-up steps that fill
        # the hot cache from empty
        while len(req.output_ids) < 1 + args.warmup_steps:
            eng.step()
        before = eng.kv.payload.census
        while eng.has_work():
            eng.step()
        after = eng.kv.payload.census
        measured = args.decode_steps - 1 - args.warmup_steps  # steps between the two counts
        direct, hot, host = (getattr(after, f) - getattr(before, f) for f in ("direct", "hot",
                                                                              "host"))  # fmt: skip
        total = direct + hot + host
        return {
            "direct": direct / total, "hot": hot / total, "host": host / total,
            "hot_hit_rate": hot / (hot + host) if hot + host else None,
            "rows_copied_per_step": (after.copied - before.copied) / measured,
            "layout": eng.kv.layout(), "tokens": list(req.output_ids),
        }  # fmt: skip
    finally:
        eng.close()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="models/glm-dsa-mini")
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--warmup-steps", type=int, default=4, help="decode steps the census skips")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument(
        "--pool-mib", type=float, default=256.0, help="the engine's KV pool (make run's)"
    )
    ap.add_argument("--host-mib", type=float, default=2048.0)
    ap.add_argument("--hot-cache-rows", type=int, default=None, help="B (default 2k)")
    ap.add_argument("--far", type=int, default=1024, help="'far back': more tokens than this")
    ap.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    ap.add_argument("--trace", default="docs/results/census_trace.npz")
    ap.add_argument("--out", default="docs/results/census.json")


def run(args: argparse.Namespace) -> dict:
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.decode_steps - 1 - args.warmup_steps < 1:
        raise UsageError("--decode-steps must exceed --warmup-steps + 1: the census counts the "
                         "decode steps after the warm-up")  # fmt: skip
    model_dir = Path(args.model)
    cfg = hf_family(model_dir)[1]
    k = cfg.index_topk
    if any(k > c // 8 for c in contexts):
        raise UsageError(f"k = {k} exceeds context / 8 at {min(contexts)} tokens")
    rows, traces = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        weights = {"trained": model_dir, "random": random_twin(model_dir, Path(tmp), args.seed)}
        for (name, path), length in progress(
            [(w, c) for w in weights.items() for c in contexts], "census"
        ):
            prompt = heldout_prompts(model_dir, 1, length, 12345 + length)[0]
            model = load_model(path, args.device, DTYPES[args.dtype])
            sel = select(model, prompt, args.decode_steps, k, args.far, args.device)
            del model
            row = {"weights": name, "context": length, "k": k, **sel.summary()}
            for mode in ("hisparse", "adaptive"):
                c = census(args, str(path), prompt, mode)
                row[mode] = {key: v for key, v in c.items() if key != "tokens"}
                row[mode]["tokens_equal_resident"] = c["tokens"] == sel.tokens
            rows.append(row)
            traces[f"{name}_{length}"] = np.stack(sel.trace)
            print(json.dumps(row), flush=True)
    np.savez_compressed(args.trace, **traces)
    return {
        "benchmark": "census",
        "target": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "decode_steps": args.decode_steps,
        "warmup_steps": args.warmup_steps,
        "pool_mib": args.pool_mib,
        "far": args.far,
        "trace": args.trace,
        "rows": rows,
        # the paper's (GLM-5.3 at C = 8): direct / hot / host
        "paper": {"direct": 0.697, "hot": 0.303, "host": 0.0005},
    }
