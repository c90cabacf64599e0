"""The layouts table of ``dhisparse plan``: one column per layout of a worker over N GPUs, with
each rank's weights by part (replicated or split), the KV pool left per GPU, the sessions a
worker and a node hold, and the host memory their backups need."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dhisparse.capacity.layouts import LayoutAdmission, LayoutPlan
from dhisparse.capacity.model import MODES
from dhisparse.capacity.plan import Plan
from dhisparse.capacity.shared_prefix import PrefixAdmission
from dhisparse.capacity.units import binary, binary_unit, decimal

_W = 34  # label column
_C = 17  # one column per layout

PART_LABELS = {
    "mla_latent": "MLA latent (q_a, kv_a, norms)",
    "mla_heads": "MLA heads (q_b, kv_b, o)",
    "indexer": "indexer",
    "dense_mlp": "dense MLPs",
    "shared_experts": "shared experts",
    "routed_experts": "routed experts",
    "router": "routers",
    "norms": "layer norms",
    "vocab": "embeddings and lm_head",
    "mtp": "MTP layer",
}


def layout_rows(plan: Plan) -> list[str]:
    """The table of ``plan.layouts`` (a plan of workers that span GPUs), with the layouts the
    model cannot be split by and why."""
    layouts = plan.layouts
    first = layouts[0]
    n, gpus, workers = first.parallel.world_size, first.gpus, first.workers
    out = [
        f"workers of {_plural(n, 'GPU')}, {_plural(gpus, 'GPU')} per node "
        f"({_plural(workers, 'worker')})",
        " " * _W + _cells([lp.name for lp in layouts]),
    ]
    if first.weights is not None:
        out += ["", *_weight_rows(plan)]
    else:
        out += ["", f"weights per GPU: not known for {plan.profile.name} (--model DIR sizes them)"]
    if first.pool_bytes is not None or first.hbm_bytes is not None:
        out += ["", *_pool_rows(layouts)]
    if first.shared_prefix is not None:
        out += ["", *_prefix_rows(layouts)]
    if any(lp.admissions for lp in layouts):
        out += ["", *_session_rows(plan)]
        out += ["", *_host_rows(layouts)]
    if any(lp.speculation is not None for lp in layouts):
        out += ["", *_speculation_rows(layouts)]
    if plan.refused:
        out += ["", f"not possible over {n} GPUs (as the worker refuses them at start-up):"]
        out += [f"  {r.layout}: {r.reason}" for r in plan.refused]
    return [line.rstrip() for line in out]


def _weight_rows(plan: Plan) -> list[str]:
    ranks = [lp.weights for lp in plan.layouts if lp.weights is not None]
    name, size = binary_unit(max(w.total for w in ranks))
    out = [
        f"weights per GPU ({name}; r: replicated on every rank, s: split over the ranks)",
        f"  {plan.weight_format}; the whole model {binary(ranks[0].whole)}",
    ]
    for part, label in PART_LABELS.items():
        cells = []
        for w in ranks:
            p = w.part(part)
            if p is None:
                cells.append("-")
                continue
            mark = "r+s" if p.replicated and p.split else ("s" if p.split else "r")
            cells.append(f"{p.total / size:.3f} {mark:<3}")
        if any(c != "-" for c in cells):
            out.append(f"  {label:<{_W - 2}}" + _cells(cells))
    for label, values in (
        ("total", [w.total for w in ranks]),
        ("  of which replicated", [w.replicated for w in ranks]),
    ):
        out.append(f"  {label:<{_W - 2}}" + _cells([f"{v / size:.3f}    " for v in values]))
    return out


def _pool_rows(layouts: Sequence[LayoutPlan]) -> list[str]:
    first = layouts[0]
    if first.hbm_bytes is None:
        title = "KV pool per GPU (as given)"
    else:
        reserve = f" − reserve {binary(first.reserve_bytes)}" if first.reserve_bytes else ""
        title = f"KV pool per GPU: HBM {binary(first.hbm_bytes)} − weights{reserve}"
    pools = [lp.pool_bytes or 0 for lp in layouts]
    # what is left per GPU: negative where the weights and the reserve do not fit
    left = [lp.spare_bytes if lp.hbm_bytes is not None else lp.pool_bytes or 0 for lp in layouts]
    name, size = binary_unit(max(*(abs(v) for v in left), 1))
    return [
        title,
        f"  {'pool':<{_W - 2}}" + _cells([f"{v / size:.3f} {name}" for v in left]),
        f"  {'the worker: --kv-pool-mib':<{_W - 2}}"
        + _cells([f"{p >> 20:,}" if p else "-" for p in pools]),
    ]


def _session_rows(plan: Plan) -> list[str]:
    layouts = plan.layouts
    multi = layouts[0].workers > 1
    out = [f"sessions of {plan.context_tokens:,} tokens per worker (data-parallel: per GPU)"]
    out += _admission_cells(plan, lambda lp, a: _per_worker(lp, a.per_worker, a.per_gpu))
    out += _shared_cells(plan, _shared_per_worker)
    if multi:
        out += ["", f"sessions per node ({layouts[0].workers} workers)"]
        out += _admission_cells(plan, lambda lp, a: str(a.per_node))
        out += _shared_cells(plan, lambda lp, a: str(a.total))
    return out


def _prefix_rows(layouts: Sequence[LayoutPlan]) -> list[str]:
    """The shared prefix's bytes each GPU holds once, by mode, and why a layout shares none."""
    shared = [lp.shared_prefix for lp in layouts if lp.shared_prefix is not None]
    name, size = binary_unit(max(max(s.bytes for s in p.shares) for p in shared) or 1)
    out = [
        f"shared prefix: the first {shared[0].tokens:,} tokens of every session, held once "
        f"per GPU ({name})"
    ]
    for mode in MODES:
        cells = [p.share(mode).bytes for p in shared]
        out.append(f"  {mode:<{_W - 2}}" + _cells([f"{b / size:.3f}" if b else "-" for b in cells]))
    for mode in MODES:
        unshared: dict[str, list[str]] = {}  # why -> the layouts that share nothing so
        for lp, p in zip(layouts, shared, strict=True):
            why = p.share(mode).unshared
            if why is not None:
                unshared.setdefault(why, []).append(lp.name)
        out += [f"  {mode} shares nothing under {', '.join(n)}: {w}" for w, n in unshared.items()]
    return out


def _shared_cells(plan: Plan, cell: Callable[[LayoutPlan, PrefixAdmission], str]) -> list[str]:
    """``_admission_cells`` of the sessions sharing the prefix (none without one)."""
    if plan.layouts[0].shared_prefix is None:
        return []
    out = []
    for d in (None, plan.drafter.name) if plan.drafter else (None,):
        for mode in MODES:
            cells = []
            for lp in plan.layouts:
                a = lp.shared_prefix.admitted(mode, d) if lp.shared_prefix else None
                cells.append("-" if a is None or a.per_gpu is None else cell(lp, a))
            label = f"{mode}{f' + {d}' if d else ''}, shared"
            out.append(f"  {label:<{_W - 2}}" + _cells(cells))
    return out


def _admission_cells(plan: Plan, cell: Callable[[LayoutPlan, LayoutAdmission], str]) -> list[str]:
    out = []
    drafters = (None, plan.drafter.name) if plan.drafter else (None,)
    for d in drafters:
        for mode in MODES:
            cells = []
            for lp in plan.layouts:
                a = lp.admitted(mode, d)
                cells.append("-" if a is None else cell(lp, a))
            label = mode if d is None else f"{mode} + {d}"
            out.append(f"  {label:<{_W - 2}}" + _cells(cells))
    return out


def _shared_per_worker(lp: LayoutPlan, a: PrefixAdmission) -> str:
    assert a.per_gpu is not None
    return _per_worker(lp, a.per_gpu * lp.parallel.serving_ranks, a.per_gpu)


def _per_worker(lp: LayoutPlan, per_worker: int, per_gpu: int) -> str:
    return f"{per_worker} ({per_gpu}/GPU)" if lp.parallel.serving_ranks > 1 else str(per_worker)


def _host_rows(layouts: Sequence[LayoutPlan]) -> list[str]:
    first = layouts[0].host
    out = [
        "host backups per node (the hierarchy's sessions; index keys stay on the GPU)",
        f"  {'per session':<{_W - 2}}" + _cells([decimal(first.per_session)] * len(layouts)),
        f"  {'the node':<{_W - 2}}"
        + _cells([decimal(lp.host.bytes) if lp.host.bytes else "-" for lp in layouts]),
    ]
    if first.capacity is not None:
        label = f"a {decimal(first.capacity, digits=3, strip=True)} host holds"
        out.append(f"  {label:<{_W - 2}}" + _cells([str(lp.host.holds) for lp in layouts]))
    shared = [lp.shared_prefix.host for lp in layouts if lp.shared_prefix is not None]
    if shared:
        out += [
            f"  {'the cached prefix, once':<{_W - 2}}"
            + _cells([decimal(shared[0].record)] * len(shared)),
            f"  {'the node and the cached prefix':<{_W - 2}}"
            + _cells([decimal(h.bytes) if h.bytes else "-" for h in shared]),
        ]
        if first.capacity is not None:
            label = "holds beside the cached prefix"
            out.append(f"  {label:<{_W - 2}}" + _cells([str(h.holds) for h in shared]))
    return out


def _speculation_rows(layouts: Sequence[LayoutPlan]) -> list[str]:
    cells = []
    for lp in layouts:
        s = lp.speculation
        if s is None:
            cells.append("-")
            continue
        verdict = "" if s.pays is None else (" pays" if s.pays else " no")
        cells.append(f"{s.share:.2f}{verdict}")
    load = layouts[0].speculation.load if layouts[0].speculation else None
    at = f" at load {load}" if load is not None else ""
    return [
        "speculation pays (eq. 13) while N_spec/N_base > TPOT_spec/TPOT_base",
        f"  {'share kept per node' + at:<{_W - 2}}" + _cells(cells),
    ]


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _cells(values: Sequence[str]) -> str:
    return "".join(f"{v:>{_C}}" for v in values)
