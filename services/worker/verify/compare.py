"""Our engine's model against transformers' on the first N layers of a checkpoint: per layer,
how many of the reference's selected positions we select, and how far the logits of that
layer's output (the final norm and lm_head applied to it) lie from the reference's."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dhisparse.family.hf_config import parse_config
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig, bytes_per_token
from services.worker.model.mla_decoder import MLADecoder
from services.worker.serving.cache import KVCache
from services.worker.verify.reference import load_reference, reference_logits, run_reference
from services.worker.weights.hf_load import load_hf_model, read_config

_ROWS = 256  # query positions per block when comparing selections and logits


@dataclass(frozen=True)
class LayerCheck:
    layer: int
    index: str  # "producer" or "follower"
    leader: int  # the producer whose selection a follower shares (itself for a producer)
    agreement: float | None  # |ours ∩ theirs| / |theirs| over visible positions; None: follower
    logit_error: float  # max |Δ logit| / max |logit| of the layer's output through norm + head
    top1: float  # share of positions whose argmax logit is the same

    def passes(self, min_agreement: float, max_logit_error: float) -> bool:
        agreed = self.agreement is None or self.agreement >= min_agreement
        return agreed and self.logit_error <= max_logit_error


@dataclass(frozen=True)
class Verification:
    model: str
    family: str
    model_layers: int  # layers of the whole model
    tokens: int
    device: str
    layers: tuple[LayerCheck, ...]

    def passes(self, min_agreement: float, max_logit_error: float) -> bool:
        return all(c.passes(min_agreement, max_logit_error) for c in self.layers)

    def as_dict(self) -> dict:
        return asdict(self)


def run_ours(
    model: MLADecoder, ids: torch.Tensor
) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
    """One prefill of ``ids`` [T] through the engine's forward pass over a resident KV cache:
    (layer -> selected positions [T, k], -1 pads; per layer its output hidden states)."""
    device = model.embed.weight.device
    n, page = len(ids), 16
    per_token = bytes_per_token(model.cfg, 4, payload=True)
    pool = int(per_token * (n + 4 * page)) + (1 << 20)
    kv_cfg = KVCacheConfig(
        kv_pool_bytes=pool,
        page_size=page,
        max_slots=1,
        max_model_len=n,
        dtype=torch.float32,
        device=str(device),
    )
    kv = KVCache(model.cfg, kv_cfg)
    try:
        if not kv.admit(0, "verify", n, n):
            raise RuntimeError(f"a KV pool of {pool} B does not hold {n} tokens")
        batch = ForwardBatch.build([0], [0], [n], device)
        features = dict.fromkeys(range(len(model.layers)))
        selections: dict[int, torch.Tensor] = {}
        model(ids.to(device), batch, kv, features=features, selections=selections)
    finally:
        kv.close()
    return selections, [features[i] for i in range(len(model.layers))]


def agreement(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """|ours ∩ theirs| / |theirs| summed over query positions t, where ``theirs`` [T, k'] counts
    only visible positions (<= t: transformers fills short rows with masked ones) and ``ours``
    [T, k] only real ones (>= 0)."""
    t_len = ours.shape[0]
    hit = total = 0
    for a in range(0, t_len, _ROWS):
        b = min(t_len, a + _ROWS)
        rows = torch.arange(a, b, device=ours.device).unsqueeze(1)
        mine = _membership(ours[a:b], ours[a:b] >= 0, t_len)
        ref = _membership(theirs[a:b], theirs[a:b] <= rows, t_len)
        hit += int((mine & ref).sum())
        total += int(ref.sum())
    return hit / total if total else 1.0


def _membership(pos: torch.Tensor, valid: torch.Tensor, width: int) -> torch.Tensor:
    """[R, k] positions (where ``valid``) -> [R, width] bool: which positions each row holds."""
    out = torch.zeros(pos.shape[0], width + 1, dtype=torch.bool, device=pos.device)
    out.scatter_(1, torch.where(valid, pos, width).long(), True)
    return out[:, :width]


@torch.no_grad()
def logit_check(
    ours: MLADecoder, ref: torch.nn.Module, mine: torch.Tensor, theirs: torch.Tensor
) -> tuple[float, float]:
    """(max |Δ logit| / max |logit|, share of positions with the same argmax) of both models'
    final norm and lm_head applied to one layer's outputs [T, hidden] (each model its own;
    the reference's logits are the yardstick), in blocks of positions."""
    worst = peak = 0.0
    same = 0
    for a in range(0, mine.shape[0], _ROWS):
        o = ours.logits(ours.norm(mine[a : a + _ROWS]))
        t = reference_logits(ref, theirs[a : a + _ROWS])
        worst = max(worst, float((o - t).abs().max()))
        peak = max(peak, float(t.abs().max()))
        same += int((o.argmax(-1) == t.argmax(-1)).sum())
    return worst / peak, same / mine.shape[0]


def verify(
    path: str | Path, layers: int, ids: torch.Tensor, device: str | torch.device = "cpu"
) -> Verification:
    """Builds both models of the first ``layers`` layers in fp32 on ``device`` (each reading
    only those layers' tensors), runs ``ids`` [T] through both, and checks every layer. Our
    decoder layers are dropped once run, before the reference is built: at most one model's
    layers are in memory at a time."""
    raw = read_config(path)
    cfg = parse_config(raw)
    ours = load_hf_model(path, device, torch.float32, layers=layers)
    selections, outputs = run_ours(ours, ids)
    specs = ours.cfg.layers
    ours.layers = torch.nn.ModuleList()  # the final norm and lm_head stay for the logits
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    ref = load_reference(path, raw, cfg, layers, device)
    theirs = run_reference(ref, ids.to(device))
    checks = []
    for i, spec in enumerate(specs):
        producer = spec.index == "producer"
        agreed = None
        if producer or i in theirs.selections:
            # a layer only one side runs an indexer on agrees on nothing
            both = producer and i in theirs.selections
            agreed = agreement(selections[i], theirs.selections[i]) if both else 0.0
        err, top1 = logit_check(ours, ref, outputs[i], theirs.outputs[i])
        leader = i if producer else spec.leader
        checks.append(LayerCheck(i, spec.index, leader, agreed, err, top1))
    return Verification(
        model=ours.cfg.name,
        family=cfg.family,
        model_layers=cfg.num_layers,
        tokens=len(ids),
        device=str(device),
        layers=tuple(checks),
    )
