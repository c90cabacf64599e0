"""Tiny random DeepSeek-V4 checkpoints, built and saved by transformers 5.17.0 (the oracle),
with every tensor that initialises to zero or one moved off it: attention sinks, compressor
and indexer position biases, router correction biases, norms, the hyper-connections' bases
and scales, and ``tid2eid`` (distinct experts per token)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import ResidencyConfig
from services.worker.ops import fp4_quantize
from services.worker.ops.fp8_blockwise import quantize_blockwise
from services.worker.request.request import SamplingParams

VOCAB = 300

# A sliding-only layer, CSA (rate 4, with its indexer) and HCA (rate 8) layers, two hash-routed
# MoE layers; a window of 8 and index_topk 4, so prompts of a few dozen tokens are sparse on
# every branch; swiglu_limit low enough that the clamps act on unit-scale activations.
LAYERS = (
    "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
    "compressed_sparse_attention",
)  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1}  # fmt: skip


def v4_config(**over) -> DeepseekV4Config:
    kw = dict(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32,
        o_groups=2, o_lora_rank=16, sliding_window=8, layer_types=list(LAYERS),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], n_routed_experts=8,
        num_experts_per_tok=2, index_n_heads=16, index_head_dim=16, index_topk=4, hc_mult=4,
        swiglu_limit=1.5, max_position_embeddings=1024, rope_parameters=dict(YARN),
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return DeepseekV4Config(**(kw | over))


def build(config: DeepseekV4Config, seed: int = 0) -> DeepseekV4ForCausalLM:
    """A transformers V4 model of ``config`` in fp32 with seeded weights of unit-scale
    activations: projections N(0, 1/fan_in), embeddings N(0, 1), norm weights and the
    hyper-connection scales 1 + N(0, 0.2^2), sinks N(0, 1), position biases N(0, 0.5^2),
    correction and hyper-connection biases N(0, 0.1^2); each token's hash experts distinct."""
    config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                picks = torch.rand(t.shape[0], config.n_routed_experts, generator=g).argsort(-1)
                t.copy_(picks[:, : t.shape[1]])
                continue
            r = torch.randn(t.shape, generator=g)
            if name.endswith(("norm.weight", "layernorm.weight", ".scale", "hc_scale")):
                t.copy_(1 + 0.2 * r)
            elif name.endswith("sinks"):
                t.copy_(r)
            elif name.endswith("position_bias"):
                t.copy_(0.5 * r)
            elif name.endswith(("e_score_correction_bias", ".base", "hc_base")):
                t.copy_(0.1 * r)
            elif "embed_tokens" in name:
                t.copy_(r)
            else:
                t.copy_(r / math.sqrt(t.shape[-1]))
    return model


def save_hub_style(model: DeepseekV4ForCausalLM, path: Path) -> Path:
    """The checkpoint as the hub ships it: DeepSeek's names without the ``model.`` prefix
    (``embed.weight``, ``hc_head_fn``, ``norm.weight``, ``head.weight``) and the legacy config
    keys (``compress_ratios`` with a trailing MTP entry, ``num_hash_layers``,
    ``qk_rope_head_dim``, ``rope_scaling`` + ``rope_theta`` + ``compress_rope_theta``; the
    legacy ``compress_rate_hca`` where the HCA rate is not the releases' 128)."""
    model.save_pretrained(path)
    weights = load_file(str(path / "model.safetensors"))
    renamed = {}
    for name, t in weights.items():
        name = name.removeprefix("model.").replace("embed_tokens.", "embed.")
        renamed[name.replace("hc_head.hc_", "hc_head_")] = t
    save_file(renamed, str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    rates = raw.pop("compress_rates")
    ratios = {"sliding_attention": 0, "compressed_sparse_attention": 4,
              "heavily_compressed_attention": 128}  # fmt: skip
    raw["compress_ratios"] = [ratios[t] for t in raw.pop("layer_types")] + [0]
    if rates["heavily_compressed_attention"] != 128:  # the releases' rate needs no key
        raw["compress_rate_hca"] = rates["heavily_compressed_attention"]
    raw["num_hash_layers"] = raw.pop("mlp_layer_types").count("hash_moe")
    raw["qk_rope_head_dim"] = int(raw["head_dim"] * raw.pop("partial_rotary_factor"))
    compress = raw.pop("rope_parameters")["compress"]
    raw["rope_scaling"] = {
        "type": "yarn", **{k: compress[k] for k in ("factor", "original_max_position_embeddings",
                                                    "beta_fast", "beta_slow")},
    }  # fmt: skip
    raw["compress_rope_theta"] = compress["rope_theta"]
    raw["torch_dtype"] = raw.pop("dtype")
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


def save_module_names(model: DeepseekV4ForCausalLM, path: Path) -> Path:
    """The checkpoint under transformers' module names (a raw ``state_dict``: fused experts,
    ``self_attn.compressor.indexer.*``), with the config ``save_pretrained`` writes."""
    model.config.save_pretrained(path)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"))
    return path


# ---- the released form: FP8 e4m3 dense weights, FP4 e2m1 routed experts ----------------------
_FP8 = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$"
    r"|^mtp\.0\.[eh]_proj\.weight$"
)
_FP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [R, C]`` -> (packed int8 [R, C / 2], scale [R, C / 32] float8_e8m0fnu), as the
    release stores FP4 experts (``ops.fp4_quantize``, the bytes as int8)."""
    packed, scale = fp4_quantize.quantize_fp4(w)
    return packed.view(torch.int8), scale


def released_tensors(tensors: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """Hub-named tensors as DeepSeek releases them: the attention projections, the indexer's
    query projection, the shared experts and the MTP layer's ``e_proj`` / ``h_proj`` FP8 e4m3 in
    ``block`` x ``block`` blocks with UE8M0 scales ``X.scale``, the routed experts FP4 e2m1."""
    out = {}
    for name, t in tensors.items():
        base = name.removesuffix(".weight")
        if _FP8.search(name):
            out[name], out[base + ".scale"] = quantize_blockwise(t, (block, block), "F8_E8M0")
        elif _FP4.search(name):
            out[name], out[base + ".scale"] = quantize_fp4(t)
        else:
            out[name] = t
    return out


def save_released_form(model: DeepseekV4ForCausalLM, path: Path, block: int = 16) -> Path:
    """``save_hub_style``, then quantised as DeepSeek releases V4: the attention projections,
    the indexer's query projection and the shared experts FP8 e4m3 in ``block`` x ``block``
    blocks with UE8M0 scales ``X.scale``; the routed experts FP4 e2m1 (``expert_dtype`` fp4);
    ``quantization_config`` as the release states it, but for the block."""
    save_hub_style(model, path)
    tensors = released_tensors(load_file(str(path / "model.safetensors")), block)
    save_file(tensors, str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    raw["expert_dtype"] = "fp4"
    raw["quantization_config"] = {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
        "weight_block_size": [block, block],
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


def token_ids(n: int, seed: int) -> torch.Tensor:
    """[n] random token ids of the tiny vocabulary (its two lowest ids, BOS and EOS, left out)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n,), generator=g)


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    """Same shape, and the largest difference within ``rtol`` of ``want``'s largest value."""
    assert got.shape == want.shape
    err = (got - want).abs().max() / want.abs().max()
    assert err <= rtol, f"relative max error {err:.3g}"


# ---- the MTP layer (``mtp.0.*``), which transformers neither builds nor saves ------------------
@dataclass(frozen=True)
class TinyV4MTP:
    """A random MTP layer for a target of ``v4_config()``: ``block`` is a one-layer
    transformers V4 model whose layer 0 is the MTP block (sliding-window attention, learned
    routing, as the releases' trailing ``compress_ratios`` entry 0 makes it), whose hyper head
    and final norm are the layer's own; ``enorm``, ``hnorm`` [d] and ``e_proj``, ``h_proj``
    [d, d] are the input fusion. ``tensors``: the layer under ``mtp.0.`` in DeepSeek's names
    (``hub``) or in transformers' module names behind ``model.`` (``modules``)."""

    block: torch.nn.Module
    enorm: torch.Tensor
    hnorm: torch.Tensor
    e_proj: torch.Tensor
    h_proj: torch.Tensor
    tensors: dict[str, torch.Tensor]


def mtp_layer(seed: int, tmp: Path, names: str = "hub") -> TinyV4MTP:
    """The MTP layer of a ``v4_config()`` target, every norm, bias and sink random; ``tmp``: a
    scratch directory."""
    config = v4_config(num_hidden_layers=1, layer_types=["sliding_attention"],
                       mlp_layer_types=["moe"])  # fmt: skip
    block = build(config, seed=seed)
    if names == "hub":
        block.save_pretrained(tmp)
        stored, prefix = load_file(str(tmp / "model.safetensors")), "mtp.0."
        hc_head = "model.hc_head.hc_"
    else:
        stored = {k: v.detach().clone() for k, v in block.state_dict().items()}
        prefix, hc_head = "model.mtp.0.", None
    tensors = {}
    for name, t in stored.items():
        if name.startswith("model.layers.0."):
            tensors[prefix + name.removeprefix("model.layers.0.")] = t
        elif hc_head is not None and name.startswith(hc_head):
            tensors[prefix + "hc_head_" + name.removeprefix(hc_head)] = t
        elif name.startswith("model.hc_head.") or name == "model.norm.weight":
            tensors[prefix + name.removeprefix("model.")] = t
    g = torch.Generator().manual_seed(seed + 1)
    d = config.hidden_size
    fusion = {
        "enorm.weight": 1 + 0.2 * torch.randn(d, generator=g),
        "hnorm.weight": 1 + 0.2 * torch.randn(d, generator=g),
        "e_proj.weight": torch.randn(d, d, generator=g) / math.sqrt(d),
        "h_proj.weight": torch.randn(d, d, generator=g) / math.sqrt(d),
    }
    tensors |= {prefix + k: v for k, v in fusion.items()}
    return TinyV4MTP(
        block.eval(), fusion["enorm.weight"], fusion["hnorm.weight"], fusion["e_proj.weight"],
        fusion["h_proj.weight"], tensors,
    )  # fmt: skip


# ---- an engine whose admissions reclaim history (adaptive mode, a pool of a few pages) -------
# rows per page in ``reclaiming_run``: small enough that the compressed sources' few rows
# fill pages of optional history, which admissions then reclaim
PAGE = 8


def reclaiming_run(path: Path, pages: int, new_tokens: int, pause: int) -> tuple[Engine, list]:
    """Six greedy requests over the V4 checkpoint at ``path`` in adaptive mode with a pool of
    ``pages`` pages beyond its fixed allocations, three arriving after ``pause`` steps of the
    first three: admissions reclaim optional history. (The engine, its finished requests.)"""
    kw = dict(model=str(path), mode="adaptive", max_num_seqs=4, max_model_len=512,
              hot_cache_rows=16, max_prefill_tokens=64, host_arena_mib=16, page_size=PAGE)  # fmt: skip
    probe = Engine(EngineConfig(**kw, kv_pool_mib=64))
    page_bytes = PAGE * probe.model_cfg.d_kv * 4
    fixed = (64 << 20) - probe.kv.payload.store.pages.total * page_bytes
    probe.close()
    eng = Engine(EngineConfig(
        **kw, kv_pool_mib=(fixed + pages * page_bytes) / (1 << 20),
        residency=ResidencyConfig(populate_pages=4),
    ))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    reqs = []
    for i, n in enumerate((150, 61, 197, 90, 120, 40)):
        if i == 3:
            for _ in range(pause):
                eng.step()
        reqs.append(eng.add_request(f"r{i}", token_ids(n, 900 + n).tolist(), params))
    while eng.has_work():
        eng.step()
    return eng, reqs


def interleaved_logits(model, kv, seqs: dict, passes: list) -> dict[int, torch.Tensor]:
    """Runs the requests ``seqs`` (slot -> token ids, admitted in ``kv``) through ``passes``
    (each a list of (slot, tokens this pass adds)), committing every pass; each slot's logits
    of all its tokens, once every token ran."""
    done = dict.fromkeys(seqs, 0)
    got: dict[int, list[torch.Tensor]] = {slot: [] for slot in seqs}
    for chunks in passes:
        slots = [slot for slot, _ in chunks]
        lens = [n for _, n in chunks]
        batch = ForwardBatch.build(slots, [done[s] for s in slots], lens, "cpu")
        tokens = torch.cat([seqs[s][done[s] : done[s] + n] for s, n in chunks])
        logits = model.logits(model(tokens, batch, kv))
        for (slot, n), part in zip(chunks, logits.split(lens), strict=True):
            got[slot].append(part)
            done[slot] += n
        kv.commit(batch, [done[s] for s in slots])
    assert all(done[slot] == len(ids) for slot, ids in seqs.items())
    return {slot: torch.cat(parts) for slot, parts in got.items()}
