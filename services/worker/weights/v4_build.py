"""A DeepSeek-V4 preset (``V4Preset``) built with seeded random weights as the engine's
``V4Model``, on the CPU or in place on the device (what a real-dimension V4 of tens of GB
needs: allocated on ``meta``, materialised on the device, every tensor drawn there).

The weights are in the serving dtype but the tensors V4 holds in fp32
(``model.v4_precision``), or, with a ``WeightFormat`` of FP8, the projections and experts the
released checkpoints quantize held in FP8 (the routed experts in FP4 with ``fp4_experts``): each
such matrix drawn as the dense model's is, rounded to the serving dtype, then quantized
(``weights/v4_quantized``), so that a quantized preset holds its dense twin's weights
quantized."""

from __future__ import annotations

import math

import torch

from dhisparse.family.presets import V4Preset
from services.worker.model.v4_decoder import V4Decoder
from services.worker.model.v4_mtp import MTPBlock
from services.worker.model.v4_precision import to_serving_dtype
from services.worker.model.v4_serving import V4Model
from services.worker.model.weight_format import BF16, WeightFormat
from services.worker.weights.v4_quantized import Slot, Stored, fill, slots

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _draw_order(net: V4Decoder) -> list[str]:
    """The names of the tensors a dense ``V4Decoder`` of ``net``'s config holds, in the order
    ``init_v4_weights`` draws them: as registered, the MTP layer's last."""
    with torch.device("meta"):
        twin = V4Decoder(net.cfg, MTPBlock(net.cfg) if net.mtp is not None else None)
    names = [name for name, _ in [*twin.named_parameters(), *twin.named_buffers()]]
    return sorted(names, key=lambda name: name.startswith("mtp."))


def init_v4_weights(net: V4Decoder, seed: int) -> None:
    """Seeded random weights of unit-scale activations, as the V4 tests' transformers
    checkpoints are drawn (``tests/hf_tiny_v4.build``): projections and experts N(0, 1/fan_in),
    embeddings N(0, 1), norm weights and the hyper-connections' scales 1 + N(0, 0.2^2), sinks
    N(0, 1), compressor position biases (``ape``) N(0, 0.5^2), router correction biases and
    the hyper-connections' bases N(0, 0.1^2); a hash layer's ``tid2eid`` gives each token
    ``top_k`` distinct experts of ``n_routed``. Drawn on the model's device one tensor at a
    time (in fp32, then cast), the MTP layer's last: the target's numbers are the same with or
    without it. A quantized matrix (``slots``) is drawn under its dense name and shape, in the
    dense model's order, rounded to the serving dtype (the embedding's) and quantized."""
    device = next(net.parameters()).device
    g = torch.Generator(device).manual_seed(seed)
    n_routed = net.cfg.n_routed
    dtype = net.embed.weight.dtype
    quantized, _ = slots(net)
    own = dict([*net.named_parameters(), *net.named_buffers()])
    with torch.no_grad():
        for name in _draw_order(net):
            t = quantized.get(name) or own[name]
            if isinstance(t, Slot):
                r = torch.randn(t.shape, generator=g, device=device) / math.sqrt(t.shape[-1])
                fill(t, Stored("dense", r.to(dtype)))
                continue
            if name.endswith("tid2eid"):
                picks = torch.rand(t.shape[0], n_routed, generator=g, device=device)
                t.copy_(picks.argsort(dim=-1)[:, : t.shape[1]])
                continue
            r = torch.randn(t.shape, generator=g, device=device)
            if name.endswith(("norm.weight", "_scale")):
                r = 1 + 0.2 * r
            elif name.endswith("attn_sink"):
                pass
            elif name.endswith(".ape"):
                r = 0.5 * r
            elif name.endswith(("gate.bias", "_base")):
                r = 0.1 * r
            elif not name.startswith("embed."):
                r = r / math.sqrt(t.shape[-1])
            t.copy_(r)


def build_v4(
    d: V4Preset, seed: int, device: str, dtype: torch.dtype | None, in_place: bool, mtp: bool,
    fmt: WeightFormat = BF16,
) -> V4Model:  # fmt: skip
    """The preset's ``V4Model`` with ``init_v4_weights``' weights in ``dtype`` (default: the
    config's; ``to_serving_dtype``), its projections and experts held as ``fmt`` says.
    Allocated on ``meta`` and materialised where the weights are drawn: on ``device`` with
    ``in_place`` (never on the host), else on the CPU and then moved, so that the weights are
    the same on every device. ``mtp``: with the MTP layer (``mtp.0``)."""
    cfg, _ = d.parse(mtp=mtp)
    with torch.device("meta"):
        net = V4Decoder(cfg, MTPBlock(cfg, fmt) if mtp else None, fmt)
    # dtypes set on meta: the device holds each tensor in its own dtype from the start
    to_serving_dtype(net, dtype or DTYPES[cfg.dtype])  # tid2eid stays int64
    net.to_empty(device=device if in_place else "cpu")
    init_v4_weights(net, seed)
    return V4Model(net.to(device=device).eval(), d.name)
