"""A package's files in import order: a module comes after the modules of the package it
imports, so a reader meets a definition before its use.

Imports are read with ``ast`` anywhere in a file (module level, under ``TYPE_CHECKING``,
inside functions): ``import a.b``, ``from a.b import c`` (``a.b.c`` when that is a module of
the package, else ``a.b``) and relative imports, resolved against the importing file's
package. A name that is no module of the package resolves to its longest prefix that is (a
package's ``__init__.py``), or to nothing. A file that does not parse imports nothing and so
keeps its place in path order.

Cycles (strongly connected groups) are placed as one unit after everything they import; inside
one, a module still follows the members it imports where it can, and a cycle is broken at its
first member in path order, ``__init__.py`` files last: a package finishes importing after
the submodules it imports. Otherwise ties go in path order.
"""

from __future__ import annotations

import ast
import heapq
import warnings
from collections.abc import Iterable, Mapping

INIT = "__init__.py"


def module_name(path: str) -> str:
    """``a/b/c.py`` -> ``a.b.c``; ``a/b/__init__.py`` -> ``a.b``."""
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_init(path: str) -> bool:
    return path == INIT or path.endswith("/" + INIT)


def _package(path: str) -> list[str]:
    """The dotted parts of the package a file's relative imports start from."""
    name = module_name(path)
    parts = name.split(".") if name else []
    return parts if is_init(path) else parts[:-1]


def _parse(text: str, path: str) -> ast.Module | None:
    """The file's tree, or None when it does not parse (syntax errors, and nesting too deep
    for the parser's recursion)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escapes and the like: not our business
        try:
            return ast.parse(text, path)
        except (SyntaxError, RecursionError):
            return None


def imported_names(path: str, text: str) -> frozenset[str]:
    """The absolute dotted names the file at ``path`` (root-relative, POSIX) imports, relative
    imports resolved; ``from a import b`` gives ``a.b``. A relative import that climbs past
    the top package is ignored, as is every import of a file that does not parse."""
    tree = _parse(text, path)
    if tree is None:
        return frozenset()
    package = _package(path)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module.split(".") if node.module else []
            if node.level:
                up = node.level - 1
                if up >= len(package):  # beyond the top package: Python refuses it too
                    continue
                base = package[: len(package) - up] + base
            prefix = ".".join(base)
            for alias in node.names:
                if alias.name == "*":
                    out.add(prefix)
                else:
                    out.add(f"{prefix}.{alias.name}" if prefix else alias.name)
    out.discard("")
    return frozenset(out)


def _resolve(name: str, by_name: Mapping[str, str]) -> str | None:
    """The path of ``name``'s longest prefix that is a module of the package."""
    while name:
        if name in by_name:
            return by_name[name]
        name = name.rpartition(".")[0]
    return None


def _components(paths: list[str], deps: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan's, iterative), each sorted by path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def enter(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)

    for start in paths:
        if start in index:
            continue
        enter(start)
        work = [(start, iter(sorted(deps[start])))]
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    enter(w)
                    work.append((w, iter(sorted(deps[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    u = work[-1][0]
                    low[u] = min(low[u], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return out


def _order_cycle(members: list[str], deps: Mapping[str, set[str]]) -> list[str]:
    """One strongly connected group in order: ready members in path order; when none is
    ready, the first by (``__init__.py`` last, path) goes next."""
    inside = set(members)
    waiting = {m: deps[m] & inside for m in members}
    done: list[str] = []
    while waiting:
        ready = sorted(m for m, d in waiting.items() if not d)
        nxt = ready[0] if ready else min(waiting, key=lambda m: (is_init(m), m))
        done.append(nxt)
        del waiting[nxt]
        for d in waiting.values():
            d.discard(nxt)
    return done


def order_by_imports(imports: Mapping[str, Iterable[str]]) -> list[str]:
    """The paths of ``imports`` (path -> the names it imports, as ``imported_names`` gives
    them) in import order."""
    paths = sorted(imports)
    by_name: dict[str, str] = {}
    for p in paths:  # a package directory shadows a module of the same name, as in Python
        name = module_name(p)
        if name not in by_name or is_init(p):
            by_name[name] = p
    deps: dict[str, set[str]] = {p: set() for p in paths}
    for p in paths:
        for name in imports[p]:
            target = _resolve(name, by_name)
            if target is not None and target != p:
                deps[p].add(target)
    comps = _components(paths, deps)
    comp_of = {p: i for i, comp in enumerate(comps) for p in comp}
    needs = [{comp_of[d] for p in comp for d in deps[p]} - {i} for i, comp in enumerate(comps)]
    users: list[list[int]] = [[] for _ in comps]
    for i, needed in enumerate(needs):
        for j in needed:
            users[j].append(i)
    pending = [len(n) for n in needs]
    heap = [(comps[i][0], i) for i in range(len(comps)) if pending[i] == 0]
    heapq.heapify(heap)
    out: list[str] = []
    while heap:
        _, i = heapq.heappop(heap)
        out.extend(_order_cycle(comps[i], deps))
        for j in users[i]:
            pending[j] -= 1
            if pending[j] == 0:
                heapq.heappush(heap, (comps[j][0], j))
    return out


def import_order(sources: Mapping[str, str]) -> list[str]:
    """The paths of ``sources`` (root-relative POSIX path -> source text, one package) in
    import order."""
    return order_by_imports({p: imported_names(p, t) for p, t in sources.items()})
