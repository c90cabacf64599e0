"""Checkpoint tensor names of DeepSeek-V3.2 / GLM-5 onto ``MLADecoder``'s parameters, in one
table (``_LAYER_NAMES``, ``_GLOBAL_NAMES``, the MTP layer's ``MTP_NAMES``): which tensor each
checkpoint name is copied into, the slice a rank reads, the projections an FP8 checkpoint
stores unquantized, and the names this decoder does not read."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from dhisparse.family.hf_config import MLAConfig
from dhisparse.family.parallel_layout import Cut, RankLayout
from dhisparse.family.quantization_config import SCALE_SUFFIX
from services.worker.model.fp8_linear_layer import FP8Linear
from services.worker.model.mla_decoder import MLADecoder
from services.worker.model.mla_mtp import MTP_EMBED, MTP_NAMES
from services.worker.ops.fp8_blockwise import FP8_DTYPE
from services.worker.ops.fp8_moe import gate_up_halves
from services.worker.weights.checkpoint import CheckpointError
from services.worker.weights.loader import Fp8Target, Sliced, Target

# checkpoint name (regex, per layer L) -> this module's name; experts E may come one by one
# (the released layout) or fused (transformers' in-memory layout).
_LAYER_NAMES = (
    (r"input_layernorm\.weight", "attn_norm.weight"),
    (r"post_attention_layernorm\.weight", "mlp_norm.weight"),
    (r"self_attn\.indexer\.(wq_b|wk|weights_proj)\.weight", r"indexer.\1.weight"),
    (r"self_attn\.indexer\.k_norm\.(weight|bias)", r"indexer.k_norm.\1"),
    (
        r"self_attn\.(q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm"
        r"|kv_b_proj|o_proj)\.weight",
        r"attn.\1.weight",
    ),
    (r"mlp\.(gate_proj|up_proj|down_proj)\.weight", r"mlp.\1.weight"),
    (r"mlp\.gate\.(weight|e_score_correction_bias)", r"mlp.gate.\1"),
    (
        r"mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight",
        r"mlp.shared_experts.\1.weight",
    ),
    (r"mlp\.experts\.(gate_up_proj|down_proj)", r"mlp.experts.\1"),
)
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def checkpoint_targets(model: MLADecoder, names: list[str]) -> dict[str, Target]:
    """For each checkpoint tensor name this model reads: the tensor (a parameter, or a view
    of one: one expert's slice of the fused expert weights) it is copied into, or for a weight
    the model holds in FP8 the ``Fp8Target`` of its e4m3 values and block scales. Names the
    model has no place for are left out (the loader reports them); parameters that no name
    fills raise ``CheckpointError`` listing them."""
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    mtp = model.mtp_layer if model.mtp is not None else None
    layout = model.shards.layout
    out: dict[str, Target] = {}
    filled: dict[str, int] = {}  # elements of each parameter some checkpoint tensor fills
    for name in names:
        hit = _target(params, name, mtp, layout.experts().start)
        if hit is None:
            continue
        ours, view = hit
        cut = _checkpoint_cut(layout.cut(ours), per_expert=_EXPERT.search(name) is not None,
                              down=ours.endswith("down_proj"))  # fmt: skip
        if isinstance(view, torch.Tensor) and view.dtype == FP8_DTYPE:
            view = _whole_fp8(params, ours, view)
        if isinstance(view, Fp8Target):
            scale_name = ours + SCALE_SUFFIX
            filled[scale_name] = filled.get(scale_name, 0) + view.scale.numel()
            view, target = view.weight, view
        else:
            target = view
        filled[ours] = filled.get(ours, 0) + view.numel()
        out[name] = target if cut is None else Sliced(target, cut)
    unfilled = sorted(n for n in _expected(model) if filled.get(n, 0) != params[n].numel())
    if unfilled:
        listed = ", ".join(unfilled[:20]) + (
            f" and {len(unfilled) - 20} more" if len(unfilled) > 20 else ""
        )
        raise CheckpointError(f"the checkpoint lacks weights for {len(unfilled)} tensors: {listed}")
    return out


def hold_stored_dense(
    model: MLADecoder, names: list[str], is_fp8: Callable[[str], bool]
) -> list[str]:
    """Rebuilds as ``nn.Linear`` (the serving dtype) every projection ``model`` holds in FP8
    whose checkpoint weight (one of ``names``) is not stored in FP8 (``is_fp8``): an FP8
    checkpoint's ``modules_to_not_convert``, served unquantized as transformers serves them.
    Done on the meta device, before the weights load; returns the rebuilt modules' names."""
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    mtp = model.mtp_layer if model.mtp is not None else None
    first = model.shards.layout.experts().start
    rebuilt = []
    for name in names:
        hit = _target(params, name, mtp, first)
        if hit is None or is_fp8(name) or not hit[0].endswith(".weight"):
            continue
        path = hit[0].removesuffix(".weight")
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, attr)
        if not isinstance(module, FP8Linear):
            continue
        dense = nn.Linear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            device=module.weight.device,
        )
        setattr(parent, attr, dense)
        rebuilt.append(path)
    return rebuilt


def _checkpoint_cut(cut: Cut | None, per_expert: bool, down: bool) -> Cut | None:
    """The slice of a checkpoint tensor a rank reads, from the cut of our tensor it fills: the
    same for a whole tensor; for one expert's stored matrix (gate / up [I, D], down [D, I]) of
    our stacked experts, the cut inside the matrix (none when the rank holds whole experts)."""
    if cut is None or not per_expert:
        return cut
    if cut.dim == 0:  # expert parallel: whole experts, picked by index
        return None
    if down:  # [E, D, I] cut on I -> [D, I] cut on dim 1
        return Cut(1, cut.parts, cut.total)
    return Cut(0, cut.parts[:1], cut.total // 2)  # gate's (or up's) rows of [E, 2I, D]


def _whole_fp8(params: dict[str, torch.Tensor], ours: str, view: torch.Tensor) -> Fp8Target:
    """The target of a whole FP8 weight of ours and its block scales (``X.weight`` has
    ``X.weight_scale_inv``). Transformers' fused 3-D expert tensors are not 2-D weights with
    one grid: they load into experts held in the serving dtype only."""
    if view.dim() != 2:
        raise CheckpointError(
            f"{ours}: fused {view.dim()}-D expert tensors load with --weight-dtype bf16, not "
            "into FP8 experts (FP8 checkpoints store each expert's projections apart)"
        )
    return Fp8Target(view, params[ours + SCALE_SUFFIX])


def _target(
    params: dict[str, torch.Tensor], name: str, mtp: int | None, first_expert: int = 0
) -> tuple[str, torch.Tensor | Fp8Target] | None:
    """(our parameter, the tensor to copy into) for one checkpoint name, or None. ``mtp``: the
    index of the MTP layer the model holds as ``mtp`` (its decoder layer under the usual
    names, its own tensors by ``MTP_NAMES``). ``first_expert``: the first routed expert this
    rank holds (expert parallel); experts it does not hold have no target."""
    if name in _GLOBAL_NAMES:
        ours = _GLOBAL_NAMES[name]
        return (ours, params[ours]) if ours in params else None
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    prefix, rest = f"layers.{m.group(1)}.", m.group(2)
    if mtp is not None and int(m.group(1)) == mtp:
        prefix = "mtp."
        if rest in MTP_NAMES:
            ours = prefix + MTP_NAMES[rest]
            return ours, params[ours]
    e = _EXPERT.fullmatch(rest)
    if e is not None:
        local = int(e.group(1)) - first_expert
        return None if local < 0 else _expert_view(params, prefix, local, e.group(2))
    for pattern, repl in _LAYER_NAMES:
        if re.fullmatch(pattern, rest):
            ours = prefix + re.sub(pattern, repl, rest)
            return (ours, params[ours]) if ours in params else None
    return None


def _expert_view(
    params: dict[str, torch.Tensor], prefix: str, e: int, proj: str
) -> tuple[str, torch.Tensor | Fp8Target] | None:
    """One expert's slice of the fused expert weights: gate and up are the two halves of
    gate_up_proj[e] (as transformers fuses them), down is down_proj[e]; for FP8 experts with
    the matching slices of their block scales."""
    ours = prefix + ("mlp.experts.down_proj" if proj == "down_proj" else "mlp.experts.gate_up_proj")
    fused = params.get(ours)
    if fused is None or e >= fused.shape[0]:
        return None
    scale = params[ours + SCALE_SUFFIX][e] if fused.dtype == FP8_DTYPE else None
    if proj == "down_proj":
        w, s = fused[e], scale
    else:
        gate, up = gate_up_halves(fused[e], scale)
        w, s = gate if proj == "gate_proj" else up
    return ours, (w if s is None else Fp8Target(w, s))


def _expected(model: MLADecoder) -> set[str]:
    """Our tensors that a checkpoint must fill: every parameter, the router biases, and the
    FP8 weights with their block scales."""
    return set(dict(model.named_parameters())) | {
        n
        for n, t in model.named_buffers()
        if n.endswith(("e_score_correction_bias", SCALE_SUFFIX)) or t.dtype == FP8_DTYPE
    }


def ignored_patterns(
    cfg: MLAConfig, mtp: bool = False, layout: RankLayout | None = None
) -> list[tuple[str, str]]:
    """(regex, why) of checkpoint tensors this decoder does not read; ``mtp``: it holds the
    MTP layer; ``layout``: this rank's part (the routed experts other ranks hold)."""
    out = []
    held = layout.experts() if layout is not None else None
    if held is not None and not held.whole:
        others = [str(e) for e in range(held.total) if not held.start <= e < held.stop]
        out.append((
            rf"model\.layers\.\d+\.mlp\.experts\.({'|'.join(others)})\.",
            f"routed experts held by other ranks ({held.start}-{held.stop - 1} are this rank's)",
        ))  # fmt: skip
    if mtp:
        embed = re.escape(MTP_EMBED)
        out.append(
            (
                rf"model\.layers\.{cfg.num_layers}\.{embed}$",
                "the MTP layer's copy of the embedding (the target's is used, as in vLLM and SGLang)",
            )
        )
    elif cfg.mtp_layers:
        last = cfg.num_layers + cfg.mtp_layers - 1
        layers = "|".join(str(i) for i in range(cfg.num_layers, last + 1))
        out.append((rf"model\.layers\.({layers})\..*", "the MTP layer (no MTP drafter asked for)"))
    shared = [str(i) for i, t in enumerate(cfg.indexer_types) if t == "shared"]
    if shared:
        out.append(
            (
                rf"model\.layers\.({'|'.join(shared)})\.self_attn\.indexer\..*",
                "indexer tensors of IndexShare (shared) layers",
            )
        )
    return out
