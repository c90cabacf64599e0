"""The model directory that ships: a Hugging Face ``glm_moe_dsa`` checkpoint a user opens with
transformers or serves with dhisparse, as small as the format allows.

- Weights in FP8 (e4m3, 128x128 blocks, fp32 scales: the released layout) wherever both of a
  projection's dimensions are multiples of 128; the others stay bf16 and are named in the
  ``quantization_config``'s ``modules_to_not_convert`` (transformers' FP8 dequantizer takes
  only whole blocks); embeddings, norms, routers and ``weights_proj`` stay as they are, as in
  the released checkpoints;
- the tokenizer, its chat template and ``generation_config.json`` (ending on ``<|endoftext|>``
  and on the chat roles that start the next turn, as GLM-5 lists its three);
- each training phase's summary, history and loss plot, and the corpus's description
  (held-out files included)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch

from dhisparse.family.generation import GENERATION_CONFIG
from dhisparse.family.hf_config import parse_config, topology
from dhisparse.family.quantization_config import FP8_EDGE
from services.worker.model.mla_decoder import FP32_PARAMS, MLADecoder
from services.worker.weights.checkpoint import Checkpoint
from services.worker.weights.fp8_writer import quantizes, write_fp8_checkpoint
from services.worker.weights.hf_export import checkpoint_tensors
from training.corpus.tokens import META, TOKENIZER_DIR
from training.target.checkpoint import HISTORY_FILE
from training.target.plot import plot

STOP_ROLES = ("<|user|>", "<|observation|>")  # a turn ends where the next one begins
_WEIGHT = re.compile(r"(.+)\.weight$")


def ragged(shape: tuple[int, ...]) -> bool:
    """Whether a weight has a dimension that is not a multiple of the FP8 block."""
    return any(d % FP8_EDGE for d in shape)


def stored_bytes(name: str, shape: tuple[int, ...], dtype_bytes: int = 2) -> int:
    """What one checkpoint tensor of the release weighs on disk: FP8 values with fp32 block
    scales where the writer quantizes it and its blocks are whole; fp32 for the tensors kept
    in fp32 (``weights_proj``, the router biases); else ``dtype_bytes`` per element."""
    numel = math.prod(shape)
    if quantizes(name, shape, "BF16") and not ragged(shape):
        return numel + math.prod(-(-d // FP8_EDGE) for d in shape) * 4
    if name.endswith(FP32_PARAMS):
        return numel * 4
    return numel * dtype_bytes


def release_bytes(config: dict) -> dict[str, int]:
    """The bytes of the release of a model of ``config`` (a config.json dict): the target's
    and its MTP layer's (built on the meta device: no weights needed)."""
    cfg = parse_config(config)
    with torch.device("meta"):
        model = MLADecoder(cfg, topology(cfg, "size", mtp=cfg.mtp_layers > 0))
    if model.mtp is not None:
        model.tie_mtp_head()
    mtp = f"model.layers.{cfg.num_layers}."
    out = {"target": 0, "mtp": 0}
    for name, t in checkpoint_tensors(model):
        out["mtp" if name.startswith(mtp) else "target"] += stored_bytes(name, tuple(t.shape))
    return out


def write_release(
    dst: str | Path,
    model_dir: str | Path,
    corpus: str | Path,
    runs: list[Path],
    name: str,
    max_shard_mb: float,
) -> Path:
    """Writes ``dst`` from the final phase's bf16 ``model_dir``, the corpus directory (its
    tokenizer and tokens.json) and the training ``runs`` (each phase's directory), with weight
    files of at most ``max_shard_mb`` (10^6 bytes) of tensors each."""
    dst, model_dir, corpus = Path(dst), Path(model_dir), Path(corpus)
    ckpt = Checkpoint(model_dir)
    shapes = {n: tuple(ckpt.shape(n)) for n in ckpt.names()}
    kept = sorted(
        _WEIGHT.fullmatch(n).group(1)  # type: ignore[union-attr]
        for n in ckpt.names()
        if quantizes(n, shapes[n], ckpt.dtype(n)) and ragged(shapes[n])
    )
    ckpt.close()
    write_fp8_checkpoint(
        model_dir,
        dst,
        block=(FP8_EDGE, FP8_EDGE),
        max_shard_bytes=int(max_shard_mb * 1e6),
        skip=lambda n: ragged(shapes[n]),
    )
    config_path = dst / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["modules_to_not_convert"] = kept
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer = corpus / TOKENIZER_DIR
    for item in tokenizer.iterdir():
        shutil.copy2(item, dst / item.name)
    vocab = json.loads((tokenizer / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    eos = config["eos_token_id"]
    generation = {
        "eos_token_id": [eos, *(ids[r] for r in STOP_ROLES)],
        "pad_token_id": config.get("pad_token_id", eos),
    }
    (dst / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    (dst / "corpus.json").write_text((corpus / META).read_text())
    phases = []
    for run in runs:
        summary = json.loads((run / "training.json").read_text())
        summary.pop("weights", None)  # the run's own directory, not the release's
        phases.append({"phase": run.name, **summary})
        shutil.copy2(run / HISTORY_FILE, dst / f"history-{run.name}.jsonl")
        plot(run, dst / f"training-{run.name}.png")
    (dst / "training.json").write_text(json.dumps({"model": name, "phases": phases}, indent=2))
    return dst
