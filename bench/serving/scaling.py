"""The scaling projection's arithmetic (pure Python, no torch): per decode step of one GPU
holding N sessions, the bytes and FLOPs the target model moves, turned into time by the
hardware's ceilings, and the resource whose term is largest.

Per session and decode step (one token), at context L:
- attention reads  ``payload_sources · k · d_kv``           (the selected rows, from HBM)
- the indexer reads ``Σ producers · ⌊L/m⌋ · key_bytes``     (every index key, from HBM)
- host recovery     ``f · payload_sources · k · d_kv``       over PCIe (hierarchy modes), and
  the same bytes written into the hot cache in HBM; f is the share of selected bytes that had
  to come from the host, measured on the small model and assumed to carry over;
- FLOPs ``2·active_params + payload_sources·k·heads·2·(kv_elems + d_latent)
  + Σ producers·⌊L/m⌋·index_heads·index_dim·2``.
Per GPU and step, independent of N: the weights, all experts read once (with hundreds of
tokens per step every expert is hit), ``total_params · bytes_per_param / gpus``.
Step time: HBM terms add (one memory system); compute overlaps memory; host copies overlap
the GPU's work (prefetch from shared indices) in the ``overlapped`` figure and add to it in the
``serialized`` one. The binding resource is the largest term."""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse.capacity import GIB, TB, Profile
from dhisparse.capacity.model import page_rows, source_rows


@dataclass(frozen=True)
class Hardware:
    """Per-GPU ceilings; defaults are the H200 figures measured in this project."""

    hbm_gbs: float = 4281.0  # HBM device-to-device copy, read+write (ENVIRONMENT.md)
    pcie_gbs: float = 25.2  # resolver host recovery, 256 requests x 10% misses
    # (docs/results/archive/results_10m.md)
    tflops: float = 1979.0  # dense FP8 peak of an H200 (vendor figure)
    mfu: float = 0.5  # share of the peak a decode step reaches (assumption)
    gpus: int = 8  # GPUs of the node, each holding its own sessions
    pool_bytes: int = round(22.75 * GIB)  # per GPU: the pool the paper's counts imply
    host_bytes: int = round(4.3 * TB)  # the node's host memory for backups (paper §5)


@dataclass(frozen=True)
class TargetModel:
    """What the capacity profile does not say about GLM-5.3: assumptions, taken from the public
    GLM-5 (744B total / 40B active, MoE, DSA) and DeepSeek-V3.2's indexer."""

    total_params: float = 744e9
    active_params: float = 40e9
    bytes_per_param: float = 1.0  # FP8 weights
    heads: int = 64
    kv_elems: int = 576  # 512 latent + 64 RoPE (576 B rows: 1-byte elements)
    d_latent: int = 512
    index_heads: int = 64
    index_dim: int = 128
    layers: int = 78


def selected_bytes(profile: Profile) -> int:
    """Bytes of the rows one token's selections read (every payload source, k rows)."""
    return profile.payload_sources * profile.top_k * profile.d_kv


def index_bytes(profile: Profile, context: int) -> int:
    """Bytes of the index keys one token's indexer scans at ``context``."""
    p = profile.page_size
    return sum(
        g.count * page_rows(source_rows(context, g.compress), p) * g.key_bytes
        for g in profile.indexers
    )


def flops_per_token(profile: Profile, model: TargetModel, context: int) -> float:
    attention = (
        profile.payload_sources
        * profile.top_k
        * model.heads
        * 2
        * (model.kv_elems + model.d_latent)
    )
    indexer = sum(
        g.count * source_rows(context, g.compress) * model.index_heads * model.index_dim * 2
        for g in profile.indexers
    )
    return 2 * model.active_params + attention + indexer


@dataclass(frozen=True)
class Step:
    """One decode step of one GPU with ``sessions`` sessions (seconds per term)."""

    sessions: int
    weights_s: float
    kv_s: float  # selected rows + index keys (+ recovered rows written to the hot cache)
    compute_s: float
    pcie_s: float
    overlapped_s: float
    serialized_s: float
    binds: str  # hbm | compute | pcie

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def step(
    profile: Profile,
    model: TargetModel,
    hw: Hardware,
    context: int,
    sessions: int,
    host_fraction: float,
    width: int = 1,
) -> Step:
    """``width``: queries per session per step (a verification block); attention, indexer and
    FLOPs scale with it, the host copies do not (a round's misses are deduplicated, eq. 6) and
    the weights are read once."""
    sel = selected_bytes(profile)
    host = host_fraction * sel
    weights = model.total_params * model.bytes_per_param / hw.gpus / (hw.hbm_gbs * 1e9)
    kv = sessions * (width * (sel + index_bytes(profile, context)) + host) / (hw.hbm_gbs * 1e9)
    compute = (
        sessions * width * flops_per_token(profile, model, context) / (hw.tflops * 1e12 * hw.mfu)
    )
    pcie = sessions * host / (hw.pcie_gbs * 1e9)
    terms = {"hbm": weights + kv, "compute": compute, "pcie": pcie}
    gpu = max(terms["hbm"], compute)
    return Step(
        sessions, weights, kv, compute, pcie, max(gpu, pcie), gpu + pcie,
        max(terms, key=terms.__getitem__),
    )  # fmt: skip


def pcie_break_even(profile: Profile, model: TargetModel, hw: Hardware, context: int,
                    sessions: int) -> float:  # fmt: skip
    """The host fraction f above which host copies take longer than the GPU's own work."""
    s0 = step(profile, model, hw, context, sessions, 0.0)
    gpu = max(s0.weights_s + s0.kv_s, s0.compute_s)
    per_f = sessions * selected_bytes(profile) / (hw.pcie_gbs * 1e9)
    return gpu / per_f if per_f else float("inf")
