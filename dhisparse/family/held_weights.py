"""The tensors a worker's DeepSeek-V3.2 / GLM-5 model holds (``MLADecoder``'s parameters and
buffers), listed from its config alone: our name, the whole model's shape, how each is stored
and which part of the model it belongs to. Pure Python: ``dhisparse plan`` applies each
layout's cuts (``parallel_layout.RankLayout.cut``) to this list to size a rank's weights,
without torch or the weights; tests check it against the models the worker builds.

Storage follows ``weight_format``: with FP8 weights, the projections a released FP8 checkpoint
stores in FP8 are e4m3 with an fp32 scale per 128 x 128 block (``X_scale_inv``; the routed
experts one grid per expert, gate's over up's), except the modules the checkpoint's
``modules_to_not_convert`` names (held in the serving dtype, as the worker holds what the
checkpoint stores unquantized). ``kv_b_proj`` (absorbed), the embeddings and heads, norms,
routers and the MTP layer's ``eh_proj`` are in the serving dtype; the indexer's
``weights_proj`` and the routers' correction biases in fp32.

With the MTP layer (``--drafter mtp``) its head is the target's (``lm_head``, or the embedding
when tied): the worker shares it when the checkpoint's copy equals it, as in the released
checkpoints, or when there is none."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from dhisparse.family.hf_config import MLAConfig
from dhisparse.family.quantization_config import FP8_EDGE, SCALE_SUFFIX

Storage = Literal["serving", "fp32", "fp8"]
# The parts a plan reports, in its order: each is wholly replicated or wholly split under
# every layout (the MTP layer, one part of its own, holds some of each).
PARTS = (
    "mla_latent",  # q_a, kv_a (the stored row) and their norms
    "mla_heads",  # q_b, kv_b, o: per attention head
    "indexer",
    "dense_mlp",
    "shared_experts",
    "routed_experts",
    "router",
    "norms",  # every layer's two and the final one
    "vocab",  # embeddings and lm_head
    "mtp",  # the MTP layer, held for --drafter mtp
)
Part = Literal[
    "mla_latent", "mla_heads", "indexer", "dense_mlp", "shared_experts", "routed_experts",
    "router", "norms", "vocab", "mtp",
]  # fmt: skip
FIXED_BYTES = {"fp32": 4, "fp8": 1}
SERVING_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the worker's --dtype


@dataclass(frozen=True)
class HeldTensor:
    """One parameter or buffer: ``shape`` is the whole model's (a rank holds its cut);
    ``storage`` "serving" is the model's dtype, "fp8" one byte per element, "fp32" four."""

    name: str
    shape: tuple[int, ...]
    storage: Storage
    part: Part

    def nbytes(self, shape: tuple[int, ...], serving_bytes: int) -> int:
        """Bytes of this tensor at ``shape`` (the whole one, or a rank's cut of it)."""
        return math.prod(shape) * FIXED_BYTES.get(self.storage, serving_bytes)


def held_tensors(
    cfg: MLAConfig, *, fp8: bool, mtp: bool = False, not_converted: Sequence[str] = ()
) -> tuple[HeldTensor, ...]:
    """Every tensor the model of ``cfg`` holds: its weights FP8 or not (``fp8``), with the MTP
    layer (``mtp``); ``not_converted``: the checkpoint modules stored unquantized (an FP8
    checkpoint's ``modules_to_not_convert``; a module is unconverted when one of them is a
    substring of its checkpoint name, as transformers matches them)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out = [HeldTensor("embed.weight", (v, d), "serving", "vocab")]
    fmt = _Format(fp8, tuple(not_converted))
    for i in range(cfg.num_layers):
        producer = cfg.indexer_types[i] == "full"
        out += _layer(cfg, i, f"layers.{i}.", producer, cfg.mlp_types[i], fmt)
    out.append(HeldTensor("norm.weight", (d,), "serving", "norms"))
    if not cfg.tie_word_embeddings:
        out.append(HeldTensor("lm_head.weight", (v, d), "serving", "vocab"))
    if mtp:
        n = cfg.num_layers
        layer = _layer(cfg, n, "mtp.", producer=True, mlp=cfg.mtp_mlp, fmt=fmt)
        fusion = [
            HeldTensor("mtp.enorm.weight", (d,), "serving", "mtp"),
            HeldTensor("mtp.hnorm.weight", (d,), "serving", "mtp"),
            HeldTensor("mtp.eh_proj.weight", (d, 2 * d), "serving", "mtp"),
            HeldTensor("mtp.shared_head.norm.weight", (d,), "serving", "mtp"),
        ]
        out += [HeldTensor(t.name, t.shape, t.storage, "mtp") for t in (*layer, *fusion)]
    return tuple(out)


@dataclass(frozen=True)
class _Format:
    fp8: bool
    not_converted: tuple[str, ...]

    def linear(
        self, name: str, module: str, shape: tuple[int, int], part: Part
    ) -> list[HeldTensor]:
        """A projection ``[out, in]`` that FP8 weights hold in FP8 (with its block grid) unless
        the checkpoint stores ``module`` (its checkpoint name) unquantized."""
        if not self.fp8 or any(m in module for m in self.not_converted):
            return [HeldTensor(name, shape, "serving", part)]
        grid = tuple(_blocks(n) for n in shape)
        return [
            HeldTensor(name, shape, "fp8", part),
            HeldTensor(name + SCALE_SUFFIX, grid, "fp32", part),
        ]


def _layer(
    cfg: MLAConfig, index: int, ours: str, producer: bool, mlp: str, fmt: _Format
) -> list[HeldTensor]:
    """Decoder layer ``index`` under our prefix ``ours`` (``layers.{i}.`` or ``mtp.``)."""
    d, h = cfg.hidden_size, cfg.num_heads
    ckpt = f"model.layers.{index}."
    q_lora, kv_lora, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim

    def lin(name: str, module: str, shape: tuple[int, int], part: Part) -> list[HeldTensor]:
        return fmt.linear(f"{ours}{name}.weight", ckpt + module, shape, part)

    def serving(name: str, shape: tuple[int, ...], part: Part) -> HeldTensor:
        return HeldTensor(ours + name, shape, "serving", part)

    out = [
        serving("attn_norm.weight", (d,), "norms"),
        *lin("attn.q_a_proj", "self_attn.q_a_proj", (q_lora, d), "mla_latent"),
        serving("attn.q_a_layernorm.weight", (q_lora,), "mla_latent"),
        *lin("attn.q_b_proj", "self_attn.q_b_proj", (h * cfg.qk_head_dim, q_lora), "mla_heads"),
        *lin("attn.kv_a_proj_with_mqa", "self_attn.kv_a_proj_with_mqa", (kv_lora + rope, d),
             "mla_latent"),
        serving("attn.kv_a_layernorm.weight", (kv_lora,), "mla_latent"),
        serving("attn.kv_b_proj.weight", (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), kv_lora),
                "mla_heads"),
        *lin("attn.o_proj", "self_attn.o_proj", (d, h * cfg.v_head_dim), "mla_heads"),
        serving("mlp_norm.weight", (d,), "norms"),
    ]  # fmt: skip
    if producer:
        heads, dim = cfg.index_n_heads, cfg.index_head_dim
        out += [
            *lin("indexer.wq_b", "self_attn.indexer.wq_b", (heads * dim, q_lora), "indexer"),
            *lin("indexer.wk", "self_attn.indexer.wk", (dim, d), "indexer"),
            serving("indexer.k_norm.weight", (dim,), "indexer"),
            serving("indexer.k_norm.bias", (dim,), "indexer"),
            HeldTensor(ours + "indexer.weights_proj.weight", (heads, d), "fp32", "indexer"),
        ]
    if mlp == "dense":
        return out + list(_swiglu(lin, "mlp.", cfg.intermediate_size, d, "dense_mlp"))
    moe = cfg.moe
    out += [
        serving("mlp.gate.weight", (moe.n_routed, d), "router"),
        HeldTensor(ours + "mlp.gate.e_score_correction_bias", (moe.n_routed,), "fp32", "router"),
        *_experts(ours + "mlp.experts.", moe.n_routed, moe.intermediate, d, fmt.fp8),
        *_swiglu(lin, "mlp.shared_experts.", moe.intermediate * moe.n_shared, d, "shared_experts"),
    ]
    return out


# (our name, checkpoint module, [out, in], part) -> the projection's tensors
Linear = Callable[[str, str, tuple[int, int], Part], list[HeldTensor]]


def _swiglu(lin: Linear, prefix: str, width: int, d: int, part: Part) -> Iterator[HeldTensor]:
    """gate, up [width, d] and down [d, width] (a dense MLP or the shared experts)."""
    yield from lin(prefix + "gate_proj", prefix + "gate_proj", (width, d), part)
    yield from lin(prefix + "up_proj", prefix + "up_proj", (width, d), part)
    yield from lin(prefix + "down_proj", prefix + "down_proj", (d, width), part)


def _experts(prefix: str, e: int, i: int, d: int, fp8: bool) -> list[HeldTensor]:
    """The routed experts, stacked: gate_up [E, 2I, D] and down [E, D, I]; FP8 with one grid per
    expert (gate_up's: gate's ceil(I / 128) block rows over up's)."""
    storage: Storage = "fp8" if fp8 else "serving"
    out = [
        HeldTensor(prefix + "gate_up_proj", (e, 2 * i, d), storage, "routed_experts"),
        HeldTensor(prefix + "down_proj", (e, d, i), storage, "routed_experts"),
    ]
    if fp8:
        out += [
            HeldTensor(prefix + "gate_up_proj" + SCALE_SUFFIX, (e, 2 * _blocks(i), _blocks(d)),
                       "fp32", "routed_experts"),
            HeldTensor(prefix + "down_proj" + SCALE_SUFFIX, (e, _blocks(d), _blocks(i)), "fp32",
                       "routed_experts"),
        ]  # fmt: skip
    return out


def _blocks(n: int) -> int:
    return -(-n // FP8_EDGE)
