"""Tiny random checkpoints of the real families, built and saved by transformers 5.17.0 (the
oracle), with every tensor that initialises to zero or one moved off it, and the selection
order transformers leaves to torch.topk patched to ours."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
)

if TYPE_CHECKING:
    from tests.hf_tiny_v4 import TinyV4MTP

VOCAB = 300  # above the byte tokenizer's ids, so engine prompts of bytes are valid
MASKED = -1e30  # scores at or below this are masked out (transformers adds finfo.min or -inf)

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_shared_experts=1,
    num_experts_per_tok=2, index_head_dim=32, index_n_heads=16, index_topk=16,
    first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)  # fmt: skip

# V3.2's YaRN as released (rope_theta 1e4, factor 40 over 4096 positions).
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def v32_config(**over) -> DeepseekV32Config:
    kw = dict(_COMMON, num_hidden_layers=3, n_routed_experts=8, n_group=4, topk_group=2,
              max_position_embeddings=163840, rms_norm_eps=1e-6,
              rope_parameters=dict(YARN, rope_type="yarn", rope_theta=10000.0))  # fmt: skip
    return DeepseekV32Config(**(kw | over))


def glm_config(**over) -> GlmMoeDsaConfig:
    """GLM-5.2's IndexShare (freq 4, offset 3) at 5 layers: full 0, 1, 2; 3 and 4 follow 2."""
    kw = dict(_COMMON, num_hidden_layers=5, n_routed_experts=8, n_group=1, topk_group=1,
              max_position_embeddings=202752, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6},
              index_topk_freq=4, index_skip_topk_offset=3)  # fmt: skip
    return GlmMoeDsaConfig(**(kw | over))


def build(config, seed: int = 0) -> torch.nn.Module:
    """A transformers model of ``config`` in fp32 with seeded weights of unit-scale
    activations: projections N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + N(0, 0.2^2),
    the indexer's k_norm bias and the routers' correction biases N(0, 0.1^2)."""
    cls = DeepseekV32ForCausalLM if config.model_type == "deepseek_v32" else GlmMoeDsaForCausalLM
    config._attn_implementation = "eager"
    model = cls(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            r = torch.randn(t.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                t.copy_(1 + 0.2 * r)
            elif name.endswith(("bias", "e_score_correction_bias")):
                t.copy_(0.1 * r)
            elif "embed_tokens" in name:
                t.copy_(r)
            else:
                t.copy_(r / math.sqrt(t.shape[-1]))
    return model


def save_hub_style(model: torch.nn.Module, path: Path, max_shard_size: str | None = None) -> Path:
    """save_pretrained, then config.json rewritten the way the hub ships it: V3.2 with the
    legacy ``rope_scaling`` + ``rope_theta``; GLM with ``index_topk_freq`` /
    ``index_skip_topk_offset`` and no ``indexer_types`` list."""
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    cfg_path = path / "config.json"
    raw = json.loads(cfg_path.read_text())
    rope = raw.pop("rope_parameters")
    if raw["model_type"] == "deepseek_v32":
        raw["rope_theta"] = rope.pop("rope_theta")
        rope.pop("rope_type", None)
        raw["rope_scaling"] = rope
    else:
        raw.pop("indexer_types")
        raw["rope_parameters"] = rope
    for key in ("layer_types", "mlp_layer_types", "qk_head_dim", "head_dim"):
        raw.pop(key, None)
    cfg_path.write_text(json.dumps(raw, indent=2))
    return path


@contextlib.contextmanager
def our_topk_order(margins: list[float] | None = None) -> Iterator[None]:
    """Tensor.topk (the indexer's and the routers' group step) with our order: value
    descending, the lower index first on ties. ``margins``: each top-k call (``torch.topk``
    too: the routers' expert choice) appends its nearest tie, the smallest gap between a row's
    k-th and (k+1)-th largest unmasked values (none where no row has k+1 of them; masks add
    -inf or the dtype's lowest value)."""
    original_method, original_fn = torch.Tensor.topk, torch.topk

    def note(t: torch.Tensor, k: int, dim: int) -> None:
        if margins is None or k >= t.shape[dim]:
            return
        v = original_fn(t.detach(), k + 1, dim=dim).values
        kth, next_ = v.narrow(dim, k - 1, 1), v.narrow(dim, k, 1)
        gap = (kth - next_)[next_ > MASKED]
        if gap.numel():
            margins.append(gap.min().item())

    def topk(self, k, dim=-1, largest=True, sorted=True):
        if not largest:
            return original_method(self, k, dim, largest, sorted)
        note(self, k, dim)
        order = torch.sort(self, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, order), order))

    def topk_fn(t, k, dim=-1, largest=True, sorted=True, **kw):
        if largest:
            note(t, k, dim)
        return original_fn(t, k, dim=dim, largest=largest, sorted=sorted, **kw)

    torch.Tensor.topk, torch.topk = topk, topk_fn
    try:
        yield
    finally:
        torch.Tensor.topk, torch.topk = original_method, original_fn


def well_posed_prompts(
    model: torch.nn.Module,
    lengths: tuple[int, ...],
    seed: int,
    new_tokens: int,
    margin: float = 1e-6,
) -> list[list[int]]:
    """Random prompts of ``lengths`` whose greedy continuations (``new_tokens``) under
    ``model`` choose every index row and expert by more than ``margin``: prompts are drawn
    from ``seed``'s generator until one qualifies. At a selection closer than that, kernels
    that round otherwise may choose the other row, and every later token may differ by more
    than a logit tie; such a prompt tests rounding, not the serving path."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for n in lengths:
        for _ in range(20):
            prompt = torch.randint(0, VOCAB, (n,), generator=g).tolist()
            ids = list(prompt)
            margins: list[float] = []
            for i in range(new_tokens):  # the last forward spans the whole continuation
                last = i == new_tokens - 1
                with torch.no_grad(), our_topk_order(margins if last else None):
                    logits = model(torch.tensor([ids])).logits
                if not last:
                    ids.append(int(logits[0, -1].argmax()))
            if min(margins, default=math.inf) > margin:
                prompts.append(prompt)
                break
        else:
            raise AssertionError(f"no well-posed prompt of {n} tokens in 20 draws")
    return prompts


def indexer_hooks(model: torch.nn.Module, out: dict[int, torch.Tensor]) -> list:
    """Forward hooks that record each indexer's top-k [T, k] of transformers' model into
    ``out`` (layer -> positions); the caller removes them."""
    hooks = []
    for i, layer in enumerate(model.model.layers):
        indexer = layer.self_attn.indexer
        if indexer is not None:
            hooks.append(
                indexer.register_forward_hook(
                    lambda _m, _a, res, i=i: out.__setitem__(i, res[0].long())
                )
            )
    return hooks


def reference_selections(model: torch.nn.Module, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Layer -> the indexer's top-k [T, k] in transformers' uncached full forward."""
    out: dict[int, torch.Tensor] = {}
    hooks = indexer_hooks(model, out)
    try:
        with torch.no_grad(), our_topk_order():
            model(ids.unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
    return out


def reference_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), our_topk_order():
        return model(ids.unsqueeze(0)).logits[0].float()


def greedy_under_reference(model: torch.nn.Module, prompt: list[int], out: list[int]) -> list[int]:
    """What transformers' greedy decoding gives after ``prompt`` for ``len(out)`` tokens, when
    ``out`` is it: each token of ``out`` replaced by transformers' argmax given the prompt and
    the tokens of ``out`` before it (one uncached forward). Equal to ``out`` iff ``out`` is
    transformers' greedy continuation."""
    logits = reference_logits(model, torch.tensor(prompt + out[:-1]))
    return logits[len(prompt) - 1 :].argmax(-1).tolist()


def greedy_slack(model: torch.nn.Module, prompt: list[int], out: list[int]) -> list[float]:
    """Per token of ``out``: how far its logit falls below transformers' largest, given the
    prompt and the tokens of ``out`` before it (0 where it is transformers' argmax). A token
    chosen by kernels that round otherwise may take a near-tie's other side: its slack is
    that tie's width; a wrong kernel leaves slacks of the logits' own scale."""
    logits = reference_logits(model, torch.tensor(prompt + out[:-1]))[len(prompt) - 1 :]
    chosen = logits.gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1)
    return (logits.max(-1).values - chosen).tolist()


# ---- the MTP layer (transformers does not run it; ``mtp_reference`` does) -------------------
@dataclass
class TinyMTP:
    """A random MTP layer for a target of ``num_layers`` layers: ``block`` is a one-layer
    transformers model whose layer 0 is the MTP decoder layer (MoE, with its own indexer),
    whose final norm is ``shared_head.norm`` and whose lm_head is ``shared_head.head``;
    ``enorm``, ``hnorm`` [d] and ``eh_proj`` [d, 2d] are the NextN fusion; ``tensors`` is the
    layer as a checkpoint stores it, under ``model.layers.{num_layers}.``."""

    num_layers: int
    block: torch.nn.Module
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor
    tensors: dict[str, torch.Tensor]


def mtp_layer(target: torch.nn.Module, seed: int, tmp: Path) -> TinyMTP:
    """The MTP layer of ``target`` (a model of ``build``), with every norm, bias and the head
    random (the head apart from lm_head); ``tmp``: a scratch directory."""
    n = target.config.num_hidden_layers
    over = dict(num_hidden_layers=1, mlp_layer_types=["sparse"])
    if target.config.model_type == "glm_moe_dsa":
        over |= dict(indexer_types=["full"], index_topk_freq=1, index_skip_topk_offset=0)
    derived = ("layer_types", "mlp_layer_types", "indexer_types", "head_dim", "qk_head_dim")
    base = {k: v for k, v in target.config.to_dict().items() if k not in derived}
    config = type(target.config)(**(base | over))
    block = build(config, seed=seed)
    block.save_pretrained(tmp)
    saved = {}
    for f in sorted(tmp.glob("*.safetensors")):
        saved |= load_file(str(f))
    prefix = f"model.layers.{n}."
    tensors = {
        k.replace("model.layers.0.", prefix): v for k, v in saved.items() if "layers.0." in k
    }
    tensors[prefix + "shared_head.norm.weight"] = saved["model.norm.weight"]
    tensors[prefix + "shared_head.head.weight"] = saved["lm_head.weight"]
    tensors[prefix + "embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    g = torch.Generator().manual_seed(seed + 1)
    d = target.config.hidden_size
    fusion = {
        "enorm.weight": 1 + 0.2 * torch.randn(d, generator=g),
        "hnorm.weight": 1 + 0.2 * torch.randn(d, generator=g),
        "eh_proj.weight": torch.randn(d, 2 * d, generator=g) / math.sqrt(2 * d),
    }
    tensors |= {prefix + k: v for k, v in fusion.items()}
    return TinyMTP(
        n, block.eval(), fusion["enorm.weight"], fusion["hnorm.weight"], fusion["eh_proj.weight"],
        tensors,
    )  # fmt: skip


def append_mtp(path: Path, mtp: TinyMTP | TinyV4MTP, **config: object) -> Path:
    """Adds ``mtp``'s tensors to the checkpoint in ``path`` as one more shard (listed in the
    index, which a single-file checkpoint gains) and ``num_nextn_predict_layers: 1`` (and
    ``config``'s keys) to its config.json, as the released checkpoints ship them."""
    shard = "model-mtp.safetensors"
    save_file({k: v.contiguous() for k, v in mtp.tensors.items()}, str(path / shard))
    index_path = path / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        names = load_file(str(path / "model.safetensors"))
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}
    index["weight_map"] |= dict.fromkeys(mtp.tensors, shard)
    index_path.write_text(json.dumps(index, indent=2))
    cfg_path = path / "config.json"
    raw = json.loads(cfg_path.read_text()) | {"num_nextn_predict_layers": 1} | config
    cfg_path.write_text(json.dumps(raw, indent=2))
    return path
