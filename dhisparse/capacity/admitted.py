"""Figures over the sessions a deployment admits: the host memory their backups need
(``HostSizing``) and whether speculation pays (``SpeculationTest``, eq. 13). Shared by the
plan of independent GPUs (``plan``) and the plan of each parallel layout (``layouts``)."""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse.capacity.model import (
    host_bytes,
    host_sessions,
    sessions_kept_share,
    speculation_pays,
)
from dhisparse.capacity.profile import Profile


@dataclass(frozen=True)
class HostSizing:
    """Host memory for the backups of the sessions the hierarchy admits."""

    per_session: int
    sessions: int | None  # hierarchy sessions the host serves (None: no pool given)
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


def host_sizing(
    profile: Profile, context_tokens: int, sessions: int | None, capacity: int | None
) -> HostSizing:
    """The backups of ``sessions`` hierarchy sessions (None: unknown), and how many a host of
    ``capacity`` bytes (None: not given) holds."""
    return HostSizing(
        per_session=host_bytes(profile, context_tokens),
        sessions=sessions,
        bytes=host_bytes(profile, context_tokens, sessions) if sessions else None,
        capacity=capacity,
        holds=host_sessions(profile, context_tokens, capacity) if capacity else None,
    )


def speculation_test(
    n_spec: int, n_base: int, load: int | None, tpot_ratio: float | None
) -> SpeculationTest | None:
    """Eq. 13 for ``n_spec`` sessions with the drafter against ``n_base`` without; None when
    the baseline admits none."""
    if n_base < 1:
        return None
    share = sessions_kept_share(n_spec, n_base, load)
    pays = None if tpot_ratio is None else speculation_pays(n_spec, n_base, tpot_ratio, load)
    return SpeculationTest(n_spec, n_base, load, share, tpot_ratio, pays)
