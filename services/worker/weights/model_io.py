"""Building, initialising, saving and loading models: config.json plus either one
model.safetensors or HF-style shards ``model-0000i-of-0000N.safetensors`` with a
``model.safetensors.index.json`` weight map."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from dhisparse.family.config import ModelConfig
from dhisparse.family.hf_dir import read_config
from dhisparse.family.parallel_layout import SINGLE, Cut, ParallelConfig
from dhisparse.family.presets import (
    PRESETS,
    REAL_DIMENSION,
    Definition,
    FamilyPreset,
    V4Preset,
    preset,
)
from dhisparse.family.quantization_config import SCALE_SUFFIX, fp8_as_stored
from dhisparse.paths import resolve_path
from services.worker.model.decoder import SparseDecoder
from services.worker.model.mla_decoder import MLADecoder
from services.worker.model.preset_decoder import DSAModel
from services.worker.model.v4_serving import V4Model
from services.worker.model.weight_format import BF16, WeightFormat, resolve
from services.worker.ops.fp8_blockwise import FP8_DTYPE, quantize_blockwise
from services.worker.ops.fp8_linear import Mode
from services.worker.ops.fp8_moe import gate_up_halves
from services.worker.parallel.comm import LOCAL, Comm
from services.worker.parallel.shards import Shards
from services.worker.weights.hf_load import is_hf_model_dir, load_hf_model
from services.worker.weights.v4_build import build_v4
from services.worker.weights.v4_names import load_v4_served

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_weights(model: DSAModel, seed: int) -> None:
    """Seeded random init: N(0, 1/fan_in) projections and unit-variance embeddings, so that even
    untrained weights mix context strongly enough to give varied tokens (exactness tests need
    outputs that depend on which rows attention read)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
            continue
        if name.endswith("compress_gate"):
            std = 0.5  # gates need spread to weigh a group's tokens unequally
        elif p.dim() == 2 and not name.startswith("embed"):
            std = 1.0 / math.sqrt(p.shape[1])
        else:
            std = 1.0
        p.data.copy_(torch.randn(p.shape, generator=g) * std)


def init_family_weights(model: MLADecoder, seed: int) -> None:
    """Seeded random init of a real family's decoder with unit-scale activations, as the
    real-family tests' reference checkpoints: N(0, 1/fan_in) projections and experts, N(0, 1)
    embeddings, norm weights 1 + N(0, 0.2^2), and N(0, 0.1^2) for the indexer's k_norm bias
    and the routers' correction biases, so that no weight sits at a value (a unit norm, a zero
    bias) that would hide a wrong read.

    The numbers are drawn on the model's device, one tensor at a time (a model built in place
    on a GPU never exists on the host). A weight held in FP8 is drawn as its dense weight would
    be, then quantized per 128x128 block (one matrix at a time) into it and its scales."""
    device = next(model.parameters()).device
    g = torch.Generator(device).manual_seed(seed)
    layout = model.shards.layout
    with torch.no_grad():
        tensors = [*model.named_parameters(), *model.named_buffers()]
        # the MTP layer's last: the target's numbers are the same with or without it
        for name, t in sorted(tensors, key=lambda nt: nt[0].startswith("mtp.")):
            if name.endswith(SCALE_SUFFIX):
                continue  # written with its weight
            cut = layout.cut(name)
            if t.dtype == FP8_DTYPE:
                scale = model.get_buffer(name + SCALE_SUFFIX)
                for shape, w, s, c in _fp8_matrices(name, t, scale, cut):
                    r = torch.randn(shape, generator=g, device=device) / math.sqrt(shape[-1])
                    if w is None or s is None:  # another rank's expert: drawn, dropped
                        continue
                    w_fp8, s_fp8 = quantize_blockwise(r)
                    w.copy_(w_fp8 if c is None else c.take(w_fp8))
                    s.copy_(s_fp8 if c is None else c.blocks().take(s_fp8))
                continue
            shape = tuple(t.shape) if cut is None else cut.full_shape(tuple(t.shape))
            r = torch.randn(shape, generator=g, device=device)
            if "norm" in name and name.endswith("weight"):
                r = 1 + 0.2 * r
            elif name.endswith("bias"):
                r = 0.1 * r
            elif not name.startswith("embed"):
                r = r / math.sqrt(shape[-1])
            t.copy_(r if cut is None else cut.take(r))


class _Matrix(NamedTuple):
    """One matrix of an FP8 weight as the whole model draws it: ``shape`` the full matrix's;
    ``weight`` / ``scale`` the views this rank holds of it (None: another rank's expert) and
    ``cut`` the part of the full matrix they hold (None: all of it)."""

    shape: tuple[int, ...]
    weight: torch.Tensor | None
    scale: torch.Tensor | None
    cut: Cut | None


def _fp8_matrices(
    name: str, weight: torch.Tensor, scale: torch.Tensor, cut: Cut | None = None
) -> list[_Matrix]:
    """The matrices of an FP8 weight, each quantized on its own, in the order a whole model
    draws them: the weight itself, one per expert of stacked experts, and gate and up apart
    within ``gate_up_proj`` (each on its own grid, as ``FP8Experts`` holds them). Split by
    expert (``cut`` on dim 0 of stacked experts), every expert of the full stack is listed, so
    that the draws stay in step; split inside the matrices, each comes with its cut."""
    ws = weight.view(-1, *weight.shape[-2:])
    ss = scale.view(-1, *scale.shape[-2:])
    gate_up = name.endswith("gate_up_proj")
    stacked = weight.dim() == 3
    inner = None
    if cut is not None and not (stacked and cut.dim == 0):
        d = cut.dim - 1 if stacked else cut.dim  # a stacked weight's dim d is a matrix's d - 1
        inner = Cut(d, cut.parts[:1], cut.total // 2) if gate_up else Cut(d, cut.parts, cut.total)
    held = list(zip(ws, ss, strict=True))
    first = 0
    n = len(held)
    if stacked and cut is not None and cut.dim == 0:  # expert parallel
        ((first, _),) = cut.parts
        n = cut.total
    out = []
    for e in range(n):
        mine = first <= e < first + len(held)
        w, s = held[e - first] if mine else (ws[0], ss[0])
        mats = gate_up_halves(w, s) if gate_up else ((w, s),)
        for mw, ms in mats:
            shape = tuple(mw.shape) if inner is None else inner.full_shape(tuple(mw.shape))
            out.append(_Matrix(shape, mw if mine else None, ms if mine else None, inner))
    return out


def build_model(
    cfg: Definition,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    weights: WeightFormat = BF16,
    in_place: bool = False,
    shards: Shards | None = None,
    mtp: bool = False,
) -> SparseDecoder | V4Model:
    """A model of seeded random weights in ``dtype`` (default: the definition's): a real
    family's MLADecoder, built as a checkpoint's is (hf_config's math and topology), its
    projections and experts held as ``weights`` says, and initialised by
    ``init_family_weights``; or the home-made DSAModel of a ModelConfig, initialised by
    ``init_weights``.

    A family model is initialised on the CPU and then moved, so that its weights are the same
    on every device; with ``in_place`` (and whenever it holds FP8 weights) it is allocated and
    initialised on ``device`` directly, never on the host: what real-dimension models of tens of
    GB need (their numbers then come from ``device``'s generator). ``shards``: a family model's
    part on one rank of a group, holding exactly its slices of the whole model's weights.
    ``mtp``: a family model with its config's MTP layer (random too; its head is the
    target's, as the released checkpoints' copy is), drawn after the target's tensors, which
    are therefore the same with or without it.

    A DeepSeek-V4 preset (``V4Preset``) is built as the engine's ``V4Model``
    (``weights/v4_build``), in ``dtype`` with its projections and experts held as ``weights``
    says (FP4 routed experts with ``weights.fp4_experts``), on one rank: not sharded."""
    if isinstance(cfg, V4Preset):
        if shards is not None:
            raise ValueError(f"{cfg.name}: DeepSeek-V4's model runs on one rank (no sharding)")
        return build_v4(cfg, seed, device, dtype, in_place, mtp, weights)
    if weights.fp4_experts:
        raise ValueError(
            f"{cfg.name}: FP4 routed experts (--weight-dtype fp4) are DeepSeek-V4's released form"
        )
    if isinstance(cfg, FamilyPreset):
        family, topo = cfg.parse(mtp=mtp)
        if in_place or weights.fp8:
            with torch.device("meta"):
                model = MLADecoder(family, topo, weights, shards)
            model.to_empty(device=device)
        else:
            model = MLADecoder(family, topo, shards=shards)
        if mtp:
            model.tie_mtp_head()
        # cast before the init: the FP32_PARAMS take their values in fp32 whatever the dtype
        model.cast(dtype or DTYPES[family.dtype])
        init_family_weights(model, seed)
        return model.to(device=device).eval()
    if weights.fp8 or in_place or shards is not None or mtp:
        raise ValueError(
            f"{cfg.name}: FP8 weights, in-place builds, sharding and the MTP layer are for the "
            "real families"
        )
    model = DSAModel(cfg)
    init_weights(model, seed)
    return model.to(device=device, dtype=dtype or DTYPES[cfg.dtype]).eval()


def save_pretrained(
    model: DSAModel,
    path: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> None:
    """Writes config.json and the weights (cast to ``dtype`` when given). With
    ``max_shard_bytes``, weights that do not fit one file of that size are split into shards
    (whole tensors, in state-dict order) listed by an index; earlier weight files are removed."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.cfg.save(path / CONFIG_FILE)
    tensors = {
        k: v.detach().to(dtype=dtype or v.dtype).contiguous().cpu()
        for k, v in model.state_dict().items()
    }
    for old in [path / WEIGHTS_FILE, path / INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, names in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in names}, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    """Tensor names per shard, greedily in order; a tensor larger than the limit goes alone.
    The limit is on tensor bytes; a shard's header adds a few KB."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if max_bytes is not None and shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict of a model directory, from one file or from the shards of its index."""
    path = Path(path)
    if (path / INDEX_FILE).exists():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            state.update(load_file(str(path / shard)))
        if set(state) != set(weight_map):
            raise ValueError(f"{path / INDEX_FILE}: shards do not hold exactly the mapped weights")
        return state
    return load_file(str(path / WEIGHTS_FILE))


def load_model(
    spec: str | Path,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    mtp: bool = False,
    weight_dtype: str = "auto",
    fp8_mode: Mode = "w8a16",
    parallel: ParallelConfig = SINGLE,
    comm: Comm = LOCAL,
) -> SparseDecoder:
    """A preset name (seeded random weights) or a directory with config.json + weights: a
    Hugging Face DeepSeek-V3.2 / GLM-5 checkpoint, or the home-made format. ``mtp``: with the
    checkpoint's MTP layer (Hugging Face checkpoints and the real families' presets, whose
    config must name one). ``weight_dtype`` / ``fp8_mode``: how a real family's projections
    and experts are held (``weight_format.resolve``; a family preset is "FP8" under "auto"
    when its config has a ``quantization_config``); the home-made family takes "auto" or
    "bf16" only. ``parallel`` over ``comm``: this rank's part
    of a real family's model (``family.parallel_layout``); the home-made family runs on one rank."""
    if parallel.world_size > 1 and not _is_family(spec):
        raise ValueError(
            f"--tensor-parallel-size {parallel.world_size}: {spec!r} is not a DeepSeek-V3.2 / "
            "GLM-5 model; the home-made family runs on one rank"
        )
    no_mtp = ValueError(
        f"the MTP drafter needs a DeepSeek-V3.2 / GLM-5 checkpoint or preset with its MTP layer; "
        f"{spec!r} is not one"
    )
    if mtp and str(spec) not in PRESETS and not is_hf_model_dir(resolve_path(spec)):
        raise no_mtp
    if str(spec) in PRESETS:
        d = preset(str(spec))
        family = isinstance(d, FamilyPreset)
        if mtp and not family:
            raise no_mtp
        stored = fp8_as_stored(d.config.get("quantization_config")) if family else False
        fmt = resolve(weight_dtype, stored, fp8_mode)
        if fmt.fp8 and not (family or isinstance(d, V4Preset)):
            raise ValueError(
                f"--weight-dtype {weight_dtype}: {spec!r} is not a DeepSeek-V3.2 / GLM-5 / V4 model"
            )
        shards = Shards.of(parallel, comm, d.parse()[0]) if family else None
        return build_model(
            d, seed=seed, device=device, dtype=dtype, weights=fmt, shards=shards, mtp=mtp,
            in_place=str(spec) in REAL_DIMENSION,
        )  # fmt: skip
    path = resolve_path(spec)
    if not (path / CONFIG_FILE).exists():
        raise FileNotFoundError(
            f"{spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a model "
            f"directory with {CONFIG_FILE}"
        )
    if is_hf_model_dir(path) and read_config(path).get("model_type") == "deepseek_v4":
        return load_v4_served(path, device, dtype, mtp, weight_dtype, parallel.world_size, fp8_mode)
    if is_hf_model_dir(path):
        return load_hf_model(
            path, device=device, dtype=dtype, mtp=mtp, weight_dtype=weight_dtype,
            fp8_mode=fp8_mode, parallel=parallel, comm=comm,
        )  # fmt: skip
    if resolve(weight_dtype, False).fp8:
        raise ValueError(f"--weight-dtype fp8: {spec} is not a DeepSeek-V3.2 / GLM-5 model")
    cfg = ModelConfig.load(path / CONFIG_FILE)
    model = DSAModel(cfg)
    state = load_weights(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"weights do not match config: missing={missing} unexpected={unexpected}")
    return model.to(device=device, dtype=dtype or DTYPES[cfg.dtype]).eval()


def _is_family(spec: str | Path) -> bool:
    """Whether ``spec`` names a DeepSeek-V3.2 / GLM-5 model (a family preset or directory)."""
    if str(spec) in PRESETS:
        return isinstance(preset(str(spec)), FamilyPreset)
    path = resolve_path(spec)
    return (path / CONFIG_FILE).exists() and is_hf_model_dir(path)
