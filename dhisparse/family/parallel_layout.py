"""How a worker's ranks split a DeepSeek-V3.2 / GLM-5 model: the parallel configuration (the
flags), each rank's share of every sharded dimension, and the one table (``cut``) that says
which slice of a full tensor a rank holds — read by the model's constructor (local shapes),
the random init (the full tensor drawn, the rank's slice kept) and the loader (only the slice
read from the memory-mapped checkpoint).

Layouts over N ranks:
- **TP** (tensor parallel): attention heads, the dense MLPs, the shared experts, the
  vocabulary and the routed experts' intermediate dimension split N ways; the MLA latent row,
  the indexer and the router replicated (every rank computes the same KV rows, index keys and
  selections).
- **TP + EP** (``expert_parallel``): as TP, but each rank holds n_experts / N whole experts.
- **DP attention** (``data_parallel_attention``): attention, the indexer, the dense MLPs and
  the vocabulary replicated (each rank attends for its own requests); the routed experts split
  by expert (with EP) or by intermediate dimension, over all N ranks.

FP8 weights of 128 x 128 blocks are never split inside a block: ``validate`` refuses a
configuration whose cuts would.

Pure Python (torch only where a cut is applied to a tensor, ``Cut.take``): ``dhisparse plan``
sizes every layout's weights per rank with this table, without torch."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dhisparse.family.hf_config import MLAConfig
from dhisparse.family.quantization_config import FP8_EDGE, SCALE_SUFFIX

if TYPE_CHECKING:
    import torch


class LayoutError(ValueError):
    """A parallel configuration the model cannot be split by (raised at start-up)."""


@dataclass(frozen=True)
class ParallelConfig:
    """The flags ``--tensor-parallel-size``, ``--expert-parallel``, ``--data-parallel-attention``
    (the same on ``dhisparse worker``, ``up`` and ``generate``)."""

    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    data_parallel_attention: bool = False

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise LayoutError(
                f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.tensor_parallel_size == 1 and (
            self.expert_parallel or self.data_parallel_attention
        ):
            raise LayoutError(
                "--expert-parallel and --data-parallel-attention need --tensor-parallel-size >= 2"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def serving_ranks(self) -> int:
        """Ranks that each serve requests of their own from a KV pool of their own: every rank
        under data-parallel attention; otherwise one, the group (the MLA latent row is one
        head, so every tensor-parallel rank stores every request's rows: the group holds one
        GPU's pool of sessions)."""
        return self.world_size if self.data_parallel_attention else 1

    def store_owner(self, worker_id: str, rank: int) -> str:
        """The owner id under which rank ``rank``'s host regions are registered at the node's
        store: the worker id for one rank and for a tensor-parallel group (one set of regions,
        ``rank_group.region_group``); under data-parallel attention each rank is an owner of its
        own, ``<worker id>/dp<rank>``, the same across restarts, so the restarted group's rank
        r adopts what rank r left (``durable.adoption``)."""
        if self.data_parallel_attention:
            return f"{worker_id}/dp{rank}"
        return worker_id

    @property
    def name(self) -> str:
        if self.world_size == 1:
            return "single"
        attn = "dp-attention" if self.data_parallel_attention else "tp"
        return f"{attn}+ep" if self.expert_parallel else attn


SINGLE = ParallelConfig()


@dataclass(frozen=True)
class Span:
    """This rank's part ``[start, stop)`` of a dimension of ``total`` split ``parts`` ways."""

    start: int
    stop: int
    total: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        return self.size == self.total

    @classmethod
    def of(cls, total: int, parts: int, index: int) -> Span:
        n = total // parts
        return cls(index * n, (index + 1) * n, total)


@dataclass(frozen=True)
class Cut:
    """The slice of a full tensor one rank holds: along ``dim``, the index ranges ``parts``
    (``(start, stop)`` of the full dimension), concatenated in order (gate's and up's shares of
    a fused gate_up tensor are two ranges)."""

    dim: int
    parts: tuple[tuple[int, int], ...]
    total: int  # the full dimension

    def take(self, t: torch.Tensor) -> torch.Tensor:
        import torch  # the table itself is pure Python (the capacity model reads it)

        d = self.dim % t.dim()
        pieces = [t.narrow(d, a, b - a) for a, b in self.parts]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        """The local shape of a tensor of shape ``full``."""
        d = self.dim % len(full)
        out = list(full)
        out[d] = sum(b - a for a, b in self.parts)
        return tuple(out)

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """The full shape of a tensor of local shape ``local``."""
        out = list(local)
        out[self.dim % len(local)] = self.total
        return tuple(out)

    def blocks(self, block: int = FP8_EDGE) -> Cut:
        """The same cut of a tensor's block-scale grid (every range on block boundaries)."""
        parts = tuple((a // block, -(-b // block)) for a, b in self.parts)
        if len(parts) == 2:  # gate's and up's grids, each ceil(I / block) rows
            return Cut(self.dim, parts, 2 * -(-(self.total // 2) // block))
        return Cut(self.dim, parts, -(-self.total // block))

    def aligned(self, block: int = FP8_EDGE) -> bool:
        """Whether every range starts and ends on a block boundary (or the tensor's end)."""
        return all(a % block == 0 and (b % block == 0 or b == self.total) for a, b in self.parts)


@dataclass(frozen=True)
class RankLayout:
    """Rank ``rank``'s shares under ``cfg`` (a ``ParallelConfig``) of a model of ``family``."""

    cfg: ParallelConfig
    rank: int
    family: MLAConfig

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.cfg.world_size:
            raise LayoutError(f"rank {self.rank} of a group of {self.cfg.world_size}")

    @property
    def n(self) -> int:
        return self.cfg.world_size

    @property
    def attention_tp(self) -> int:
        """Ranks the attention, dense MLPs, shared experts and vocabulary are split over."""
        return 1 if self.cfg.data_parallel_attention else self.n

    @property
    def attention_rank(self) -> int:
        return 0 if self.cfg.data_parallel_attention else self.rank

    @property
    def experts_tp(self) -> int:
        """Ranks each routed expert's intermediate dimension is split over."""
        return 1 if self.cfg.expert_parallel else self.n

    def heads(self) -> Span:
        return Span.of(self.family.num_heads, self.attention_tp, self.attention_rank)

    def dense(self, total: int) -> Span:
        return Span.of(total, self.attention_tp, self.attention_rank)

    def vocab(self) -> Span:
        return Span.of(self.family.vocab_size, self.attention_tp, self.attention_rank)

    def experts(self) -> Span:
        ep = self.n if self.cfg.expert_parallel else 1
        return Span.of(self.family.moe.n_routed, ep, self.rank if ep > 1 else 0)

    def expert_intermediate(self) -> Span:
        i = self.family.moe.intermediate
        return Span.of(i, self.experts_tp, self.rank if self.experts_tp > 1 else 0)

    # ---- the one table of cuts ----------------------------------------------------------------
    def cut(self, name: str) -> Cut | None:
        """The slice this rank holds of our tensor ``name`` (a parameter or buffer of
        ``MLADecoder``; a ``*_scale_inv`` block grid follows its weight), or None for a
        replicated one."""
        if name.endswith(SCALE_SUFFIX):
            weight = name.removesuffix(SCALE_SUFFIX)
            c = self.cut(weight)
            if c is None:
                return None
            # stacked experts hold one grid per expert: their expert dimension is not blocked
            return c if c.dim == 0 and _rule(weight) in _STACKED else c.blocks()
        rule = _rule(name)
        return None if rule is None else _cut(self, rule, self.family)

    def validate(self, fp8: bool) -> None:
        """Raises LayoutError when N does not divide a split dimension, or (``fp8``) when a cut
        of an FP8 weight falls inside a 128 x 128 block."""
        f = self.family
        checks = [
            ("attention heads (num_attention_heads)", f.num_heads, self.attention_tp),
            ("the vocabulary (vocab_size)", f.vocab_size, self.attention_tp),
            ("the dense MLP (intermediate_size)", f.intermediate_size, self.attention_tp),
            (
                "the shared experts (moe_intermediate_size x n_shared_experts)",
                f.moe.intermediate * f.moe.n_shared,
                self.attention_tp,
            ),
            ("routed experts (n_routed_experts)", f.moe.n_routed,
             self.n if self.cfg.expert_parallel else 1),
            ("a routed expert (moe_intermediate_size)", f.moe.intermediate, self.experts_tp),
        ]  # fmt: skip
        for what, total, parts in checks:
            if total % parts:
                raise LayoutError(
                    f"{self.cfg.name} over {self.n} ranks splits {what} = {total} {parts} ways, "
                    f"which does not divide it"
                )
        if not fp8:
            return
        a, x = self.attention_tp, self.experts_tp
        widths = [
            ("q_b_proj rows per rank", self.heads().size * f.qk_head_dim, a),
            ("o_proj columns per rank", self.heads().size * f.v_head_dim, a),
            ("the dense MLP's intermediate per rank", self.dense(f.intermediate_size).size, a),
            ("the shared experts' intermediate per rank",
             self.dense(f.moe.intermediate * f.moe.n_shared).size, a),
            ("a routed expert's intermediate per rank", self.expert_intermediate().size, x),
        ]  # fmt: skip
        for what, width, parts in widths:
            if parts > 1 and width % FP8_EDGE:
                raise LayoutError(
                    f"{self.cfg.name} over {self.n} ranks: {what} is {width}, not a multiple of "
                    f"the FP8 block of {FP8_EDGE}, so the cut would split 128 x 128 blocks; "
                    f"use fewer ranks, --expert-parallel, or --weight-dtype bf16"
                )


# our tensor name (regex) -> how it is cut; the first match wins
_RULES: tuple[tuple[str, str], ...] = (
    (r"attn\.q_b_proj\.weight$", "q_heads"),
    (r"attn\.kv_b_proj\.weight$", "kv_b_heads"),
    (r"attn\.o_proj\.weight$", "o_heads"),
    (r"mlp\.shared_experts\.(gate_proj|up_proj)\.weight$", "shared_rows"),
    (r"mlp\.shared_experts\.down_proj\.weight$", "shared_cols"),
    (r"mlp\.experts\.gate_up_proj$", "experts_gate_up"),
    (r"mlp\.experts\.down_proj$", "experts_down"),
    (r"mlp\.(gate_proj|up_proj)\.weight$", "dense_rows"),
    (r"mlp\.down_proj\.weight$", "dense_cols"),
    (r"^(embed\.weight|lm_head\.weight|mtp\.shared_head\.head\.weight)$", "vocab_rows"),
)


_STACKED = ("experts_gate_up", "experts_down")


def _rule(name: str) -> str | None:
    return next((rule for pattern, rule in _RULES if re.search(pattern, name)), None)


def _range(s: Span, unit: int = 1) -> tuple[tuple[tuple[int, int], ...], int]:
    return ((s.start * unit, s.stop * unit),), s.total * unit


def _cut(lay: RankLayout, rule: str, f: MLAConfig) -> Cut | None:
    h = lay.heads()
    shared = lay.dense(f.moe.intermediate * f.moe.n_shared)
    d = lay.dense(f.intermediate_size)
    cuts = {
        "q_heads": (0, _range(h, f.qk_head_dim), h.whole),
        "kv_b_heads": (0, _range(h, f.qk_nope_head_dim + f.v_head_dim), h.whole),
        "o_heads": (1, _range(h, f.v_head_dim), h.whole),
        "shared_rows": (0, _range(shared), shared.whole),
        "shared_cols": (1, _range(shared), shared.whole),
        "dense_rows": (0, _range(d), d.whole),
        "dense_cols": (1, _range(d), d.whole),
        "vocab_rows": (0, _range(lay.vocab()), lay.vocab().whole),
    }
    if rule in cuts:
        dim, (parts, total), whole = cuts[rule]
        return None if whole else Cut(dim, parts, total)
    # routed experts: [E, 2I, D] gate_up (gate rows, then up rows) and [E, D, I] down
    e, i = lay.experts(), lay.expert_intermediate()
    if not e.whole:
        return Cut(0, *_range(e))
    if i.whole:
        return None
    if rule == "experts_gate_up":
        return Cut(1, ((i.start, i.stop), (i.total + i.start, i.total + i.stop)), 2 * i.total)
    return Cut(2, *_range(i))
