"""DeepSeek-V4 checkpoints onto ``V4Decoder``, whose parameters carry DeepSeek's own names.

A checkpoint meets the loader in one of three namings, all read:
- the hub's: ``layers.0.attn.wq_a.weight``, ``embed.weight``, ``hc_head_fn``, ``head.weight``;
- what transformers 5.17 ``save_pretrained`` writes: the same behind ``model.``, with
  ``model.embed_tokens.weight`` and ``model.hc_head.hc_fn``;
- transformers' module names (a raw ``state_dict``): ``model.layers.0.self_attn.q_a_proj``,
  ``compressor.indexer.*``, the routed experts fused into ``experts.gate_up_proj`` [E, 2I, H]
  and ``experts.down_proj`` [E, H, I].

The MTP layer (``mtp.0.*``, in the same namings) is read only when asked
(``load_v4_model(..., mtp=True)``, ``--drafter mtp``) into ``V4Decoder.mtp``
(``v4_mtp.MTPBlock``); otherwise its tensors are left unread and named in one log line. The
released form is read too: FP8 e4m3 weights with block scales (``X.scale`` or
``X.weight_scale_inv``, the block from ``quantization_config``) and FP4 e2m1 routed experts
(``expert_dtype`` "fp4", packed two per byte, one UE8M0 scale per 32 columns), held as stored
or dequantised on load (``load_v4_served``'s ``weight_dtype``).

With DeepSeek-V4.1's shared sources (``V4Config.sharing``) a consumer layer has no compressor
and a Reuse layer no indexer: a checkpoint may hold them (a V4 checkpoint whose config names
V4.1's sources) or not; held, they are left unread and counted in one log line."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from dhisparse.family.hf_config import ConfigError
from dhisparse.family.hf_dir import model_name
from dhisparse.family.quantization_config import SCALE_SUFFIX, CheckpointError, block_size
from dhisparse.family.v4_config import V4Config, parse_v4_config
from services.worker.model.v4_decoder import V4Decoder
from services.worker.model.v4_mtp import MTPBlock
from services.worker.model.v4_precision import SERVING_DTYPES, to_serving_dtype
from services.worker.model.v4_serving import V4Model
from services.worker.model.weight_format import BF16, WeightFormat, resolve
from services.worker.ops.fp8_linear import Mode
from services.worker.weights.checkpoint import INDEX_FILE, WEIGHTS_FILE
from services.worker.weights.v4_quantized import Slot, Stored, dense, fill, slots

log = logging.getLogger(__name__)

# transformers' names -> DeepSeek's, applied in order (native names are fixed points).
_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^model\.", ""),
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"(^|\.)hc_head\.hc_(fn|base|scale)$", r"\1hc_head_\2"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.position_bias$", ".ape"),
    (r"\.kv_norm\.", ".norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
)
_FUSED = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(gate_up_proj|down_proj)$")
_MTP = re.compile(r"^(model\.)?mtp\.")


def native_name(name: str) -> str:
    """One tensor's name in DeepSeek's naming (fused experts aside: ``native_tensors``)."""
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def native_tensors(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """One stored tensor -> its tensors in DeepSeek's naming: a fused expert tensor splits into
    the experts' ``w1`` / ``w3`` (the gate, then the up half of ``gate_up_proj``) or ``w2``."""
    name = native_name(name)
    fused = _FUSED.match(name)
    if fused is None:
        return {name: t}
    prefix, kind = fused.groups()
    out = {}
    for e, w in enumerate(t):
        if kind == "down_proj":
            out[f"{prefix}.{e}.w2.weight"] = w
        else:
            gate, up = w.chunk(2, dim=0)
            out[f"{prefix}.{e}.w1.weight"] = gate
            out[f"{prefix}.{e}.w3.weight"] = up
    return out


def _stored(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (one file, or the index's shards)."""
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / shard for name, shard in weight_map.items()}
    single = path / WEIGHTS_FILE
    if not single.exists():
        raise CheckpointError(f"{path}: neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _scale_name(weight: str, names: dict[str, Path]) -> str | None:
    """The scale tensor of ``X.weight``: DeepSeek's ``X.scale`` or transformers'
    ``X.weight_scale_inv``."""
    for name in (weight.removesuffix(".weight") + ".scale", weight + SCALE_SUFFIX):
        if name in names:
            return name
    return None


def _is_scale(name: str) -> bool:
    """A quantized weight's scales (not the hyper-connections' ``attn_hc.scale``)."""
    return name.endswith(SCALE_SUFFIX) or (
        name.endswith(".scale") and not name.endswith("hc.scale")
    )


def read_v4_config(path: str | Path) -> tuple[V4Config, tuple[int, int] | None]:
    """(the model, the FP8 block of its ``quantization_config`` or None)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    return parse_v4_config(raw), block_size(raw.get("quantization_config"))


def load_v4_model(path: str | Path, mtp: bool = False, fmt: WeightFormat = BF16) -> V4Decoder:
    """The V4 checkpoint in ``path`` as a ``V4Decoder`` on the CPU, its dense tensors in fp32
    (every tensor read whole: tiny checkpoints); every parameter must come from the checkpoint
    and every tensor but the MTP layer's must be used. FP8 e4m3 weights (block scales) and FP4
    e2m1 experts (per-32 scales) are dequantised here, in fp32, or, with ``fmt.fp8``, written
    into the model's quantized projections and experts (as stored where the formats agree:
    ``weights/v4_quantized``). ``mtp``: the MTP layer too (``mtp.0.*``, all of it used); a
    config with ``num_nextn_predict_layers`` other than 1 is a ConfigError."""
    path = Path(path)
    cfg, block = read_v4_config(path)
    if mtp and cfg.mtp_layers != 1:
        raise ConfigError(
            f"{path}: --drafter mtp needs num_nextn_predict_layers 1, the config has "
            f"{cfg.mtp_layers}"
        )
    model = V4Decoder(cfg, MTPBlock(cfg, fmt) if mtp else None, fmt)
    quantized, owners = slots(model)
    want = {n: t for n, t in model.state_dict().items() if not n.startswith(owners)}
    names = _stored(path)
    found: dict[str, torch.Tensor] = {}
    filled: set[str] = set()
    skipped, unshared, inexact, used_scales = 0, 0, 0, set()
    unbuilt = unbuilt_prefixes(cfg)
    for stored in sorted(names):
        if not mtp and _MTP.match(stored):
            skipped += 1
            continue
        if native_name(stored).startswith(unbuilt):
            unshared += not _is_scale(stored)
            continue
        if _is_scale(stored):
            continue
        t = _read(names, stored)
        if t.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8):
            scale = _scale_name(stored, names)
            if scale is None:
                raise CheckpointError(f"{path}: {stored} is stored as {t.dtype} without a scale")
            used_scales.add(scale)
            raw = _quantized(path, stored, t, _read(names, scale), block, cfg)
            slot = quantized.get(native_name(stored))
            held = _fill(path, stored, slot, raw)
            if isinstance(held, int):
                filled.add(native_name(stored))
                inexact += held
                continue
            t = held
        target = want.get(native_name(stored))
        if target is not None and not target.is_floating_point():
            t = t.to(target.dtype)
        elif t.is_floating_point():
            t = t.float()
        for name, tensor in native_tensors(stored, t).items():
            slot = quantized.get(name)
            if slot is None:
                found[name] = tensor
                continue
            _fill(path, stored, slot, Stored("dense", tensor))
            filled.add(name)
    unused = sorted(n for n in names if _is_scale(n) and n not in used_scales)
    unused = [n for n in unused if not native_name(n).startswith(unbuilt)]
    if unused and not all(not mtp and _MTP.match(n) for n in unused):
        raise CheckpointError(f"{path}: scales {unused[:8]} scale no quantized weight")
    if inexact:
        log.warning(
            "%s: %d FP4 expert values held in FP8 rounded (blocks whose scales span more than "
            "14 binades; --weight-dtype fp4 holds them exactly)",
            path,
            inexact,
        )
    if skipped:
        log.info("%s: %d MTP tensors (mtp.*) not loaded: the MTP layer is not run", path, skipped)
    if unshared:
        log.info(
            "%s: %d tensors of compressors and indexers the config's shared sources "
            "(kv_source_layers, index_source_layers) leave unused: not loaded",
            path,
            unshared,
        )
    missing = sorted((set(want) - set(found)) | (set(quantized) - filled))
    unexpected = sorted(set(found) - set(want))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: DeepSeek-V4 tensors missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, t in found.items():
        if t.shape != want[name].shape:
            raise CheckpointError(
                f"{path}: {name} has shape {list(t.shape)}, the config gives {list(want[name].shape)}"
            )
    model.load_state_dict(found, strict=False)
    return model.eval()


def unbuilt_prefixes(cfg: V4Config) -> tuple[str, ...]:
    """Name prefixes (DeepSeek's naming) of the compressors and indexers a V4 checkpoint has
    that the config's shared sources do not build: a consumer's compressor and indexer keys
    (it reads its KV source's), a Reuse layer's indexer (it attends its index source's
    selection)."""
    out: list[str] = []
    share = cfg.sharing
    for i, kind in enumerate(cfg.attention):
        if kind == "sliding":
            continue
        at = f"layers.{i}.attn."
        if not share.owns_rows(i):
            out += [f"{at}compressor.", f"{at}indexer.compressor."]
        if kind == "csa" and not share.runs_indexer(i):
            out.append(f"{at}indexer.")
    return tuple(out)


def _read(names: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(names[name]), framework="pt") as f:
        return f.get_tensor(name)


def _quantized(
    path: Path, name: str, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
    cfg: V4Config,
) -> Stored:  # fmt: skip
    """An FP8 block-scaled weight or an FP4 packed expert as stored; CheckpointError naming
    the tensor when the config does not declare its format."""
    if w.dtype == torch.float8_e4m3fn:
        if block is None:
            raise CheckpointError(
                f"{path}: {name} {list(w.shape)} is FP8 but config.json has no quantization_config"
            )
        return Stored("fp8", w, scale, block)
    if cfg.expert_dtype != "fp4":
        raise CheckpointError(
            f"{path}: {name} {list(w.shape)} {w.dtype}: packed FP4 but config.json has "
            f"expert_dtype {cfg.expert_dtype!r}"
        )
    return Stored("fp4", w, scale)


def _fill(path: Path, name: str, slot: Slot | None, raw: Stored) -> torch.Tensor | int:
    """``fill(slot, raw)`` (-> its count of values held inexactly), or without a slot ``raw``
    dequantised; a ValueError (a scale grid or shape that does not fit) as a CheckpointError
    naming the tensor."""
    try:
        if slot is None:
            return dense(raw)
        return fill(slot, raw)
    except ValueError as e:
        raise CheckpointError(
            f"{path}: {name} {list(raw.weight.shape)} {raw.weight.dtype}: {e}"
        ) from None


def load_v4_served(
    path: str | Path, device: str | torch.device, dtype: torch.dtype | None, mtp: bool,
    weight_dtype: str, world_size: int, fp8_mode: Mode = "w8a16",
) -> V4Model:  # fmt: skip
    """The V4 checkpoint in ``path`` as the engine's model (``V4Model``) on ``device``, one
    rank, with its MTP layer when ``mtp``: its tensors in ``dtype`` (default float32; bfloat16
    keeps the tensors transformers keeps in fp32 there, ``v4_precision``), the projections and
    routed experts held as ``weight_dtype`` says (``weight_format.resolve``: "auto" holds an
    FP8 checkpoint of 128x128 blocks in FP8, its FP4 experts re-held in FP8 blocks; "bf16"
    dequantises at load; "fp8" / "fp4" the experts in FP8 / FP4 whatever the checkpoint
    stores). Anything else asked for (another ``dtype``, ``world_size`` > 1) is a ConfigError
    naming it."""
    unsupported = [
        what
        for what, asked in (
            (f"dtype {dtype}", dtype not in (None, *SERVING_DTYPES)),
            (f"{world_size} ranks (tensor / expert parallel)", world_size > 1),
        )
        if asked
    ]
    if unsupported:
        raise ConfigError(
            f"DeepSeek-V4 ({path}) is served in float32 or bfloat16 on one rank; not with "
            f"{', '.join(unsupported)}"
        )
    raw = json.loads((Path(path) / "config.json").read_text())
    _, block = read_v4_config(path)
    fmt = resolve(weight_dtype, block == (128, 128), fp8_mode)
    net = to_serving_dtype(load_v4_model(path, mtp, fmt), dtype or torch.float32)
    return V4Model(net.to(device), model_name(path, raw))
