"""Builders shared by the training tests: the inference path's logits and selections, and a
tiny corpus."""

from __future__ import annotations

import json as json_module
from dataclasses import replace
from pathlib import Path

import torch

from dhisparse.family.presets import home_made
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig
from services.worker.model.decoder import LayerTrace
from services.worker.model.preset_decoder import DSAModel
from services.worker.serving.cache import KVCache
from services.worker.weights.model_io import build_model
from training.target.config import TrainConfig
from training.target.corpus import build_corpus


def random_model(index_topk: int, seed: int = 0, name: str = "tiny-indexshare") -> DSAModel:
    """A home-made preset (what training.target trains) in fp32, with random weights that mix
    context strongly (``io.init_weights``)."""
    return build_model(replace(home_made(name), index_topk=index_topk), seed=seed)


def random_tokens(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def inference_pass(
    model: DSAModel, tokens: torch.Tensor
) -> tuple[torch.Tensor, list[dict[int, torch.Tensor]]]:
    """What serving computes: one prefill of each sequence through a KV cache -> logits
    [B, T, V] and, per sequence, each layer's selection [T, k]."""
    b, t = tokens.shape
    logits, selections = [], []
    for i in range(b):
        kv = KVCache(model.cfg, KVCacheConfig(kv_pool_bytes=8 << 20, max_slots=1, max_model_len=t))
        assert kv.admit(0, "seq", t, t)
        trace: list[LayerTrace] = []
        hidden = model(tokens[i], ForwardBatch.build([0], [0], [t], "cpu"), kv, trace=trace)
        kv.close()
        logits.append(model.logits(hidden))
        selections.append({tr.layer: tr.selection for tr in trace})
    return torch.stack(logits), selections


def small_corpus(tmp: Path) -> Path:
    """The ``json`` package's sources (~60 KB, 5 files): the last file is held out."""
    path = tmp / "corpus.u8"
    if not path.exists():
        build_corpus(path, root=Path(json_module.__file__).parent)
    return path


def _micro(tmp: Path, base: str, name: str, index_topk: int) -> Path:
    """``base``'s topology at ~100K parameters, as a config JSON: CPU steps in milliseconds."""
    path = tmp / f"{name}.json"
    cfg = replace(
        home_made(base),
        name=name,
        d_model=64,
        n_heads=2,
        d_latent=32,
        d_rope=16,
        d_ff=128,
        n_index_heads=2,
        d_index=16,
        index_topk=index_topk,
    )
    cfg.save(path)
    return path


def micro_glm(tmp: Path) -> Path:
    """The IndexShare topology at the micro size."""
    return _micro(tmp, "tiny-indexshare", "micro-glm", index_topk=16)


def micro_dsv4(tmp: Path) -> Path:
    """The dsv4 topology (a source packing 4 tokens per row with a local window, Reuse and
    Reindex layers) at the micro size."""
    return _micro(tmp, "tiny-dsv4", "micro-dsv4", index_topk=8)


def tiny_run(out: Path, corpus: Path, **overrides) -> TrainConfig:
    cfg = TrainConfig(
        out=str(out),
        preset=str(micro_glm(out.parent)),
        corpus=str(corpus),
        steps=8,
        batch_size=4,
        seq_len=64,
        lr=3e-3,
        warmup=3,
        dense_frac=0.5,
        eval_every=0,
        eval_tokens=2048,
        ckpt_every=0,
        log_every=1,
        progress=False,
    )
    return replace(cfg, **overrides)


def open_in_transformers(path: Path) -> torch.nn.Module:
    """The model directory as transformers 5.17 opens it (fp32, eval), having checked that it
    loads unmodified: nothing missing or mismatched, and only the MTP layer's keys (layer N of
    config.json's N main layers) unexpected."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    layers = json_module.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert info["unexpected_keys"] and all(
        k.startswith(f"model.layers.{layers}.") for k in info["unexpected_keys"]
    ), info["unexpected_keys"]
    return model.eval()
