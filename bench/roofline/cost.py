"""The bytes and FLOPs each region of a pass must move, from the model's dimensions and the
pass's batch alone: what the roofline is made of. Pure Python (no torch): tests check it
against hand-computed numbers.

"Must move" counts every weight the pass reads once (FP8 projections at one byte an element
plus their fp32 128x128 block scales; dense weights at their element size), the routed experts
the pass's tokens select (each distinct expert once), the stored KV rows each token attends
(min(index_topk, visible) of them) and the index keys each producer scores (every visible one),
and each region's activations in and out. Work a design adds on top (dequantized copies,
gathers into workspaces, sorting) is not counted: a region whose time is all such work shows
as time with no bytes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

BLOCK = 128  # the FP8 weights' scale block (128 x 128)
SCALE_BYTES = 4  # fp32 block scales


@dataclass(frozen=True)
class Cost:
    bytes: float = 0.0
    flops: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.bytes + other.bytes, self.flops + other.flops)


@dataclass(frozen=True)
class LayerDims:
    sparse_mlp: bool  # MoE (else the dense MLP)
    indexer: bool  # an index producer (runs its indexer; followers take its selection)


@dataclass(frozen=True)
class Dims:
    """A DeepSeek-V3.2 / GLM-5 model's sizes (config.json's names) and how it is held."""

    hidden: int
    vocab: int
    heads: int
    q_lora: int
    kv_lora: int
    rope: int  # qk_rope_head_dim
    nope: int  # qk_nope_head_dim
    v_head: int
    index_heads: int
    index_dim: int
    index_topk: int
    intermediate: int  # the dense MLP's
    moe_intermediate: int  # per routed (and shared) expert
    n_shared: int
    n_routed: int
    top_k: int
    layers: tuple[LayerDims, ...]
    fp8: bool  # projections, shared and routed experts held in FP8 with block scales
    weight_bytes: int  # an element of a dense (non-FP8) weight: the serving dtype's
    act_bytes: int  # an activation element (the serving dtype)
    row_bytes: int  # one stored KV row (the engine's kv_cache_dtype)
    key_bytes: int  # one stored index key


@dataclass(frozen=True)
class PassShape:
    """One forward pass: ``visible[t]`` rows the pass's token t sees (its position + 1), for
    each MoE layer the number of distinct routed experts its tokens select, and how many of its
    tokens the head scores (every token of a decode pass; a prompt's last, in prefill)."""

    visible: tuple[int, ...]
    experts: Mapping[int, int]
    sampled: int

    @property
    def tokens(self) -> int:
        return len(self.visible)


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def projection(d: Dims, n_out: int, k: int, tokens: int) -> Cost:
    """y [tokens, n_out] = x [tokens, k] @ W^T: the weight (FP8 with its scales, or dense),
    x in and y out; 2 * tokens * n_out * k FLOPs."""
    if d.fp8:
        weight = n_out * k + blocks(n_out) * blocks(k) * SCALE_BYTES
    else:
        weight = n_out * k * d.weight_bytes
    acts = tokens * (k + n_out) * d.act_bytes
    return Cost(weight + acts, 2.0 * tokens * n_out * k)


def expert_bytes(d: Dims) -> int:
    """One routed expert's weights: gate_up [2I, D] and down [D, I] (FP8 with scales, or dense)."""
    i, h = d.moe_intermediate, d.hidden
    if d.fp8:
        return 3 * i * h + (2 * blocks(i) * blocks(h) + blocks(h) * blocks(i)) * SCALE_BYTES
    return 3 * i * h * d.weight_bytes


def norm(d: Dims, width: int, tokens: int, weights: int = 1) -> Cost:
    """An RMSNorm (``weights`` 1) or LayerNorm with bias (2): activations in and out, weights."""
    return Cost(2 * tokens * width * d.act_bytes + weights * width * d.weight_bytes)


def elementwise(d: Dims, width: int, tokens: int, operands: int) -> Cost:
    """An element-wise op reading ``operands`` - 1 tensors of [tokens, width] and writing one."""
    return Cost(operands * tokens * width * d.act_bytes)


def pass_costs(d: Dims, shape: PassShape) -> dict[str, Cost]:
    """Region name -> what the pass must move there, summed over layers. Region names are the
    instrumentation's (``bench/roofline/regions.py``)."""
    n, h, a = shape.tokens, d.hidden, d.act_bytes
    attended = sum(min(d.index_topk, v) for v in shape.visible)
    scored = sum(shape.visible)
    latent = d.kv_lora + d.rope
    out: dict[str, Cost] = {}

    def add(region: str, c: Cost) -> None:
        out[region] = out.get(region, Cost()) + c

    add("embed", Cost(2 * n * h * a))
    for i, layer in enumerate(d.layers):
        add("attn_norm", norm(d, h, n))
        add("mlp_norm", norm(d, h, n))
        add("decoder", elementwise(d, h, n, 3) + elementwise(d, h, n, 3))  # two residual adds
        add("attn.q_a_proj", projection(d, d.q_lora, h, n))
        add("attn.q_a_layernorm", norm(d, d.q_lora, n))
        add("attn.q_b_proj", projection(d, d.heads * (d.nope + d.rope), d.q_lora, n))
        add("attn.kv_a_proj_with_mqa", projection(d, latent, h, n))
        add("attn.kv_a_layernorm", norm(d, d.kv_lora, n))
        add("attn.token_rows", elementwise(d, latent, n, 2))
        # the absorbed query: q_nope through W_UK [H, nope, kv_lora], read from kv_b_proj
        w_uk = d.heads * d.nope * d.kv_lora
        q_io = n * d.heads * (d.nope + d.rope + latent) * a
        add("attn.queries", Cost(w_uk * d.weight_bytes + q_io, 2.0 * n * w_uk))
        add("kv.write_rows", Cost(n * d.row_bytes))
        add("attn.sparse", Cost(
            attended * d.row_bytes + n * d.heads * (latent + d.kv_lora) * a,
            2.0 * d.heads * attended * (latent + d.kv_lora),
        ))  # fmt: skip
        w_uv = d.heads * d.v_head * d.kv_lora
        o_io = n * d.heads * (d.kv_lora + d.v_head) * a
        add("attn.output", Cost(w_uv * d.weight_bytes + o_io, 2.0 * n * w_uv))
        add("attn.o_proj", projection(d, h, d.heads * d.v_head, n))
        if layer.indexer:
            add("indexer.wk", projection(d, d.index_dim, h, n))
            add("indexer.k_norm", norm(d, d.index_dim, n, weights=2))
            add("indexer.keys", elementwise(d, d.index_dim, n, 2))
            add("kv.index_keys.write", Cost(n * d.key_bytes))
            add("indexer.wq_b", projection(d, d.index_heads * d.index_dim, d.q_lora, n))
            # weights_proj stays fp32 whatever the serving dtype
            add("indexer.queries", Cost(
                d.index_heads * h * 4 + n * h * a, 2.0 * n * d.index_heads * h
            ))  # fmt: skip
            add("indexer.select", Cost(
                scored * d.key_bytes + n * d.index_heads * (d.index_dim + 1) * a,
                2.0 * d.index_heads * scored * d.index_dim,
            ))  # fmt: skip
        if layer.sparse_mlp:
            add("mlp.gate", Cost(
                d.n_routed * h * d.weight_bytes + d.n_routed * 4 + n * h * a,
                2.0 * n * d.n_routed * h,
            ))  # fmt: skip
            chosen = shape.experts.get(i, 0)
            add("mlp.experts", Cost(
                chosen * expert_bytes(d) + 2 * n * h * a,
                2.0 * n * d.top_k * 3 * d.moe_intermediate * h,
            ))  # fmt: skip
            shared = d.moe_intermediate * d.n_shared
            add("mlp.shared_experts.gate_proj", projection(d, shared, h, n))
            add("mlp.shared_experts.up_proj", projection(d, shared, h, n))
            add("mlp.shared_experts.down_proj", projection(d, h, shared, n))
            add("mlp.shared_experts", elementwise(d, shared, n, 3))  # silu(gate) * up
            add("mlp", elementwise(d, h, n, 3))  # routed + shared
        else:
            add("mlp.gate_proj", projection(d, d.intermediate, h, n))
            add("mlp.up_proj", projection(d, d.intermediate, h, n))
            add("mlp.down_proj", projection(d, h, d.intermediate, n))
            add("mlp", elementwise(d, d.intermediate, n, 3))
    add("norm", norm(d, h, n))
    if shape.sampled:  # the head's GEMM writes fp32 logits
        m = shape.sampled
        add("lm_head", Cost(
            d.vocab * h * d.weight_bytes + m * h * a + m * d.vocab * 4, 2.0 * m * d.vocab * h
        ))  # fmt: skip
    return out


def total(costs: Mapping[str, Cost]) -> Cost:
    return sum(costs.values(), Cost())


def passes_costs(d: Dims, shapes: Sequence[PassShape]) -> dict[str, Cost]:
    """The regions' costs summed over several passes (a prompt prefilled in chunks)."""
    out: dict[str, Cost] = {}
    for shape in shapes:
        for region, c in pass_costs(d, shape).items():
            out[region] = out.get(region, Cost()) + c
    return out
