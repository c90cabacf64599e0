"""A capacity plan: every figure of the capacity model for one profile, context length,
drafter and deployment, gathered for ``dhisparse plan`` (table and JSON)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from dhisparse.capacity.model import (
    MODES,
    Mode,
    SessionBytes,
    draft_ring_bytes,
    host_bytes,
    host_sessions,
    ring_rows,
    session_bytes,
    sessions_kept_share,
    sessions_per_gpu,
    speculation_pays,
    staging_bytes,
)
from dhisparse.capacity.model_size import ModelSize
from dhisparse.capacity.profile import Deployment, DrafterProfile, Profile


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
class HostSizing:
    """Host memory for the backups of the sessions the hierarchy admits."""

    per_session: int
    sessions: int | None  # hierarchy sessions over all GPUs (None: no pool given)
    bytes: int | None
    capacity: int | None
    holds: int | None  # sessions whose backups the host can hold


@dataclass(frozen=True)
class SpeculationTest:
    """Eq. 13 on the hierarchy's session counts: pays while share > TPOT ratio."""

    n_spec: int
    n_base: int
    load: int | None
    share: float
    tpot_ratio: float | None
    pays: bool | None


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
) -> Plan:
    """All figures for one configuration. N (slots) is the deployment's, else the sessions the
    hierarchy with the drafter admits per GPU, else unknown (no per-GPU sizing). ``model``: the
    size of the model the profile comes from, reported with the plan."""
    dep = deployment or Deployment()
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
    host = HostSizing(
        per_session=host_bytes(profile, context_tokens),
        sessions=base_sessions,
        bytes=host_bytes(profile, context_tokens, base_sessions) if base_sessions else None,
        capacity=dep.host_bytes,
        holds=host_sessions(profile, context_tokens, dep.host_bytes) if dep.host_bytes else None,
    )

    speculation = None
    if hier_spec is not None and base_sessions:
        n_spec = hier_spec.total
        share = sessions_kept_share(n_spec, base_sessions, load)
        pays = None
        if tpot_ratio is not None:
            pays = speculation_pays(n_spec, base_sessions, tpot_ratio, load)
        speculation = SpeculationTest(n_spec, base_sessions, load, share, tpot_ratio, pays)

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
