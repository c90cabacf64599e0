"""A prefix common to every session (an agent's system prompt and tools), in a plan: the GPU
bytes its sessions hold once per GPU, what each holds besides, the sessions a GPU admits so,
and the host memory with the node store's copy of it (``dhisparse plan --shared-prefix``).

The bytes are the capacity model's (``model.shared_prefix_bytes``, ``prefix_unshared``,
``shared_prefix_host_bytes``). One rule is the layout's: the ranks of a tensor-parallel group
keep no records of index keys (rank 0 alone leaves pages: ``serving.key_records``), so a
hierarchy worker of that layout shares nothing on the device; its resident ranks keep the
same records, each on its GPU."""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse.capacity.model import (
    MODES,
    Mode,
    host_bytes,
    host_sessions,
    prefix_unshared,
    session_bytes,
    sessions_per_gpu,
    shared_prefix_bytes,
    shared_prefix_host_bytes,
)
from dhisparse.capacity.profile import Deployment, DrafterProfile, Profile

TENSOR_PARALLEL = "a tensor-parallel group keeps no key records"


@dataclass(frozen=True)
class PrefixShare:
    """The bytes of the prefix each GPU holds once in ``mode``; 0 with the reason where the
    worker shares none of its pages."""

    mode: Mode
    bytes: int
    unshared: str | None


@dataclass(frozen=True)
class PrefixAdmission:
    """Sessions of ``mode`` (with ``drafter`` or none) sharing the prefix."""

    mode: Mode
    drafter: str | None
    own_bytes: int  # a session's bytes besides the shared ones (its ``total`` less them)
    per_gpu: int | None  # sessions one GPU's pool admits with the prefix held once (None: no pool)
    total: int | None  # over the node's pools


@dataclass(frozen=True)
class PrefixHost:
    """The node's host memory for the hierarchy's sessions sharing the prefix. Each session's
    backup holds its own copy of the prefix's rows (an importer copies them into its regions);
    the store holds one more, the cached prefix the importers read."""

    record: int  # the cached prefix in the store: its sparse-source rows, once per node
    sessions: int | None  # the node's hierarchy sessions with the prefix shared (no drafter)
    bytes: int | None  # their backups and the cached prefix
    holds: int | None  # sessions whose backups a host holds beside the cached prefix


@dataclass(frozen=True)
class SharedPrefix:
    """The plan of sessions whose first ``tokens`` tokens are the same."""

    tokens: int  # of every session's context
    shares: tuple[PrefixShare, ...]  # per mode (MODES order)
    admissions: tuple[PrefixAdmission, ...]  # per mode, without then with the drafter
    host: PrefixHost

    def share(self, mode: Mode) -> PrefixShare:
        return next(s for s in self.shares if s.mode == mode)

    def admitted(self, mode: Mode, drafter: str | None) -> PrefixAdmission | None:
        return next((a for a in self.admissions if a.mode == mode and a.drafter == drafter), None)


def shared_prefix(
    profile: Profile,
    context_tokens: int,
    prefix_tokens: int,
    drafter: DrafterProfile | None,
    deployment: Deployment,
    *,
    pool_bytes: int | None,
    pools: int,
    tensor_parallel: bool = False,
) -> SharedPrefix:
    """Sessions of ``context_tokens`` tokens whose first ``prefix_tokens`` are the same, on GPUs
    of ``pool_bytes`` (None: no sessions sized) with ``deployment``'s fixed allocations and
    slots; ``pools``: the node's GPUs that hold sessions of their own (the sessions' total is
    per GPU times that); ``tensor_parallel``: a worker whose ranks serve every request."""
    if not 0 <= prefix_tokens <= context_tokens:
        raise ValueError(
            f"the shared prefix ({prefix_tokens:,} tokens) must be part of the context "
            f"({context_tokens:,} tokens)"
        )
    shares = tuple(_share(profile, prefix_tokens, m, tensor_parallel) for m in MODES)
    admissions = [
        _admission(profile, context_tokens, share, d, deployment, pool_bytes, pools)
        for d in ((None, drafter) if drafter else (None,))
        for share in shares
    ]
    base = next(a for a in admissions if a.mode == "hierarchy" and a.drafter is None)
    return SharedPrefix(
        tokens=prefix_tokens,
        shares=shares,
        admissions=tuple(admissions),
        host=_host(profile, context_tokens, prefix_tokens, base.total, deployment.host_bytes),
    )


def _share(profile: Profile, prefix_tokens: int, mode: Mode, tensor_parallel: bool) -> PrefixShare:
    why = prefix_unshared(profile, mode)
    if why is None and tensor_parallel and mode == "hierarchy":
        why = TENSOR_PARALLEL
    shared = shared_prefix_bytes(profile, prefix_tokens, mode) if why is None else 0
    return PrefixShare(mode, shared, why)


def _admission(
    profile: Profile,
    context_tokens: int,
    share: PrefixShare,
    drafter: DrafterProfile | None,
    dep: Deployment,
    pool_bytes: int | None,
    pools: int,
) -> PrefixAdmission:
    mode = share.mode
    own = session_bytes(profile, context_tokens, mode, drafter).total - share.bytes
    per_gpu = None
    if pool_bytes is not None:
        per_gpu = sessions_per_gpu(
            profile, context_tokens, mode, pool_bytes, drafter=drafter,
            fixed_bytes=dep.fixed_bytes, slots=dep.slots if drafter is not None else None,
            shared_bytes=share.bytes,
        )  # fmt: skip
    total = per_gpu * pools if per_gpu is not None else None
    return PrefixAdmission(mode, drafter.name if drafter else None, own, per_gpu, total)


def _host(
    profile: Profile,
    context_tokens: int,
    prefix_tokens: int,
    sessions: int | None,
    capacity: int | None,
) -> PrefixHost:
    record = shared_prefix_host_bytes(profile, prefix_tokens)
    holds = None
    if capacity is not None:
        holds = (
            host_sessions(profile, context_tokens, capacity - record) if capacity > record else 0
        )
    return PrefixHost(
        record=record,
        sessions=sessions,
        bytes=host_bytes(profile, context_tokens, sessions) + record if sessions else None,
        holds=holds,
    )
