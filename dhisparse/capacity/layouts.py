"""Every parallel layout of a worker over N GPUs, sized (DESIGN §8): what each rank holds of the
weights (``weights``), the KV pool an HBM size leaves each GPU, and the sessions a worker and a
node hold.

The MLA latent row is one head: tensor parallelism cannot split it, so every rank of a TP (or
TP + EP) worker stores every request's rows, and a session needs on each GPU the bytes it needs
on one (``model.session_bytes``): the worker holds one GPU's pool of sessions, its weights
split under it. Under data-parallel attention each rank serves its own requests from its own
pool: the worker holds N pools of sessions, each rank holding attention, indexer, dense MLPs
and vocabulary whole. ``ParallelConfig.serving_ranks`` is that factor, as the worker reports
it to the gateway (``LoadResponse.serving_ranks``), whose admission charges a session's bytes
against one rank's share.

A node of G GPUs runs G / N workers. Its host store keeps one backup per session under every
layout (TP: rank 0 writes it and every rank reads it; DP attention: each rank its own
requests'), so the host sizing is the node's hierarchy sessions times a session's backup."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from dhisparse.capacity.admitted import (
    HostSizing,
    SpeculationTest,
    host_sizing,
    speculation_test,
)
from dhisparse.capacity.model import MODES, Mode, sessions_per_gpu
from dhisparse.capacity.profile import Deployment, DrafterProfile, Profile
from dhisparse.capacity.shared_prefix import SharedPrefix, shared_prefix
from dhisparse.capacity.weights import ModelWeights, RankWeights
from dhisparse.family.parallel_layout import LayoutError, ParallelConfig

ALL = "all"


@dataclass(frozen=True)
class LayoutAdmission:
    """Sessions of one mode (with or without the drafter) under one layout."""

    mode: Mode
    drafter: str | None
    per_gpu: int  # what one GPU's KV pool holds
    per_worker: int  # per_gpu × the worker's serving ranks
    per_node: int  # per_worker × the node's workers


@dataclass(frozen=True)
class LayoutPlan:
    """One layout of a worker on a node of ``gpus`` GPUs. ``weights``: each rank's (None for a
    profile without a model's weights); ``pool_bytes``: each GPU's KV pool, given, or what
    ``hbm_bytes`` leaves after the weights and ``reserve_bytes`` (0 when nothing is left;
    None: neither given, no sessions sized)."""

    parallel: ParallelConfig
    weights: RankWeights | None
    hbm_bytes: int | None
    reserve_bytes: int
    pool_bytes: int | None
    gpus: int
    admissions: tuple[LayoutAdmission, ...]
    host: HostSizing  # the node's hierarchy sessions (no drafter)
    speculation: SpeculationTest | None  # eq. 13 over the node's hierarchy sessions
    # a prefix common to every session (None: not asked): its totals are the node's
    shared_prefix: SharedPrefix | None = None

    @property
    def name(self) -> str:
        return self.parallel.name

    @property
    def spare_bytes(self) -> int:
        """What ``hbm_bytes`` leaves each GPU after the weights and the reserve: negative when
        they do not fit (0 without an HBM size or the weights)."""
        if self.hbm_bytes is None or self.weights is None:
            return 0
        return self.hbm_bytes - self.weights.total - self.reserve_bytes

    @property
    def workers(self) -> int:
        """Workers on the node: one per N GPUs."""
        return self.gpus // self.parallel.world_size

    def admitted(self, mode: Mode, drafter: str | None) -> LayoutAdmission | None:
        return next((a for a in self.admissions if a.mode == mode and a.drafter == drafter), None)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            name=self.name,
            workers=self.workers,
            serving_ranks=self.parallel.serving_ranks,
            weights=self.weights.as_dict() if self.weights is not None else None,
        )
        if self.shared_prefix is None:
            del d["shared_prefix"]  # a plan without one reads as it always has
        return d


@dataclass(frozen=True)
class Refusal:
    """A layout the model cannot be split by, with the worker's start-up message."""

    layout: str
    reason: str


def layouts_of(
    n: int, names: str | None, expert_parallel: bool = False, dp_attention: bool = False
) -> tuple[ParallelConfig, ...]:
    """The layouts ``dhisparse plan`` sizes: ``names`` (``--layouts``: "all", or names of
    ``ParallelConfig.name`` separated by commas) over ``n`` GPUs, or the one the worker's flags
    give. Raises ValueError naming the flag at fault."""
    if names is None:
        return (ParallelConfig(n, expert_parallel, dp_attention),)
    if n < 2:
        raise ValueError(f"--layouts needs --tensor-parallel-size N >= 2 (got {n})")
    if expert_parallel or dp_attention:
        raise ValueError(
            "--layouts names the layouts itself: leave out --expert-parallel and "
            "--data-parallel-attention"
        )
    every = {c.name: c for c in (ParallelConfig(n, ep, dp) for dp in (False, True)
                                  for ep in (False, True))}  # fmt: skip
    if names == ALL:
        return tuple(every.values())
    asked = [s.strip() for s in names.split(",") if s.strip()]
    unknown = [s for s in asked if s not in every]
    if unknown or not asked:
        raise ValueError(
            f"--layouts {names!r}: choose {ALL!r} or from {', '.join(every)} (comma-separated)"
        )
    return tuple(every[s] for s in dict.fromkeys(asked))


def plan_layouts(
    profile: Profile,
    context_tokens: int,
    drafter: DrafterProfile | None,
    deployment: Deployment,
    layouts: Sequence[ParallelConfig],
    weights: ModelWeights | None,
    *,
    refuse: bool = True,
    tpot_ratio: float | None = None,
    load: int | None = None,
    prefix_tokens: int | None = None,
) -> tuple[tuple[LayoutPlan, ...], tuple[Refusal, ...]]:
    """Each of ``layouts`` sized on ``deployment``'s node (``gpus`` GPUs, each with ``pool_bytes``
    of KV pool or ``hbm_bytes`` of HBM). A layout that does not divide the model raises its
    LayoutError (the worker's start-up message) with ``refuse``; without, it is left out and
    returned as a Refusal (the others compared), unless none is left. ``prefix_tokens``: as
    ``layout_plan``'s."""
    plans: list[LayoutPlan] = []
    refused: list[Refusal] = []
    sizing = (profile, context_tokens, drafter, deployment)
    for cfg in layouts:
        try:
            plans.append(
                layout_plan(*sizing, cfg, weights, tpot_ratio=tpot_ratio, load=load,
                            prefix_tokens=prefix_tokens)
            )  # fmt: skip
        except LayoutError as e:
            if refuse:
                raise
            refused.append(Refusal(cfg.name, str(e)))
    if not plans:
        reasons = "; ".join(r.reason for r in refused)
        raise LayoutError(
            f"no layout over {layouts[0].world_size} GPUs splits the model: {reasons}"
        )
    return tuple(plans), tuple(refused)


def layout_plan(
    profile: Profile,
    context_tokens: int,
    drafter: DrafterProfile | None,
    deployment: Deployment,
    cfg: ParallelConfig,
    weights: ModelWeights | None,
    *,
    tpot_ratio: float | None = None,
    load: int | None = None,
    prefix_tokens: int | None = None,
) -> LayoutPlan:
    """One layout sized (see ``plan_layouts``); ``prefix_tokens``: that many tokens of every
    session are a prefix they share (``shared_prefix``, on the node's pools)."""
    dep = deployment
    n = cfg.world_size
    if dep.gpus % n:
        raise ValueError(
            f"--gpus {dep.gpus} per node is not a multiple of --tensor-parallel-size {n}"
        )
    rank = weights.per_rank(cfg) if weights is not None else None
    pool = dep.pool_bytes
    if pool is None and dep.hbm_bytes is not None:
        if rank is None:
            raise ValueError(
                f"--gpu-gib needs the model's weights: {profile.name!r} has none here; give "
                "--model DIR (DeepSeek-V3.2, GLM-5) or a family preset, or --pool-gib"
            )
        pool = max(dep.hbm_bytes - rank.total - dep.reserve_bytes, 0)  # 0: they do not fit
    workers = dep.gpus // n
    admissions: list[LayoutAdmission] = []
    if pool is not None:
        for d in (None, drafter) if drafter else (None,):
            for mode in MODES:
                per_gpu = sessions_per_gpu(
                    profile, context_tokens, mode, pool, drafter=d,
                    fixed_bytes=dep.fixed_bytes, slots=dep.slots if d is not None else None,
                )  # fmt: skip
                per_worker = per_gpu * cfg.serving_ranks
                admissions.append(
                    LayoutAdmission(mode, d.name if d else None, per_gpu, per_worker,
                                    per_worker * workers)
                )  # fmt: skip
    base = next((a for a in admissions if a.mode == "hierarchy" and a.drafter is None), None)
    spec = None
    if drafter is not None:
        spec = next(
            (a for a in admissions if a.mode == "hierarchy" and a.drafter == drafter.name), None
        )
    speculation = None
    if base is not None and spec is not None:
        speculation = speculation_test(spec.per_node, base.per_node, load, tpot_ratio)
    shared = None
    if prefix_tokens is not None:
        shared = shared_prefix(
            profile, context_tokens, prefix_tokens, drafter, dep, pool_bytes=pool,
            pools=cfg.serving_ranks * workers,
            tensor_parallel=cfg.world_size > 1 and not cfg.data_parallel_attention,
        )  # fmt: skip
    return LayoutPlan(
        parallel=cfg,
        weights=rank,
        hbm_bytes=dep.hbm_bytes,
        reserve_bytes=dep.reserve_bytes,
        pool_bytes=pool,
        gpus=dep.gpus,
        admissions=tuple(admissions),
        host=host_sizing(profile, context_tokens, base.per_node if base else None, dep.host_bytes),
        speculation=speculation,
        shared_prefix=shared,
    )
