"""The capacity model's arithmetic (DESIGN §3–§6; the paper's eqs. 3, 8–11, 13).

All sizes are integer bytes. Accounting rules (each reproduces a printed figure of the paper;
see docs/capacity.md for the derivation):

- A stored history is allocated in whole pages of ``p`` rows: a source keeps
  ``p·⌈⌊L/m⌋/p⌉`` rows for ``L`` tokens (eq. 8 gives the complete rows ``⌊L/m⌋``). Index keys
  and host backups are paged the same way.
- **Resident** serving keeps every source's whole history on the GPU, plus every index key.
- The **hierarchy** keeps, per sparse source, the hot cache (B rows) and the tail
  (``tail_pages`` pages), plus every index key; dense sources keep their whole history.
- Both keep a page map, one entry per history page per distinct compression, as metadata, and
  a local-window buffer (a ring sized like eq. 9 with the verified block as K_max) wherever a
  source's window is not already covered by rows held on the GPU.
- A drafter adds its **draft ring** (eq. 9) in both modes; the hierarchy adds also this
  session's share of **staging** (eq. 11 with N = 1). Resident serving needs no staging: every
  selected row is already on the GPU.
- Host backups hold every committed row of the sparse sources (index keys stay on the GPU;
  dense and window-only sources are never offloaded).
- A **shared prefix** (the same leading tokens in every session: an agent's system prompt) is
  held once per GPU where the worker shares its device pages: its complete pages of every
  source's rows and index keys in resident mode, of the index keys in the hierarchy
  (``shared_prefix_bytes``); the node's store keeps one more copy of its rows on the host
  (``shared_prefix_host_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from dhisparse.capacity.profile import DrafterProfile, IndexGroup, Profile, SourceGroup

Mode = Literal["resident", "hierarchy"]
MODES: tuple[Mode, ...] = ("resident", "hierarchy")

GIB = 1 << 30  # the paper's GiB (per-session and per-GPU figures)
TB = 10**12  # the paper's TB (host figures: 0.93 TB, 4.3 TB)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def source_rows(tokens: int, compress: int) -> int:
    """Complete stored rows after ``tokens`` tokens of a source packing ``compress`` (eq. 8)."""
    return tokens // compress


def page_rows(rows: int, page_size: int) -> int:
    """``rows`` rounded up to whole pages of ``page_size`` rows."""
    return page_size * ceil_div(rows, page_size)


def complete_page_tokens(tokens: int, compress: int, page_size: int) -> int:
    """The leading tokens of ``tokens`` whose rows (``compress`` tokens to a row) fill whole
    pages of ``page_size`` rows: a history of that many tokens has no incomplete page."""
    return compress * page_size * (source_rows(tokens, compress) // page_size)


def ring_rows(window: int, k_max: int, page_size: int) -> int:
    """Eq. 9: ``R_d = p·⌈(W + K_max + p − 1)/p⌉`` rows per request slot for a drafter reading at
    most W prior positions in blocks of at most K_max; alignment adds at most p − 1 rows."""
    if window < 0 or k_max < 1 or page_size < 1:
        raise ValueError(f"need W >= 0, K_max >= 1, p >= 1; got {window}, {k_max}, {page_size}")
    return page_size * ceil_div(window + k_max + page_size - 1, page_size)


def ring_address(slot: int, position: int, ring_rows: int) -> int:
    """Eq. 10: ``φ(i, t) = i·R_d + (t mod R_d)``, the ring row of draft position ``t`` of
    request slot ``i``. Two live positions of one slot differ by less than R_d, so they never
    share a row, and slots occupy disjoint ranges."""
    if slot < 0 or position < 0 or ring_rows < 1:
        raise ValueError(f"need i >= 0, t >= 0, R_d >= 1; got {slot}, {position}, {ring_rows}")
    return slot * ring_rows + position % ring_rows


def staging_bytes(chi: int, slots: int, k_max: int, top_k: int, d_kv: int) -> int:
    """Eq. 11: ``M_stage = χ·N·K_max·k·d_kv``: χ live payload sources each get one arena with
    room for K_max disjoint selections of k rows per request slot."""
    if min(chi, slots, k_max, top_k, d_kv) < 0:
        raise ValueError("staging sizes must be >= 0")
    return chi * slots * k_max * top_k * d_kv


def draft_ring_bytes(profile: Profile, drafter: DrafterProfile, slots: int = 1) -> int:
    """Draft KV of ``slots`` request slots: ``N·R_d`` rows of the drafter's K/V bytes."""
    return slots * ring_rows(drafter.window, drafter.k_max, profile.page_size) * drafter.row_bytes


@dataclass(frozen=True)
class SessionBytes:
    """GPU bytes one session requires, by allocation. ``total`` is the paper's per-session
    figure; ``staging`` is the session's share of M_stage (χ·K_max·k·d_kv), which a worker
    reserves once for its N slots rather than per admitted session."""

    mode: Mode
    context_tokens: int
    drafter: str | None
    history: int  # payload rows of whole histories kept on the GPU
    hot_cache: int  # B rows per sparse source (hierarchy)
    tail: int  # tail pages per sparse source (hierarchy)
    window: int  # local sliding-window buffers
    index_keys: int
    metadata: int  # page map
    draft_ring: int
    staging: int

    @property
    def target(self) -> int:
        """Bytes of target-model state (everything but draft ring and staging)."""
        parts = (self.history, self.hot_cache, self.tail, self.window, self.index_keys)
        return sum(parts) + self.metadata

    @property
    def without_staging(self) -> int:
        return self.target + self.draft_ring

    @property
    def total(self) -> int:
        return self.without_staging + self.staging

    def as_dict(self) -> dict[str, int | str | None]:
        d: dict[str, int | str | None] = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(target=self.target, without_staging=self.without_staging, total=self.total)
        return d


def session_bytes(
    profile: Profile, context_tokens: int, mode: Mode, drafter: DrafterProfile | None = None
) -> SessionBytes:
    """Per-session GPU bytes of ``mode`` serving at ``context_tokens`` tokens (module rules)."""
    if context_tokens < 0:
        raise ValueError(f"context_tokens must be >= 0, got {context_tokens}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    p = profile.page_size
    block = drafter.k_max if drafter is not None else 1
    history = hot = tail = window = 0
    for src in profile.sources:
        on_gpu = _history_on_gpu(src, mode)
        if on_gpu:
            history += src.count * _history_bytes(src, context_tokens, p)
        elif src.kind == "sparse":
            hot += src.count * profile.hot_cache_rows * src.row_bytes
            tail += src.count * profile.tail_pages * p * src.row_bytes
        if src.window and not (on_gpu and src.compress == 1):
            window += src.count * ring_rows(src.window, block, p) * src.row_bytes
    key_page = profile.key_page_rows or p
    index_keys = sum(g.count * _key_bytes(g, context_tokens, key_page) for g in profile.indexers)
    compressions = {s.compress for s in profile.sources if s.kind != "window"}
    compressions |= {g.compress for g in profile.indexers}
    metadata = profile.page_map_entry_bytes * sum(
        ceil_div(source_rows(context_tokens, m), p) for m in compressions
    )
    ring = draft_ring_bytes(profile, drafter) if drafter is not None else 0
    staging = 0
    if drafter is not None and mode == "hierarchy":
        staging = staging_bytes(profile.chi, 1, drafter.k_max, profile.top_k, profile.d_kv)
    return SessionBytes(
        mode=mode,
        context_tokens=context_tokens,
        drafter=drafter.name if drafter is not None else None,
        history=history,
        hot_cache=hot,
        tail=tail,
        window=window,
        index_keys=index_keys,
        metadata=metadata,
        draft_ring=ring,
        staging=staging,
    )


def required_bytes(
    profile: Profile,
    context_tokens: int,
    mode: Mode = "hierarchy",
    drafter: DrafterProfile | None = None,
    *,
    staging_reserved: bool = False,
) -> int:
    """Bytes to admit one session (the M_req share of eq. 3). With ``staging_reserved`` the
    worker already reserved M_stage for its N slots, so the session's share is left out."""
    sb = session_bytes(profile, context_tokens, mode, drafter)
    return sb.without_staging if staging_reserved else sb.total


def sessions_that_fit(
    pool_bytes: int,
    per_session_bytes: int,
    fixed_bytes: int = 0,
    slots: int | None = None,
    *,
    shared_bytes: int = 0,
) -> int:
    """``⌊(pool − fixed)/per_session⌋``, at most ``slots``, never negative. ``shared_bytes``
    of each session's bytes are the same pages for every session (a shared prefix's): N ≥ 1
    sessions need ``shared + N·(per_session − shared)``, so ``⌊(pool − fixed − shared)/
    (per_session − shared)⌋`` fit."""
    if per_session_bytes < 1:
        raise ValueError("per_session_bytes must be >= 1")
    if not 0 <= shared_bytes < per_session_bytes:
        raise ValueError(
            f"shared_bytes must be >= 0 and below per_session_bytes {per_session_bytes}, "
            f"got {shared_bytes}: every session holds bytes of its own"
        )
    own = per_session_bytes - shared_bytes
    n = max((pool_bytes - fixed_bytes - shared_bytes) // own, 0)
    return n if slots is None else min(n, slots)


def pool_range(sessions: int, per_session_bytes: int, fixed_bytes: int = 0) -> tuple[int, int]:
    """The pools ``[lo, hi)`` for which :func:`sessions_that_fit` gives exactly ``sessions``."""
    return (
        fixed_bytes + sessions * per_session_bytes,
        fixed_bytes + (sessions + 1) * per_session_bytes,
    )


def sessions_per_gpu(
    profile: Profile,
    context_tokens: int,
    mode: Mode,
    pool_bytes: int,
    *,
    drafter: DrafterProfile | None = None,
    fixed_bytes: int = 0,
    slots: int | None = None,
    shared_bytes: int = 0,
) -> int:
    """Sessions of ``context_tokens`` tokens one GPU admits from ``pool_bytes``, after
    ``fixed_bytes`` and the drafter's own fixed allocations. With ``slots`` (N) the staging of
    eq. 11 is reserved for N slots up front and sessions are capped at N; without, staging is
    reserved for the sessions that fit (each pays its share). ``shared_bytes``: a prefix
    common to the sessions, held once (``shared_prefix_bytes``)."""
    sb = session_bytes(profile, context_tokens, mode, drafter)
    fixed = fixed_bytes + (drafter.fixed_bytes if drafter is not None else 0)
    if slots is None:
        return sessions_that_fit(pool_bytes, sb.total, fixed, shared_bytes=shared_bytes)
    reserved = slots * sb.staging  # M_stage(N): the per-session share is eq. 11 with N = 1
    return sessions_that_fit(
        pool_bytes, sb.without_staging, fixed + reserved, slots, shared_bytes=shared_bytes
    )


def host_bytes(profile: Profile, context_tokens: int, sessions: int = 1) -> int:
    """Host memory the backups of ``sessions`` sessions need: every committed row of every
    sparse source, paged like the GPU history."""
    per = sum(
        s.count * _history_bytes(s, context_tokens, profile.page_size)
        for s in profile.sources
        if s.kind == "sparse"
    )
    return sessions * per


def prefix_unshared(profile: Profile, mode: Mode) -> str | None:
    """Why sessions of ``mode`` share no GPU page of a common prefix, or None: the worker's
    rules. Resident mode shares device pages only when every source stores one row per token
    (``serving.device_prefix.unshareable``); the hierarchy shares index keys only when every
    index producer's source does (``serving.key_records.keys_unshareable``). A profile does not
    say which source a producer indexes, so a windowed source of the producers' compression
    counts as one of theirs."""
    if mode == "resident":
        if any(s.compress != 1 or s.window > 0 for s in profile.sources):
            return "rows that are not one per token (compressed or windowed sources)"
        return None
    indexed = {g.compress for g in profile.indexers}
    windowed = any(
        s.window > 0 and s.kind != "window" and s.compress in indexed for s in profile.sources
    )
    if windowed or indexed - {1}:
        return "index keys of compressed or windowed sources"
    return None


def shared_prefix_bytes(profile: Profile, prefix_tokens: int, mode: Mode) -> int:
    """GPU bytes of a ``prefix_tokens``-token prefix that every session sharing it on one GPU
    counts once: the pages the worker shares (0 where ``prefix_unshared``). A cached prefix
    is named by whole pages of p tokens and shared in whole pages of its rows, so the
    incomplete page at its end is each session's own. Resident mode shares the complete pages
    of every stored history and of the index keys (pages of ``key_page_rows``); the hierarchy
    shares the index keys' alone: hot caches, tails and dense sources' histories are each
    session's (``serving.key_records`` keeps key pages only). Local-window buffers, the page
    map, draft ring and staging are never shared. Never more than the same parts of
    ``session_bytes`` at a context of ``prefix_tokens`` or more. A source written a token late
    (the MTP layer's) shares a page less of rows and keys in the worker, which copies the page
    its next row goes to; a profile does not mark it, so it is counted as the others."""
    if prefix_tokens < 0:
        raise ValueError(f"prefix_tokens must be >= 0, got {prefix_tokens}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if prefix_unshared(profile, mode) is not None:
        return 0
    p = profile.page_size
    tokens = complete_page_tokens(prefix_tokens, 1, p)  # the cached prefix's pages
    rows = 0
    if mode == "resident":  # the hierarchy keeps no record of rows on the device
        rows = sum(
            s.count * _history_bytes(s, complete_page_tokens(tokens, s.compress, p), p)
            for s in profile.sources
            if _history_on_gpu(s, mode)
        )
    key_page = profile.key_page_rows or p
    keys = sum(
        g.count * _key_bytes(g, complete_page_tokens(tokens, g.compress, key_page), key_page)
        for g in profile.indexers
    )
    return rows + keys


def shared_prefix_host_bytes(profile: Profile, prefix_tokens: int) -> int:
    """Host bytes of the one copy of a cached ``prefix_tokens``-token prefix in the node's
    store: the sparse sources' rows of its whole pages of tokens, counted as ``host_bytes``
    counts a backup's. Each session that imports it still copies these rows into its own
    backup (``serving.prefix_reuse``): the copy in the store is in addition to theirs."""
    if prefix_tokens < 0:
        raise ValueError(f"prefix_tokens must be >= 0, got {prefix_tokens}")
    tokens = complete_page_tokens(prefix_tokens, 1, profile.page_size)
    return host_bytes(profile, tokens)


def host_sessions(profile: Profile, context_tokens: int, host_capacity: int) -> int:
    """Sessions whose backups fit in ``host_capacity`` bytes of host memory."""
    per = host_bytes(profile, context_tokens)
    return host_capacity // per if per else 0


def sessions_kept_share(n_spec: int, n_base: int, load: int | None = None) -> float:
    """``N_spec/N_base``: the share of sessions speculation keeps; at a load of ``load``
    concurrent sessions each configuration runs ``min(load, N)``."""
    if load is not None:
        n_spec, n_base = min(load, n_spec), min(load, n_base)
    if n_base < 1:
        raise ValueError("the baseline admits no session")
    return n_spec / n_base


def speculation_pays(n_spec: int, n_base: int, tpot_ratio: float, load: int | None = None) -> bool:
    """Eq. 13: speculation pays while ``N_spec/N_base > TPOT_spec/TPOT_base``."""
    return sessions_kept_share(n_spec, n_base, load) > tpot_ratio


def _history_on_gpu(src: SourceGroup, mode: Mode) -> bool:
    """Whether ``mode`` keeps ``src``'s whole history on the GPU."""
    return src.kind == "dense" or (mode == "resident" and src.kind == "sparse")


def _history_bytes(src: SourceGroup, tokens: int, page_size: int) -> int:
    return page_rows(source_rows(tokens, src.compress), page_size) * src.row_bytes


def _key_bytes(group: IndexGroup, tokens: int, key_page: int) -> int:
    """One producer's index keys of ``tokens`` tokens, in pages of ``key_page`` keys."""
    return page_rows(source_rows(tokens, group.compress), key_page) * group.key_bytes
