"""A capacity plan: every figure of the capacity model for one profile, context length,
drafter and deployment, gathered for ``dhisparse plan`` (table and JSON): on GPUs that each
hold their own sessions, or, for parallel layouts, on workers that span N GPUs each
(``layouts``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from dhisparse.capacity.admitted import (
    HostSizing,
    SpeculationTest,
    host_sizing,
    speculation_test,
)
from dhisparse.capacity.layouts import LayoutPlan, Refusal, plan_layouts
from dhisparse.capacity.model import (
    MODES,
    Mode,
    SessionBytes,
    draft_ring_bytes,
    ring_rows,
    session_bytes,
    sessions_per_gpu,
    staging_bytes,
)
from dhisparse.capacity.model_size import ModelSize
from dhisparse.capacity.profile import Deployment, DrafterProfile, Profile
from dhisparse.capacity.shared_prefix import SharedPrefix, shared_prefix
from dhisparse.capacity.weights import ModelWeights
from dhisparse.family.parallel_layout import ParallelConfig


@dataclass(frozen=True)
class SlotSizing:
    """Per-GPU draft ring (eqs. 9–10) and staging (eq. 11) for N request slots."""

    slots: int  # N
    ring_rows: int  # R_d
    ring_bytes: int  # N·R_d rows of draft K/V
    staging_bytes: int  # M_stage with χ arenas
    staging_bytes_per_source: int  # M_stage with one arena per payload source
    staging_reduction: float  # payload sources / χ
    added_per_session: int  # ring + staging share: what speculation adds to a session
    fixed_bytes: int  # the drafter's fixed allocations + M_stage


@dataclass(frozen=True)
class Admission:
    """Sessions admitted per GPU and over the deployment's GPUs."""

    mode: Mode
    drafter: str | None
    per_gpu: int
    total: int


@dataclass(frozen=True)
class Plan:
    profile: Profile
    context_tokens: int
    drafter: DrafterProfile | None
    deployment: Deployment
    base: tuple[SessionBytes, ...]  # per mode (MODES order), no drafter
    spec: tuple[SessionBytes, ...]  # per mode with the drafter; empty without one
    slots: SlotSizing | None
    admissions: tuple[Admission, ...]
    host: HostSizing
    speculation: SpeculationTest | None
    model: ModelSize | None = None  # parameters and bytes per token of a Hugging Face model
    # Workers spanning N GPUs, one plan per layout (then ``admissions`` is empty and ``host``
    # per session only: each layout sizes its own); the layouts the model cannot be split by.
    layouts: tuple[LayoutPlan, ...] = ()
    refused: tuple[Refusal, ...] = ()
    weight_format: str | None = None  # how the layouts' weights are held
    # A prefix common to every session, held once per GPU (None: not asked; with layouts,
    # each layout's is in its plan)
    shared_prefix: SharedPrefix | None = None

    def ratio(self, with_drafter: bool = False) -> float:
        """Resident bytes over hierarchy bytes per session."""
        resident, hierarchy = self.spec if with_drafter else self.base
        return resident.total / hierarchy.total

    def admitted(self, mode: Mode, with_drafter: bool) -> Admission | None:
        """The admission of ``mode`` with or without the drafter; None without a pool."""
        name = self.drafter.name if with_drafter and self.drafter is not None else None
        return _find(self.admissions, mode, name)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["base"] = {sb.mode: sb.as_dict() for sb in self.base}
        d["spec"] = {sb.mode: sb.as_dict() for sb in self.spec}
        d["ratio"] = {"base": self.ratio(False)}
        if self.spec:
            d["ratio"]["spec"] = self.ratio(True)
        d["model"] = self.model.as_dict() if self.model is not None else None
        d["layouts"] = [lp.as_dict() for lp in self.layouts]
        if self.shared_prefix is None:
            del d["shared_prefix"]  # a plan without one reads as it always has
        d["profile"].update(
            payload_sources=self.profile.payload_sources,
            index_producers=self.profile.index_producers,
            d_kv=self.profile.d_kv,
        )
        return d


def build_plan(
    profile: Profile,
    context_tokens: int,
    drafter: DrafterProfile | None = None,
    deployment: Deployment | None = None,
    *,
    tpot_ratio: float | None = None,
    load: int | None = None,
    model: ModelSize | None = None,
    layouts: Sequence[ParallelConfig] = (),
    weights: ModelWeights | None = None,
    refuse: bool = True,
    prefix_tokens: int | None = None,
) -> Plan:
    """All figures for one configuration. N (slots) is the deployment's, else the sessions the
    hierarchy with the drafter admits per GPU, else unknown (no per-GPU sizing). ``model``: the
    size of the model the profile comes from, reported with the plan. ``prefix_tokens``: that
    many tokens of every session's context are a prefix they share (``shared_prefix``).

    ``layouts``: size workers that span GPUs instead, each layout on the deployment's node
    (``layouts.plan_layouts``), with ``weights`` the model's (None: a profile without them);
    ``refuse``: a layout that does not divide the model is an error (else it is reported)."""
    dep = deployment or Deployment()
    if layouts:
        return _layout_plan(
            profile, context_tokens, drafter, dep, layouts, weights, refuse,
            tpot_ratio=tpot_ratio, load=load, model=model, prefix_tokens=prefix_tokens,
        )  # fmt: skip
    base = tuple(session_bytes(profile, context_tokens, m) for m in MODES)
    spec = (
        tuple(session_bytes(profile, context_tokens, m, drafter) for m in MODES) if drafter else ()
    )

    admissions: list[Admission] = []
    if dep.pool_bytes is not None:
        for d in (None, drafter) if drafter else (None,):
            for m in MODES:
                # Slots bound the drafter's configuration only: they size its ring and staging.
                slots = dep.slots if d is not None else None
                n = sessions_per_gpu(
                    profile,
                    context_tokens,
                    m,
                    dep.pool_bytes,
                    drafter=d,
                    fixed_bytes=dep.fixed_bytes,
                    slots=slots,
                )
                admissions.append(Admission(m, d.name if d else None, n, n * dep.gpus))

    hier_base = _find(admissions, "hierarchy", None)
    hier_spec = _find(admissions, "hierarchy", drafter.name) if drafter else None

    slots_sizing = None
    if drafter is not None:
        n_slots = dep.slots
        if n_slots is None and hier_spec is not None:
            n_slots = hier_spec.per_gpu
        if n_slots is not None:
            slots_sizing = _slot_sizing(profile, drafter, n_slots)

    base_sessions = hier_base.total if hier_base else None
    host = host_sizing(profile, context_tokens, base_sessions, dep.host_bytes)
    speculation = None
    if hier_spec is not None and base_sessions:
        speculation = speculation_test(hier_spec.total, base_sessions, load, tpot_ratio)
    shared = None
    if prefix_tokens is not None:
        shared = shared_prefix(
            profile, context_tokens, prefix_tokens, drafter, dep,
            pool_bytes=dep.pool_bytes, pools=dep.gpus,
        )  # fmt: skip

    return Plan(
        profile=profile,
        context_tokens=context_tokens,
        drafter=drafter,
        deployment=dep,
        base=base,
        spec=spec,
        slots=slots_sizing,
        admissions=tuple(admissions),
        host=host,
        speculation=speculation,
        model=model,
        shared_prefix=shared,
    )


def _layout_plan(
    profile: Profile,
    context_tokens: int,
    drafter: DrafterProfile | None,
    dep: Deployment,
    layouts: Sequence[ParallelConfig],
    weights: ModelWeights | None,
    refuse: bool,
    *,
    tpot_ratio: float | None,
    load: int | None,
    model: ModelSize | None,
    prefix_tokens: int | None,
) -> Plan:
    plans, refused = plan_layouts(
        profile, context_tokens, drafter, dep, layouts, weights, refuse=refuse,
        tpot_ratio=tpot_ratio, load=load, prefix_tokens=prefix_tokens,
    )  # fmt: skip
    slots_sizing = None
    if drafter is not None:
        first = plans[0].admitted("hierarchy", drafter.name)
        n_slots = dep.slots if dep.slots is not None else (first.per_gpu if first else None)
        if n_slots:
            slots_sizing = _slot_sizing(profile, drafter, n_slots)
    return Plan(
        profile=profile,
        context_tokens=context_tokens,
        drafter=drafter,
        deployment=dep,
        base=tuple(session_bytes(profile, context_tokens, m) for m in MODES),
        spec=tuple(session_bytes(profile, context_tokens, m, drafter) for m in MODES)
        if drafter
        else (),
        slots=slots_sizing,
        admissions=(),
        host=host_sizing(profile, context_tokens, None, dep.host_bytes),
        speculation=None,
        model=model,
        layouts=plans,
        refused=refused,
        weight_format=weights.format if weights is not None else None,
    )


def _find(admissions: Sequence[Admission], mode: Mode, drafter: str | None) -> Admission | None:
    return next((a for a in admissions if a.mode == mode and a.drafter == drafter), None)


def _slot_sizing(profile: Profile, drafter: DrafterProfile, slots: int) -> SlotSizing:
    args = (slots, drafter.k_max, profile.top_k, profile.d_kv)
    staged = staging_bytes(profile.chi, *args)
    per_source = staging_bytes(profile.payload_sources, *args)
    share = staging_bytes(profile.chi, 1, drafter.k_max, profile.top_k, profile.d_kv)
    return SlotSizing(
        slots=slots,
        ring_rows=ring_rows(drafter.window, drafter.k_max, profile.page_size),
        ring_bytes=draft_ring_bytes(profile, drafter, slots),
        staging_bytes=staged,
        staging_bytes_per_source=per_source,
        staging_reduction=profile.payload_sources / profile.chi,
        added_per_session=draft_ring_bytes(profile, drafter) + share,
        fixed_bytes=drafter.fixed_bytes + staged,
    )
