"""A DeepSeek-V4 preset (``V4Preset``) built with seeded random weights as the engine's
``V4Model``, on the CPU or in place on the device (what a real-dimension V4 of tens of GB
needs: allocated on ``meta``, materialised on the device, every tensor drawn there).

The weights are dense, in the serving dtype but the tensors V4 holds in fp32
(``model.v4_precision``): V4's model holds dense weights only (a checkpoint's FP8 / FP4 form is
dequantised at load, ``weights/v4_names``), so there is no FP8 / FP4 V4 layer to build into."""

from __future__ import annotations

import math

import torch

from dhisparse.family.presets import V4Preset
from services.worker.model.v4_decoder import V4Decoder
from services.worker.model.v4_mtp import MTPBlock
from services.worker.model.v4_precision import to_serving_dtype
from services.worker.model.v4_serving import V4Model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_v4_weights(net: V4Decoder, seed: int) -> None:
    """Seeded random weights of unit-scale activations, as the V4 tests' transformers
    checkpoints are drawn (``tests/hf_tiny_v4.build``): projections and experts N(0, 1/fan_in),
    embeddings N(0, 1), norm weights and the hyper-connections' scales 1 + N(0, 0.2^2), sinks
    N(0, 1), compressor position biases (``ape``) N(0, 0.5^2), router correction biases and
    the hyper-connections' bases N(0, 0.1^2); a hash layer's ``tid2eid`` gives each token
    ``top_k`` distinct experts of ``n_routed``. Drawn on the model's device one tensor at a
    time (in fp32, then cast), the MTP layer's last: the target's numbers are the same with or
    without it."""
    device = next(net.parameters()).device
    g = torch.Generator(device).manual_seed(seed)
    n_routed = net.cfg.n_routed
    with torch.no_grad():
        tensors = [*net.named_parameters(), *net.named_buffers()]
        for name, t in sorted(tensors, key=lambda nt: nt[0].startswith("mtp.")):
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
    d: V4Preset, seed: int, device: str, dtype: torch.dtype | None, in_place: bool, mtp: bool
) -> V4Model:
    """The preset's ``V4Model`` with ``init_v4_weights``' weights in ``dtype`` (default: the
    config's; ``to_serving_dtype``). Allocated on ``meta`` and materialised where the weights are drawn: on
    ``device`` with ``in_place`` (never on the host), else on the CPU and then moved, so that
    the weights are the same on every device. ``mtp``: with the MTP layer (``mtp.0``)."""
    cfg, _ = d.parse(mtp=mtp)
    with torch.device("meta"):
        net = V4Decoder(cfg, MTPBlock(cfg) if mtp else None)
    # dtypes set on meta: the device holds each tensor in its own dtype from the start
    to_serving_dtype(net, dtype or DTYPES[cfg.dtype])  # tid2eid stays int64
    net.to_empty(device=device if in_place else "cpu")
    init_v4_weights(net, seed)
    return V4Model(net.to(device=device).eval(), d.name)
