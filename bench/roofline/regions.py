"""Region labels on an eager pass, from outside the model: record_function ranges pushed by
forward pre/post hooks on the model's modules and by wrappers around the bound methods and the
module-level function the decoder calls (the model code stays as it is). Per-layer names are
collapsed to roles (``layers.7.attn.q_a_proj`` -> ``attn.q_a_proj``), so a region sums over
layers.

While installed, the instruments also record what each forward pass was, for the byte model:
the rows each token sees (its position + 1), the distinct routed experts the router chose per
MoE layer (a forward hook on ``mlp.gate``, which returns (weights, experts)), and how many rows
the head scored. Reading those back synchronises with the device: eager passes only."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.profiler import record_function

import services.worker.model.decoder as decoder_module
from bench.roofline.cost import PassShape
from bench.roofline.trace import PREFIX, STEP

# modules whose forward opens a region (roles: per-layer names collapsed)
MODULE_ROLES = frozenset({
    "embed", "norm", "attn_norm", "mlp_norm",
    "attn.q_a_proj", "attn.q_a_layernorm", "attn.q_b_proj", "attn.kv_a_proj_with_mqa",
    "attn.kv_a_layernorm", "attn.o_proj",
    "indexer.wq_b", "indexer.wk", "indexer.k_norm",
    "mlp", "mlp.gate", "mlp.experts", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "mlp.shared_experts", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
    "mlp.shared_experts.down_proj",
})  # fmt: skip
# methods of each layer's attention and indexer that the decoder calls directly
LAYER_METHODS = {
    "attn": ("queries", "token_rows", "output"),
    "indexer": ("queries", "keys"),
}
# the model's own forward (residual adds), and the engine step around everything
DECODER = "decoder"
_LAYER = re.compile(r"^layers\.(\d+)\.")


def role(name: str) -> tuple[int | None, str]:
    """A module's qualified name -> (its layer or None, its role)."""
    m = _LAYER.match(name)
    return (int(m.group(1)), name[m.end() :]) if m else (None, name)


@dataclass
class PassRecord:
    visible: list[int] = field(default_factory=list)
    experts: dict[int, int] = field(default_factory=dict)
    sampled: int = 0

    def shape(self) -> PassShape:
        return PassShape(tuple(self.visible), dict(self.experts), self.sampled)


@contextmanager
def span(region: str) -> Iterator[None]:
    with record_function(PREFIX + region):
        yield


def _wrapped(fn: Callable, region: str) -> Callable:
    def call(*a, **kw):
        with span(region):
            return fn(*a, **kw)

    return call


class Instruments:
    """Installs the labels on ``model`` and ``kv`` (an engine's) while entered; ``passes``
    collects a record per forward pass of the model meanwhile."""

    def __init__(self, model: nn.Module, kv) -> None:
        self.model, self.kv = model, kv
        self.passes: list[PassRecord] = []
        self.roles: set[str] = set()

    def _patch(self, stack: ExitStack, owner: object, attr: str, region: str) -> None:
        own = attr in vars(owner)
        original = getattr(owner, attr)
        setattr(owner, attr, _wrapped(original, region))
        self.roles.add(region)

        def restore() -> None:
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)

        stack.callback(restore)

    def _hook(self, stack: ExitStack, module: nn.Module, region: str) -> None:
        opened: list = []

        def pre(_m, _args) -> None:
            rf = record_function(PREFIX + region)
            rf.__enter__()
            opened.append(rf)

        def post(_m, _args, _out) -> None:
            opened.pop().__exit__(None, None, None)

        stack.callback(module.register_forward_pre_hook(pre).remove)
        stack.callback(module.register_forward_hook(post).remove)
        self.roles.add(region)

    def _record_pass(self, _m, args) -> None:
        batch = args[1]
        self.passes.append(PassRecord(visible=(batch.positions + 1).tolist()))

    def _record_experts(self, layer: int) -> Callable:
        def hook(_m, _args, out) -> None:
            _, experts = out
            self.passes[-1].experts[layer] = int(torch.unique(experts).numel())

        return hook

    def _record_sampled(self, stack: ExitStack) -> None:
        logits = self.model.logits

        def call(hidden: torch.Tensor) -> torch.Tensor:
            if self.passes:
                self.passes[-1].sampled += hidden.reshape(-1, hidden.shape[-1]).shape[0]
            with span("lm_head"):
                return logits(hidden)

        self.model.logits = call
        self.roles.add("lm_head")
        stack.callback(lambda: delattr(self.model, "logits"))

    @contextmanager
    def installed(self) -> Iterator[Instruments]:
        with ExitStack() as stack:
            model, kv = self.model, self.kv
            stack.callback(model.register_forward_pre_hook(self._record_pass).remove)
            self._hook(stack, model, DECODER)
            for name, module in model.named_modules():
                layer, r = role(name)
                if name.startswith("mtp.") or r not in MODULE_ROLES:
                    continue
                self._hook(stack, module, r)
                if r == "mlp.gate" and layer is not None:
                    hook = module.register_forward_hook(self._record_experts(layer))
                    stack.callback(hook.remove)
            for layer in model.layers:
                for part, methods in LAYER_METHODS.items():
                    owner = getattr(layer, part)
                    for m in methods if owner is not None else ():
                        self._patch(stack, owner, m, f"{part}.{m}")
            self._record_sampled(stack)
            self._patch(stack, model, "attention_fn", "attn.sparse")
            self._patch(stack, decoder_module, "select_rows", "indexer.select")
            for attr in ("resolve", "write_rows", "begin", "prefetch"):
                self._patch(stack, kv.payload, attr, f"kv.{attr}")
            self._patch(stack, kv.index_keys, "write", "kv.index_keys.write")
            for attr in ("attention_rows", "commit"):
                self._patch(stack, kv, attr, f"kv.{attr}")
            yield self


@contextmanager
def step_span() -> Iterator[None]:
    """One engine step, for splitting a trace into steps (``trace.by_step``)."""
    with record_function(STEP):
        yield
