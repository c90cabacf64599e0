"""Model profiles and deployments: the inputs of the capacity model (DESIGN §6).

A *profile* says, in bytes, what one session of a model leaves on the GPU per token and which
allocations the KV hierarchy keeps fixed; a *deployment* says how much memory a GPU gives to
required allocations and how many GPUs share one host. Both are frozen and carry no behaviour
beyond validation and lookup; the arithmetic lives in :mod:`dhisparse.capacity.model`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

# How the hierarchy treats a KV source:
#   sparse  read through top-k selection: hot cache + tail on the GPU, whole history on host;
#   dense   read whole (e.g. a DeepSeek-V4 HCA source): whole history stays on the GPU;
#   window  only a local sliding window over uncompressed tokens, no stored history.
SourceKind = Literal["sparse", "dense", "window"]
SOURCE_KINDS: tuple[SourceKind, ...] = ("sparse", "dense", "window")


@dataclass(frozen=True)
class SourceGroup:
    """``count`` physical KV sources of one shape (a *payload source* per GLM layer, or a
    DeepSeek-V4 source shared by several layers: shared sources are counted once)."""

    count: int
    row_bytes: int  # d_kv: bytes of one stored row (latent + rope part, scales included)
    compress: int = 1  # m: tokens packed into one stored row (1 = none)
    window: int = 0  # local sliding-window branch over the last `window` uncompressed tokens
    kind: SourceKind = "sparse"

    def __post_init__(self) -> None:
        _positive(count=self.count, row_bytes=self.row_bytes, compress=self.compress)
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"kind must be one of {SOURCE_KINDS}, got {self.kind!r}")
        if self.kind == "window" and self.window < 1:
            raise ValueError("a window-only source needs window >= 1")


@dataclass(frozen=True)
class IndexGroup:
    """``count`` index producers, each keeping one index key per row of its source for the
    whole history, always on the GPU (selection runs over the full logical history)."""

    count: int
    key_bytes: int  # bytes of one index key (e.g. 128 fp8 + one fp32 scale = 132)
    compress: int = 1  # m of the source it indexes

    def __post_init__(self) -> None:
        _positive(count=self.count, key_bytes=self.key_bytes, compress=self.compress)


@dataclass(frozen=True)
class DrafterProfile:
    """A drafter's KV needs (§5): it reads at most ``window`` (W) prior positions and proposes
    blocks of at most ``k_max`` (K_max) positions; each draft position stores ``row_bytes`` of
    K/V over all draft layers. ``fixed_bytes`` is what it adds per GPU besides the draft ring
    and the staging arenas (weights, buffers, metadata). A drafter whose KV is one of the
    profile's sources (the MTP layer, ``--drafter mtp``) has no draft ring: W = 0 and no draft
    K/V bytes; its verified blocks still take staging."""

    name: str
    window: int
    k_max: int
    row_bytes: int
    fixed_bytes: int = 0

    def __post_init__(self) -> None:
        _positive(k_max=self.k_max)
        if self.window < 0 or self.row_bytes < 0:
            raise ValueError(
                f"window and row_bytes must be >= 0, got {self.window}, {self.row_bytes}"
            )
        if (self.window == 0) != (self.row_bytes == 0):
            raise ValueError("a drafter without a draft ring has W = 0 and no draft K/V bytes")
        if self.fixed_bytes < 0:
            raise ValueError(f"fixed_bytes must be >= 0, got {self.fixed_bytes}")


@dataclass(frozen=True)
class Profile:
    """Everything the capacity model needs to know about one model served over the hierarchy.

    ``top_k`` (k), ``hot_cache_rows`` (B), ``tail_pages`` and ``page_size`` (p) are in stored
    rows of a source; ``chi`` (χ) is the number of payload sources live at once during
    verification (eq. 11). ``estimated`` names the fields that are estimates, not published
    figures."""

    name: str
    sources: tuple[SourceGroup, ...]
    indexers: tuple[IndexGroup, ...]
    top_k: int
    hot_cache_rows: int
    chi: int
    page_size: int = 64
    tail_pages: int = 1
    page_map_entry_bytes: int = 4  # one int32 page-map entry per history page
    # Index keys per page (default p). The workers' hierarchy modes lay keys in pages of the
    # payload pool, p * d_kv / d_index keys to a page, and report it.
    key_page_rows: int | None = None
    drafters: tuple[DrafterProfile, ...] = ()
    description: str = ""
    estimated: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("a profile needs at least one KV source")
        _positive(
            top_k=self.top_k,
            hot_cache_rows=self.hot_cache_rows,
            chi=self.chi,
            page_size=self.page_size,
            tail_pages=self.tail_pages,
        )
        if self.key_page_rows is not None:
            _positive(key_page_rows=self.key_page_rows)
        if self.page_map_entry_bytes < 0:
            raise ValueError("page_map_entry_bytes must be >= 0")
        names = [d.name for d in self.drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate drafter names in {names}")

    @property
    def payload_sources(self) -> int:
        """Sparse payload sources: the ones offloaded, and the ones staging arenas serve."""
        return sum(s.count for s in self.sources if s.kind == "sparse")

    @property
    def d_kv(self) -> int:
        """Bytes of the widest sparse-source row: the row size staging must hold."""
        return max((s.row_bytes for s in self.sources if s.kind == "sparse"), default=0)

    @property
    def index_producers(self) -> int:
        return sum(g.count for g in self.indexers)

    def drafter(self, name: str) -> DrafterProfile:
        for d in self.drafters:
            if d.name == name:
                return d
        known = ", ".join(d.name for d in self.drafters) or "none"
        raise ValueError(f"profile {self.name!r} has no drafter {name!r} (known: {known})")

    def with_overrides(self, **changes: int | None) -> Profile:
        """A copy with the given fields replaced; ``None`` values leave a field as it is."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


@dataclass(frozen=True)
class Deployment:
    """How sessions meet memory on one node.

    ``pool_bytes`` is, per GPU, the memory for required allocations (M of eq. 3: KV pools)
    *plus* the fixed allocations a drafter brings; ``fixed_bytes`` is any other fixed per-GPU
    allocation taken from it. ``slots`` is N, the request slots per GPU that the draft ring and
    staging are reserved for; ``None`` sizes them for the sessions that fit. ``gpus`` is the
    number of GPUs that share one host of ``host_bytes``: each holding its own sessions, or,
    in the plan of a parallel layout (``layouts``), grouped in workers of N GPUs.

    Instead of a pool, ``hbm_bytes`` is each GPU's memory: a layout's pool is then what is left
    after the weights each of its ranks holds and ``reserve_bytes`` (activations, CUDA graphs,
    NCCL buffers: what the worker uses besides weights and its KV pool)."""

    pool_bytes: int | None = None
    gpus: int = 1
    fixed_bytes: int = 0
    slots: int | None = None
    host_bytes: int | None = None
    note: str = ""
    hbm_bytes: int | None = None
    reserve_bytes: int = 0

    def __post_init__(self) -> None:
        _positive(gpus=self.gpus)
        for name in ("pool_bytes", "slots", "host_bytes", "hbm_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("fixed_bytes", "reserve_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.pool_bytes is not None and self.hbm_bytes is not None:
            raise ValueError("give a KV pool per GPU or the GPU's memory, not both")

    def with_overrides(self, **changes: int | str | None) -> Deployment:
        """A copy with the given fields replaced; ``None`` values leave a field as it is."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
