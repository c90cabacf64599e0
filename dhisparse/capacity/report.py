"""Rendering a :class:`~dhisparse.capacity.plan.Plan` as a text table or JSON.

GPU figures are in GiB (2^30 B), host figures in GB/TB (10^9/10^12 B), as the paper prints
them. JSON carries exact bytes."""

from __future__ import annotations

import json
from collections.abc import Callable

from dhisparse.capacity.layout_report import layout_rows
from dhisparse.capacity.model import ring_rows
from dhisparse.capacity.model_size import ModelSize
from dhisparse.capacity.plan import Plan
from dhisparse.capacity.profile import DrafterProfile, Profile
from dhisparse.capacity.shared_prefix import PrefixHost, SharedPrefix
from dhisparse.capacity.units import binary, binary_unit, decimal

_W = 40  # label column
_C = 13  # value columns


def render_json(plan: Plan) -> str:
    return json.dumps(plan.as_dict(), indent=2)


def render_table(plan: Plan) -> str:
    lines = _header(plan)
    if plan.model is not None:
        lines += ["", *_model_rows(plan.model)]
    lines += ["", *_session_rows(plan)]
    if plan.slots is not None:
        lines += ["", *_slot_rows(plan)]
    if plan.shared_prefix is not None:
        lines += ["", *_prefix_rows(plan)]
    if plan.layouts:
        lines += ["", *layout_rows(plan)]
        return "\n".join(lines) + "\n"
    if plan.admissions:
        lines += ["", *_admission_rows(plan)]
    lines += ["", *_host_rows(plan)]
    if plan.speculation is not None:
        lines += ["", *_speculation_rows(plan)]
    return "\n".join(lines) + "\n"


def _header(plan: Plan) -> list[str]:
    p = plan.profile
    drafter = f", drafter {plan.drafter.name}" if plan.drafter else ""
    lines = [
        f"dhisparse plan: {p.name} at {plan.context_tokens:,} tokens{drafter}",
        f"  {p.description}" if p.description else "",
        *(f"  KV sources   {_source(p, i)}" for i in range(len(p.sources))),
        *(
            f"  index keys   {g.count} producers × {g.key_bytes} B/row (m={g.compress})"
            for g in p.indexers
        ),
        f"  k={p.top_k}  B={p.hot_cache_rows}  tail={_pages(p.tail_pages)}  "
        f"p={p.page_size}  χ={p.chi}",
    ]
    if plan.drafter:
        d = plan.drafter
        fixed = f", fixed {binary(d.fixed_bytes)}/GPU" if d.fixed_bytes else ""
        lines.append(
            f"  drafter      {d.name}: W={d.window}, K_max={d.k_max}, "
            f"{d.row_bytes:,} B/row draft K/V{fixed} (besides ring and staging)"
        )
    if p.estimated:
        lines.append(f"  estimates    {'; '.join(p.estimated)}")
    return [line for line in lines if line]


def _model_rows(m: ModelSize) -> list[str]:
    p = m.parameters
    parts = (
        ("routed experts", p.routed_experts),
        ("shared experts", p.shared_experts),
        ("attention", p.attention),
        ("indexer", p.indexer),
        ("dense MLP", p.dense_mlp),
        ("router", p.router),
        ("embed", p.embed),
        ("lm_head", p.lm_head),
        ("norms", p.norms),
    )
    out = [
        f"model {m.name} ({m.family}): {m.layers} layers, {m.index_producers} index producers",
        f"  parameters   {_count(p.total)} ({p.total:,}; MTP layers not counted)",
        *_packed([f"{label} {_count(n)}" for label, n in parts if n], "    "),
        f"    + router bias {p.router_bias:,} (buffers; {p.with_router_bias:,} with them)",
    ]
    with_mtp = " (with the MTP layer's)" if m.mtp else ""
    for t in m.kv_per_token:
        out.append(
            f"  KV/token {t.format:<4}{t.total:>9,} B = {t.rows:,} B rows + "
            f"{t.index_keys:,} B index keys{with_mtp}"
        )
    return out


def _packed(items: list[str], indent: str) -> list[str]:
    """``items`` joined by commas into lines of the table's width, no item split."""
    lines = [indent]
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if lines[-1] != indent and len(lines[-1]) + 1 + len(piece) > _W + 3 * _C:
            lines.append(indent)
        lines[-1] += piece if lines[-1] == indent else " " + piece
    return lines


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def _source(p: Profile, i: int) -> str:
    s = p.sources[i]
    window = f", window {s.window}" if s.window else ""
    return f"{s.count} × {s.kind} {s.row_bytes} B/row (m={s.compress}{window})"


def _session_rows(plan: Plan) -> list[str]:
    resident, hierarchy = plan.base
    unit = binary_unit(resident.total)
    row = _row_in(unit)
    title = f"per-session GPU memory ({unit[0]})"
    out = [f"{title:<{_W}}{'resident':>{_C}}{'hierarchy':>{_C}}"]
    labels = (
        ("history", "history on GPU"),
        ("hot_cache", f"hot cache (B={plan.profile.hot_cache_rows} rows/source)"),
        ("tail", f"tail ({_pages(plan.profile.tail_pages)}/source)"),
        ("window", "local window"),
        ("index_keys", "index keys"),
        ("metadata", "metadata (page map)"),
    )
    for field, label in labels:
        if getattr(resident, field) or getattr(hierarchy, field):
            out.append(row(label, getattr(resident, field), getattr(hierarchy, field)))
    out.append(row("total", resident.total, hierarchy.total) + f"   ratio {plan.ratio():.1f}×")
    d = plan.drafter
    if plan.spec and d is not None:
        r, h = plan.spec
        rd = ring_rows(d.window, d.k_max, plan.profile.page_size)
        ring = f"+ draft ring (R_d={rd} rows)" if d.row_bytes else "+ draft ring (none: a source)"
        out.append(row(ring, r.draft_ring, h.draft_ring))
        out.append(row("+ staging share (χ·K_max·k·d_kv)", r.staging, h.staging))
        if r.window != resident.window or h.window != hierarchy.window:
            # local windows also cover the verified block
            grow = (r.window - resident.window, h.window - hierarchy.window)
            out.append(row("+ window for the block", *grow))
        out.append(
            row(f"total with {d.name}", r.total, h.total) + f"   ratio {plan.ratio(True):.1f}×"
        )
    return out


def _slot_rows(plan: Plan) -> list[str]:
    s = plan.slots
    assert s is not None and plan.drafter is not None
    chi, n_src = plan.profile.chi, plan.profile.payload_sources
    name, size = binary_unit(max(s.staging_bytes_per_source, s.fixed_bytes, s.ring_bytes))

    def line(label: str, nbytes: int, note: str = "") -> str:
        return f"  {label:<{_W - 2}}{nbytes / size:>{_C}.3f} {name}{note}"

    return [
        f"per GPU with {plan.drafter.name} (N = {s.slots} slots)",
        line(
            "draft ring N·R_d rows",
            s.ring_bytes,
            f"   φ(i,t) = i·{s.ring_rows} + (t mod {s.ring_rows})",
        ),
        line(f"staging, χ={chi} arenas", s.staging_bytes),
        line(
            f"staging, one arena per source ({n_src})",
            s.staging_bytes_per_source,
            f"   ÷{s.staging_reduction:.1f}",
        ),
        line("ring + staging per session", s.added_per_session),
        line("fixed: drafter + staging", s.fixed_bytes),
    ]


def _admission_rows(plan: Plan) -> list[str]:
    dep = plan.deployment
    assert dep.pool_bytes is not None
    gpus = f" × {dep.gpus} GPUs" if dep.gpus > 1 else ""
    out = [f"sessions (pool {binary(dep.pool_bytes)}/GPU{gpus}; per GPU (total))"]
    if dep.note:
        out.append(f"  {dep.note}")
    out.append(f"{'':<{_W}}{'resident':>{_C}}{'hierarchy':>{_C}}")
    for with_drafter in (False, True) if plan.drafter else (False,):
        cells = []
        for mode in ("resident", "hierarchy"):
            a = plan.admitted(mode, with_drafter)
            cells.append(f"{a.per_gpu} ({a.total})" if a else "-")
        label = plan.drafter.name if with_drafter and plan.drafter else "no drafter"
        out.append(f"  {label:<{_W - 2}}{cells[0]:>{_C}}{cells[1]:>{_C}}")
    if plan.shared_prefix is not None:
        out += _shared_admission_rows(plan.shared_prefix, plan.drafter)
    return out


def _shared_admission_rows(shared: SharedPrefix, drafter: DrafterProfile | None) -> list[str]:
    out = []
    for name in (None, drafter.name) if drafter else (None,):
        cells = []
        for mode in ("resident", "hierarchy"):
            a = shared.admitted(mode, name)
            cells.append(f"{a.per_gpu} ({a.total})" if a and a.per_gpu is not None else "-")
        label = f"{name or 'no drafter'}, prefix shared"
        out.append(f"  {label:<{_W - 2}}{cells[0]:>{_C}}{cells[1]:>{_C}}")
    return out


def _host_rows(plan: Plan) -> list[str]:
    h = plan.host
    out = [
        "host backups (sparse-source rows; index keys stay on the GPU)",
        f"  {'per session':<{_W - 2}}{decimal(h.per_session):>{_C + 3}}",
    ]
    if h.sessions and h.bytes is not None:
        out.append(f"  {f'{h.sessions} sessions':<{_W - 2}}{decimal(h.bytes):>{_C + 3}}")
    if h.capacity is not None and h.holds is not None:
        label = f"a {decimal(h.capacity, digits=3, strip=True)} host holds"
        out.append(f"  {label:<{_W - 2}}{h.holds:>{_C}} sessions")
    if plan.shared_prefix is not None:
        out += _prefix_host_rows(plan.shared_prefix.host, h.capacity)
    return out


def _prefix_rows(plan: Plan) -> list[str]:
    """The shared prefix's bytes held once per GPU and each session's own, by mode."""
    shared = plan.shared_prefix
    assert shared is not None
    p = plan.profile.page_size
    unit = binary_unit(plan.base[0].total)
    row = _row_in(unit)
    title = f"per GPU ({unit[0]})"
    out = [
        f"shared prefix: the first {shared.tokens:,} tokens of every session, "
        f"{shared.tokens // p:,} complete pages of {p}",
        f"{title:<{_W}}{'resident':>{_C}}{'hierarchy':>{_C}}",
        row("the prefix, held once", *(s.bytes for s in shared.shares)),
    ]
    for d in (None, plan.drafter) if plan.drafter else (None,):
        name = d.name if d else None
        own = [shared.admitted(m, name) for m in ("resident", "hierarchy")]
        label = f"each session besides, with {name}" if name else "each session besides"
        out.append(row(label, *(a.own_bytes if a else 0 for a in own)))
    out += [f"  {s.mode} shares nothing: {s.unshared}" for s in shared.shares if s.unshared]
    return out


def _prefix_host_rows(host: PrefixHost, capacity: int | None) -> list[str]:
    out = [
        f"  {'the cached prefix (once, in the store)':<{_W - 2}}{decimal(host.record):>{_C + 3}}"
    ]
    if host.sessions and host.bytes is not None:
        label = f"{host.sessions} sessions and the cached prefix"
        out.append(f"  {label:<{_W - 2}}{decimal(host.bytes):>{_C + 3}}")
    if capacity is not None and host.holds is not None:
        label = f"a {decimal(capacity, digits=3, strip=True)} host holds beside it"
        out.append(f"  {label:<{_W - 2}}{host.holds:>{_C}} sessions")
    return out


def _speculation_rows(plan: Plan) -> list[str]:
    s = plan.speculation
    assert s is not None
    n_spec, n_base, load = s.n_spec, s.n_base, ""
    if s.load is not None:
        n_spec, n_base, load = min(s.load, n_spec), min(s.load, n_base), f" at load {s.load}"
    out = [
        "speculation pays (eq. 13) while N_spec/N_base > TPOT_spec/TPOT_base",
        f"  share kept{load}: {n_spec}/{n_base} = {s.share:.2f}",
    ]
    if s.tpot_ratio is not None:
        verdict = "pays" if s.pays else "does not pay"
        out.append(f"  TPOT ratio {s.tpot_ratio:.2f}: speculation {verdict}")
    return out


def _pages(n: int) -> str:
    return f"{n} page" if n == 1 else f"{n} pages"


def _row_in(unit: tuple[str, int]) -> Callable[[str, int, int], str]:
    def row(label: str, resident: int, hierarchy: int) -> str:
        cells = (f"{b / unit[1]:.3f}" if b else "-" for b in (resident, hierarchy))
        return f"  {label:<{_W - 2}}" + "".join(f"{c:>{_C}}" for c in cells)

    return row
