"""The floors of the house: one declared bottom-to-top order of the packages of ``dhisparse/``
and ``services/``, with every import pointing down or along its own floor — module-level,
function-local and ``TYPE_CHECKING`` imports alike. A lower package that needs a higher one's
behaviour takes it as an argument, or as a Protocol it defines.

The worker's floors, bottom to top: small host-device copies; requests and sampling; kernels (FP8 numerics included);
the parallel collectives a module runs; the KV contract; the hierarchy's parts; adaptive
residency; the serving modes; the model; weights; checking a checkpoint; durable sessions;
graph capture; speculation; the rank group; the engine; the front (async engine, gRPC server,
settings, metrics, group launcher, CLIs)."""

from __future__ import annotations

from pathlib import Path

from tests.house.test_structure import ROOT, imported, module_name

# Bottom to top. A module belongs to the floor of the longest prefix that names it; a tuple is
# one floor of several packages that may import each other.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("dhisparse.paths", "dhisparse.flags", "dhisparse.devices", "dhisparse.metrics",
     "dhisparse.metrics_server", "dhisparse.rpc", "dhisparse.tokenizer"),
    ("dhisparse.family",),
    ("dhisparse.capacity",),
    ("services.kv_host_store",),
    ("services.worker.transfers",),
    ("services.worker.request",),
    ("services.worker.ops",),
    ("services.worker.parallel",),
    ("services.worker.kv",),
    ("services.worker.hierarchy",),
    ("services.worker.residency",),
    ("services.worker.serving",),
    ("services.worker.model",),
    ("services.worker.weights",),
    ("services.worker.verify",),
    ("services.worker.durable",),
    ("services.worker.graphs",),
    ("services.worker.speculative",),
    ("services.worker.rank_group",),
    ("services.worker.engine",),
    ("services.worker",),  # the front: the package's own top-level modules
    ("services.gateway",),
    ("dhisparse.up", "dhisparse.cli", "dhisparse", "services"),
)  # fmt: skip

# Packages that run without the worker: they import none of its modules.
WORKER_FREE = (
    "dhisparse.capacity",
    "dhisparse.family",
    "services.gateway",
    "services.kv_host_store",
)


def floor_of(module: str) -> tuple[int, str]:
    """(floor index, the prefix that placed it) of a module of the house."""
    best: tuple[int, str] | None = None
    for i, names in enumerate(FLOORS):
        for prefix in names:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > len(best[1])
            ):
                best = (i, prefix)
    assert best is not None, f"{module} is on no floor: add its package to FLOORS"
    return best


def house() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for top in ("dhisparse", "services"):
        out |= {module_name(p): p for p in (ROOT / top).rglob("*.py")}
    return out


def edges() -> list[tuple[str, str]]:
    known = house()
    return [(m, t) for m, p in sorted(known.items()) for t in sorted(imported(p, m, known))]


def upward(pairs: list[tuple[str, str]]) -> list[str]:
    out = []
    for m, t in pairs:
        (fm, pm), (ft, pt) = floor_of(m), floor_of(t)
        if ft > fm:
            out.append(f"{m} ({pm}) imports {t} ({pt}), a floor above it")
    return out


def test_every_module_is_on_a_floor_and_the_walk_sees_the_imports() -> None:
    pairs = edges()
    assert len(pairs) > 300
    for m in house():
        floor_of(m)


def test_the_floor_check_catches_an_upward_import() -> None:
    assert upward([("services.worker.kv.batch", "services.worker.engine.engine")])
    assert not upward([("services.worker.engine.engine", "services.worker.kv.batch")])
    assert not upward([("services.worker.kv.batch", "services.worker.kv.paged")])


def test_no_import_runs_up_the_floors() -> None:
    found = upward(edges())
    assert not found, "imports that run up the floors:\n" + "\n".join(found)


def test_the_capacity_model_gateway_and_store_import_no_worker_module() -> None:
    found = [
        f"{m} imports {t}"
        for m, t in edges()
        if m.startswith(WORKER_FREE) and t.startswith("services.worker")
    ]
    assert not found, "\n".join(found)
