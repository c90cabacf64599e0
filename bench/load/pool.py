"""The GPU memory every mode of the load benchmark gets: what the full model leaves per GPU on
a node of 8 H200 under its best layout (``dhisparse plan``), scaled by the layer ratio of the
real-dimension preset, so that the sessions one scaled GPU holds are the real deployment's; and
the host arena a GPU's share of the node's host memory gives, scaled the same way.

    pool = plan(full model, --gpu-gib 141 --tensor-parallel-size 8 --layouts all,
                --kv-cache-dtype fp8 --weight-dtype fp8).best_layout.pool_bytes × layers_scaled / layers_full
    host = node host bytes / GPUs × layers_scaled / layers_full

The best layout is the one under which the node holds the most hierarchy sessions at the
context (ties: the larger pool); weights in FP8, as the scaled presets hold them. Pure Python, like the capacity model."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from dhisparse.capacity.builtin import profile_from_model_dir
from dhisparse.capacity.layouts import ALL, layouts_of
from dhisparse.capacity.model import GIB, TB
from dhisparse.capacity.plan import build_plan
from dhisparse.capacity.profile import Deployment
from dhisparse.capacity.weights import model_weights_of
from dhisparse.family.scaled import SCALED

ROOT = Path(__file__).resolve().parents[2]
# the released configs the scaled presets are cut from (dhisparse/family/scaled.py)
FULL = {
    "v32-scaled": ROOT / "tests" / "fixtures" / "configs" / "deepseek-v3.2",
    "glm5-scaled": ROOT / "tests" / "fixtures" / "configs" / "glm-5.2",
}
H200_GIB = 141.0
NODE_GPUS = 8
NODE_HOST_BYTES = round(4.3 * TB)  # the paper's node (§5): host memory for backups


@dataclass(frozen=True)
class PoolSizing:
    family: str
    context: int
    layout: str  # the full model's best layout on the node
    full_pool_bytes: int  # its KV pool per GPU
    full_layers: int
    scaled_layers: int
    layer_ratio: float
    pool_bytes: int  # full_pool_bytes × layer_ratio: every mode's budget
    sessions_per_gpu: dict  # the full model's, under that layout: {resident, hierarchy}
    host_share_bytes: int  # the node's host memory per GPU × layer_ratio
    formula: str
    # the hierarchy's sessions per GPU under that layout for the model with its MTP layer:
    # {base: without speculating, mtp: with the MTP layer's KV}: eq. 13's N_base and N_spec
    mtp_sessions_per_gpu: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def plan_pool(family: str, context: int, gpu_gib: float = H200_GIB,
              gpus: int = NODE_GPUS, host_bytes: int = NODE_HOST_BYTES) -> PoolSizing:  # fmt: skip
    """The pool and host share for ``family`` (a key of ``SCALED``) at ``context`` tokens."""
    if family not in FULL:
        raise ValueError(f"no full-model config for {family!r}; known: {', '.join(FULL)}")
    src = FULL[family]
    layouts = layouts_of(gpus, ALL)
    dep = Deployment(gpus=gpus, hbm_bytes=round(gpu_gib * GIB), host_bytes=host_bytes)

    def plan_of(mtp: bool):
        profile = profile_from_model_dir(src, kv_cache_dtype="fp8", mtp=mtp)
        weights = model_weights_of(src, weight_dtype="fp8", mtp=mtp)  # as the presets hold them
        drafter = profile.drafter("mtp") if mtp else None
        return build_plan(profile, context, drafter, dep, layouts=layouts, weights=weights,
                          refuse=False)  # fmt: skip

    plan = plan_of(mtp=False)

    def admitted(lp, mode: str, drafter: str | None = None):
        return next(a for a in lp.admissions if a.mode == mode and a.drafter == drafter)

    sized = [lp for lp in plan.layouts if lp.pool_bytes]
    if not sized:
        raise ValueError(f"no layout of {family}'s full model leaves a KV pool on {gpus} GPUs")
    best = max(sized, key=lambda lp: (admitted(lp, "hierarchy").per_node, lp.pool_bytes))
    with_mtp = next(lp for lp in plan_of(mtp=True).layouts if lp.name == best.name)
    mtp_sessions = {"base": admitted(with_mtp, "hierarchy").per_gpu,
                    "mtp": admitted(with_mtp, "hierarchy", "mtp").per_gpu}  # fmt: skip
    full_layers = _layers(src)
    scaled_layers = SCALED[family].config["num_hidden_layers"]
    ratio = scaled_layers / full_layers
    return PoolSizing(
        family=family, context=context, layout=best.name, full_pool_bytes=best.pool_bytes,
        full_layers=full_layers, scaled_layers=scaled_layers, layer_ratio=ratio,
        pool_bytes=int(best.pool_bytes * ratio),
        sessions_per_gpu={m: admitted(best, m).per_gpu for m in ("resident", "hierarchy")},
        host_share_bytes=int(host_bytes / gpus * ratio), mtp_sessions_per_gpu=mtp_sessions,
        formula=f"dhisparse plan --model {src.relative_to(ROOT)} --context {context} "
        f"--gpu-gib {gpu_gib:g} --tensor-parallel-size {gpus} --layouts all "
        f"--kv-cache-dtype fp8 --weight-dtype fp8: layout {best.name}, pool {best.pool_bytes / GIB:.3f} GiB/GPU "
        f"× {scaled_layers}/{full_layers} layers = {best.pool_bytes * ratio / GIB:.3f} GiB",
    )  # fmt: skip


def _layers(src: Path) -> int:
    return int(json.loads((src / "config.json").read_text())["num_hidden_layers"])
