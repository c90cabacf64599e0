"""The projection to a node of 8 H200 (issue 45): a full model's decode step per GPU, from the
per-region device times the roofline measured on its real-dimension preset (one H100, resident,
8K prompts, C = 1 / 4 / 16 / 64) and the sessions ``dhisparse plan`` admits per GPU under the
best layout. Pure arithmetic; ``project_cli`` reads the files and writes the outputs.

A measured step is a set of regions (``bench/roofline``'s names), each with its device time at
each measured C. The full model's step on one GPU at C sessions (that GPU's own sessions, as
the data-parallel-attention layouts the plan picks serve them) is the sum of:

- every region at C (interpolated linearly between measured C, extrapolated linearly from the
  last two beyond the largest: ``at``), times its **count ratio** (``REGION_COUNT``): layers
  for attention and norms, index producers for the indexer, MoE layers for the router and the
  shared experts, dense layers for the dense MLPs, one for the head and the step's own work;
- ``indexer.select`` (the scores over every visible key, and the top-k) also times the
  **visible rows**: context / measured visible rows;
- ``mlp.experts``: the measured time per distinct expert read (time / (MoE layers × mean
  distinct experts per layer measured)) times the full model's MoE layers times the distinct
  experts one GPU reads (``experts_read``: E / G of them held, uniform routing of G·C tokens
  top-k each);
- the step's time outside its kernels (median step − device time: graph launch and gaps),
  times the layer ratio;
- the device time (not that gap) times ``hbm_ratio``: the H100-measured costs on an H200 by
  the copy-rate ratio (every region taken as bound by memory, as the roofline finds the step);
- the hierarchy's host reads (``host_s``): the share of selected rows served from the host
  (the shipped model's selections replayed at the context, ``replay.mapped_census``), k rows
  per layer, the FP8 row, over the resolver's measured
  host recovery rate, added without overlap (``Step.seconds``, the upper bound) or entirely
  under the device's work (``Step.overlapped``, the lower bound); adaptive's share
  shrinks by the share of each session's history its pool keeps resident (N_resident / C);
- the MoE exchange of a data-parallel layout (``exchange_s``): two all-to-alls per MoE layer
  (dispatch FP8, combine bf16) of the tokens routed off the GPU, each at least ``latency_s``,
  over ``link_gbs`` (an estimate: nothing here measured it).

A mode's sessions are capped by the plan's per GPU (resident; hierarchy for hisparse and
adaptive); its decode tokens per second per GPU at C are min(C, cap) / step (one token per
session per step: no speculation)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# the share of a region's per-step count the full model has over the scaled one, by region:
# "layers", "producers", "moe", "dense", or "one" (once a step). Other regions: "layers".
REGION_COUNT: dict[str, str] = {
    "mlp.gate": "moe", "mlp.shared_experts": "moe",
    "mlp.shared_experts.gate_proj": "moe", "mlp.shared_experts.up_proj": "moe",
    "mlp.shared_experts.down_proj": "moe", "mlp": "moe",
    "mlp.gate_proj": "dense", "mlp.up_proj": "dense", "mlp.down_proj": "dense",
    "indexer.select": "producers", "indexer.queries": "producers", "indexer.keys": "producers",
    "indexer.wq_b": "producers", "indexer.wk": "producers", "indexer.k_norm": "producers",
    "kv.index_keys.write": "producers",
    "lm_head": "one", "embed": "one", "norm": "one", "step": "one", "unattributed": "one",
}  # fmt: skip
EXPERTS = "mlp.experts"
SELECT = "indexer.select"  # scales with the visible rows as well


@dataclass(frozen=True)
class Shape:
    """What the count ratios need of a model."""

    layers: int
    producers: int
    moe_layers: int
    dense_layers: int
    experts: int  # routed experts
    top_k: int  # experts per token

    def count(self, kind: str) -> int:
        return {"layers": self.layers, "producers": self.producers, "moe": self.moe_layers,
                "dense": self.dense_layers, "one": 1}[kind]  # fmt: skip


@dataclass(frozen=True)
class Measured:
    """One roofline variant of a scaled preset: per measured C, each region's device µs per
    step, the median step (ms), the mean distinct experts per MoE layer, and the visible rows."""

    regions: Mapping[int, Mapping[str, float]]  # C -> region -> µs
    step_ms: Mapping[int, float]
    device_us: Mapping[int, float]
    experts_hit: Mapping[int, float]
    visible_rows: float


@dataclass(frozen=True)
class Node:
    gpus: int = 8
    hbm_ratio: float = 2.989 / 4.281  # H100 copy rate / H200's: a time on the H200
    pcie_gbs: float = 25.2  # the resolver's host recovery per GPU
    link_gbs: float = 450.0  # NVLink per direction per GPU (H200 SXM)
    latency_s: float = 10e-6  # one all-to-all at the least
    row_bytes: int = 656  # an FP8 MLA row
    hidden: int = 7168


def at(points: Mapping[int, float], c: float) -> float:
    """``points`` (C -> value) at ``c``: linear between the measured C, and from the last two
    (first two) beyond them."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    i = 1
    while i < len(xs) - 1 and c > xs[i]:
        i += 1
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = points[x0], points[x1]
    return y0 + (y1 - y0) * (c - x0) / (x1 - x0)


def experts_read(experts: int, top_k: int, gpus: int, tokens: float) -> float:
    """Distinct experts one GPU of ``gpus`` reads (it holds experts / gpus) when ``tokens``
    tokens each pick ``top_k`` of ``experts`` uniformly."""
    return experts / gpus * (1.0 - (1.0 - top_k / experts) ** tokens)


def device_s(m: Measured, scaled: Shape, full: Shape, node: Node, c: float,
             context: int) -> dict[str, float]:  # fmt: skip
    """The full model's device seconds per step on one GPU at ``c`` sessions of ``context``
    tokens, on the H200, by region (plus ``launch``: the step's time outside kernels)."""
    names = sorted({r for per in m.regions.values() for r in per})
    out: dict[str, float] = {}
    for name in names:
        us = at({x: per.get(name, 0.0) for x, per in m.regions.items()}, c)
        if name == EXPERTS:
            per_expert = at({x: per.get(name, 0.0) / (scaled.moe_layers * m.experts_hit[x])
                             for x, per in m.regions.items()}, c)  # fmt: skip
            tokens = node.gpus * c
            us = per_expert * full.moe_layers * experts_read(full.experts, full.top_k,
                                                             node.gpus, tokens)  # fmt: skip
        else:
            kind = REGION_COUNT.get(name, "layers")
            us *= full.count(kind) / scaled.count(kind)
            if name == SELECT:
                us *= context / m.visible_rows
        out[name] = max(us, 0.0) * 1e-6 * node.hbm_ratio
    gap = at({x: m.step_ms[x] * 1e3 - m.device_us[x] for x in m.step_ms}, c)
    out["launch"] = max(gap, 0.0) * 1e-6 * full.layers / scaled.layers
    return out


def host_s(host_share: float, k: int, layers: int, node: Node, sessions: float) -> float:
    """Seconds a GPU's host reads take per step: ``sessions`` × the share of k rows per layer
    served from the host × an FP8 row, over the host recovery rate."""
    return sessions * host_share * k * layers * node.row_bytes / (node.pcie_gbs * 1e9)


def exchange_s(full: Shape, node: Node, sessions: float) -> float:
    """Two all-to-alls per MoE layer (dispatch FP8, combine bf16: 3 bytes per element) of the
    routed copies that leave the GPU, each at least ``latency_s``."""
    off = (node.gpus - 1) / node.gpus
    bytes_ = sessions * full.top_k * off * node.hidden * 3
    return full.moe_layers * (2 * node.latency_s + bytes_ / (node.link_gbs * 1e9))


def adaptive_share(hisparse_share: float, resident_cap: float, sessions: float) -> float:
    """The host share adaptive residency leaves at ``sessions`` per GPU: none while every
    history fits resident, then hisparse's over the share not resident (1 - N_resident / C)."""
    return hisparse_share * max(0.0, 1.0 - resident_cap / sessions)


@dataclass(frozen=True)
class Step:
    device: dict[str, float]
    host: float
    exchange: float

    @property
    def seconds(self) -> float:
        """Host reads after the device's work (no overlap: the upper bound)."""
        return sum(self.device.values()) + self.host + self.exchange

    @property
    def overlapped(self) -> float:
        """Host reads entirely under the device's work (the lower bound)."""
        return max(sum(self.device.values()), self.host) + self.exchange


def step(m: Measured, scaled: Shape, full: Shape, node: Node, mode: str, c: float,
         context: int, k: int, caps: Mapping[str, int], host_share: float) -> Step:  # fmt: skip
    """One GPU's step of ``mode`` at ``c`` running sessions (already capped); ``host_share``:
    the share of a hisparse session's selected rows read from the host."""
    share = {"resident": 0.0, "hisparse": host_share,
             "adaptive": adaptive_share(host_share, caps["resident"], c)}[mode]  # fmt: skip
    return Step(device_s(m, scaled, full, node, c, context),
                host_s(share, k, full.layers, node, c), exchange_s(full, node, c))  # fmt: skip


def tokens_per_s(sessions: float, seconds: float) -> float:
    """Decode tokens per second per GPU: each running session one token a step."""
    return sessions / seconds
