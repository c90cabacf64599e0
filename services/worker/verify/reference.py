"""transformers' own implementation of a DeepSeek-V3.2 / GLM-5 model (the oracle), built on the
first N layers of an operator's checkpoint and filled from *our* checkpoint reader.

transformers' CPU dequantization refuses FP8 weights on a ceil-div scale grid (every released
``kv_a_proj_with_mqa``: 576 rows in 128-row blocks), so the reference is built from its config
without ``quantization_config`` and each tensor is copied in from ``Checkpoint`` (dequantized
there), the routed experts into transformers' fused ``gate_up_proj [E, 2I, D]`` and
``down_proj [E, D, I]``. Its indexer picks with torch.topk, which leaves ties to the kernel:
``our_topk_order`` makes it rank as the engine does (score descending, lower position first)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dhisparse.family.hf_config import MLAConfig
from services.worker.weights.checkpoint import Checkpoint, CheckpointError
from services.worker.weights.hf_load import first_layers, later_layers
from services.worker.weights.loader import load_into
from services.worker.weights.mla_names import ignored_patterns

# config.json lists with one entry per layer, cut to the first N
_PER_LAYER = ("indexer_types", "mlp_layer_types", "layer_types", "index_topk_pattern")
_EXPERT = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
)


def reference_config(raw: dict[str, Any], n: int) -> Any:
    """transformers' config of the model's first ``n`` layers, eager attention, no
    quantization (weights come in dequantized)."""
    from transformers import AutoConfig

    kw = {k: v for k, v in raw.items() if k not in ("quantization_config", "model_type")}
    kw["num_hidden_layers"] = n
    for key in _PER_LAYER:
        if kw.get(key) is not None:
            kw[key] = kw[key][:n]
    return AutoConfig.for_model(raw["model_type"], attn_implementation="eager", **kw)


def reference_targets(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """For each checkpoint name the reference reads: the tensor it is copied into (one expert's
    slice of the fused expert weights for ``mlp.experts.E.*``). Raises CheckpointError when a
    tensor of the reference is left unfilled (a tied lm_head is filled with the embeddings)."""
    state = model.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    filled: dict[int, int] = {}  # elements filled, by tensor (tied names share one)
    for name in names:
        hit = _target(state, name)
        if hit is not None:
            key, view = hit
            out[name] = view
            filled[id(state[key])] = filled.get(id(state[key]), 0) + view.numel()
    unfilled = sorted(k for k, t in state.items() if filled.get(id(t), 0) != t.numel())
    if unfilled:
        listed = ", ".join(unfilled[:20]) + (" ..." if len(unfilled) > 20 else "")
        raise CheckpointError(f"the checkpoint leaves {len(unfilled)} reference tensors: {listed}")
    return out


def _target(state: dict[str, torch.Tensor], name: str) -> tuple[str, torch.Tensor] | None:
    """(the reference's state-dict key, the tensor to copy into) for one checkpoint name."""
    if name in state:
        return name, state[name].data
    m = _EXPERT.fullmatch(name)
    if m is None:
        return None
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    key = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
    fused = state.get(key)
    if fused is None or e >= fused.shape[0]:
        return None
    if proj == "down_proj":
        return key, fused.data[e]
    half = fused.shape[1] // 2  # gate rows, then up rows, as transformers fuses them
    return key, fused.data[e, :half] if proj == "gate_proj" else fused.data[e, half:]


def _rotary_tables(model: nn.Module, device: torch.device | str) -> None:
    """Recomputes the rotary embedding's inverse frequencies (non-persistent buffers, which no
    state dict fills), as transformers' own initialisation does."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for m in model.modules():
        if hasattr(m, "original_inv_freq"):
            fn = (
                m.compute_default_rope_parameters
                if m.rope_type == "default"
                else ROPE_INIT_FUNCTIONS[m.rope_type]
            )
            inv_freq, _ = fn(m.config, device)
            m.inv_freq.copy_(inv_freq)
            m.original_inv_freq.copy_(inv_freq)


def load_reference(
    path: str | Path, raw: dict[str, Any], cfg: MLAConfig, n: int, device: str | torch.device
) -> nn.Module:
    """transformers' model of the first ``n`` layers in fp32 on ``device``, its tensors read
    from the checkpoint by ``Checkpoint`` (FP8 dequantized there); the other layers' tensors
    are not read."""
    from transformers import AutoModelForCausalLM

    config = reference_config(raw, n)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config).float()
    model.to_empty(device=device)
    ckpt = Checkpoint(path, raw.get("quantization_config"))
    ignore = later_layers(cfg, n) | dict(ignored_patterns(first_layers(cfg, n)))
    with torch.no_grad():
        load_into(ckpt, reference_targets(model, ckpt.names()), ignore=ignore)
        _rotary_tables(model, device)
    return model.eval()


@contextlib.contextmanager
def our_topk_order() -> Iterator[None]:
    """Within the block, Tensor.topk with largest=True ranks as the engine does: value
    descending, the lower index first among equal values (a stable descending sort)."""
    original = torch.Tensor.topk

    def topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
        if not largest:
            return original(self, k, dim, largest, sorted)
        order = torch.sort(self, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, order), order))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


@dataclass
class ReferencePass:
    """What the reference computed for one sequence of T tokens."""

    selections: dict[int, torch.Tensor]  # producer layer -> [T, k] top-k positions
    outputs: list[torch.Tensor]  # per layer: its output hidden states [T, hidden]


def run_reference(model: nn.Module, ids: torch.Tensor) -> ReferencePass:
    """One uncached forward over ``ids`` [T] with the engine's top-k order, recording every
    indexer's selection and every layer's output."""
    selections: dict[int, torch.Tensor] = {}
    outputs: list[torch.Tensor] = []
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(lambda _m, _a, out: outputs.append(_first(out))))
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            hooks.append(
                indexer.register_forward_hook(
                    lambda _m, _a, out, i=i: selections.__setitem__(i, out[0].long())
                )
            )
    try:
        with torch.no_grad(), our_topk_order():
            model(ids.unsqueeze(0), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return ReferencePass(selections, [o[0] for o in outputs])


def _first(out: torch.Tensor | tuple) -> torch.Tensor:
    """A decoder layer's hidden states: V3.2 returns them, GLM returns (them, top-k)."""
    return out if isinstance(out, torch.Tensor) else out[0]


def reference_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The final norm and lm_head of the reference on hidden states [T, hidden] -> fp32."""
    with torch.no_grad():
        return model.lm_head(model.model.norm(hidden)).float()
