"""What a result was measured on: the ``provenance`` object of every result JSON.

The code a result measured is the set of files under the measured roots (``services/``,
``dhisparse/``, ``models/``, ``bench/``) that the benchmark's process used: every module it
had imported when it wrote the result (``sys.modules``), every file it opened for reading
(an audit hook, ``track_reads``), and the weight files beside an opened file (safetensors
opens its shards outside Python's ``open``). The dispatcher (``bench/cli.py``) and the
recording of results (this module, ``output.py``) measure nothing and are left out: adding a
subcommand leaves every result fresh.

Two hashes, for two questions:

- *Did the code a result measured change?* (``python -m bench stale``.) Each measured file is
  recorded by ``measured_hash`` under ``HASH_SCHEME`` (``"code-ast-v1"``, named in the
  provenance as ``hash_scheme``): a ``.py`` file by the SHA-256 of its syntax tree with the
  docstrings of module, classes and functions removed, written out field by field without
  line numbers and without the fields a Python version adds empty (``digest.code_digest``: the
  GPU machine's 3.12 and the CPU's 3.11 give the same hash); any other file (weights, JSON,
  tokenizer files, templates) by its bytes, as git's blob hash. So correcting a docstring or
  a comment, or reformatting, leaves a result fresh; changing code, or moving or renaming a
  file it ran, makes it stale. A ``.py`` file that does not parse is hashed by its bytes.
  Results recorded before the scheme existed carry no ``hash_scheme`` and are compared by
  git blob hashes (``BLOB_SCHEME``), as they were recorded.
- *Is this tree the one that was prepared?* (``prepare`` / ``check_tree``.) A copy of the tree
  must be the same bytes, so these keep git's blob hash of every file (``file_hash``, what
  ``git hash-object`` gives): a tree without ``.git`` computes the same hashes.

``commit`` and ``dirty`` come from git when the tree is a checkout. A tree copied without
``.git`` (the GPU machine's) takes them from ``bench/PROVENANCE.json``, which ``python -m bench
prepare`` writes in the checkout before the copy, with the hash of every file then under the
measured roots. Results are refused when there is neither, or when a file of the tree differs
from what that file recorded."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from bench.core.digest import blob_hash, code_digest

ROOT = Path(__file__).resolve().parents[2]
MEASURED_ROOTS = ("services", "dhisparse", "models", "bench")
PREPARED = "bench/PROVENANCE.json"
NOT_MEASURED = frozenset({
    "bench/__main__.py", "bench/cli.py", "bench/core/provenance.py", "bench/core/digest.py",
    "bench/core/output.py", PREPARED,
})  # fmt: skip
WEIGHT_SUFFIXES = (".safetensors",)
BLOB_SCHEME = "git-blob"  # results recorded before ``hash_scheme`` existed
HASH_SCHEME = "code-ast-v1"


class ProvenanceError(RuntimeError):
    """The code a result measured cannot be named: the result must not be written."""


_HASHES: dict[tuple[Path, str], tuple[int, int, str]] = {}  # (path, scheme) -> (mtime, size, hash)
_OWN = threading.local()  # .reading: this thread reads for provenance, not for the benchmark


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Files opened inside are bookkeeping (finding, hashing), not what a result measured."""
    _OWN.reading = True
    try:
        yield
    finally:
        _OWN.reading = False


def _read(path: Path) -> bytes:
    """A file's bytes, read without counting as something the benchmark read."""
    with unrecorded():
        return path.read_bytes()


def _cached(path: Path, scheme: str, compute) -> str:
    """``compute(bytes)`` of a file, recomputed only when its mtime or size moved."""
    st = path.stat()
    known = _HASHES.get((path, scheme))
    if known is not None and known[:2] == (st.st_mtime_ns, st.st_size):
        return known[2]
    h = compute(_read(path))
    _HASHES[(path, scheme)] = (st.st_mtime_ns, st.st_size, h)
    return h


def file_hash(path: Path) -> str:
    """The blob hash of a file (``git hash-object``): the same bytes, the same hash."""
    return _cached(path, BLOB_SCHEME, blob_hash)


def measured_hash(path: Path, scheme: str = HASH_SCHEME) -> str:
    """The hash ``stale`` compares under ``scheme`` (module docstring): under
    ``HASH_SCHEME`` a ``.py`` file's code (``code_digest``), any other file's bytes; under
    ``BLOB_SCHEME`` every file's bytes. Raises ``ValueError`` for an unknown scheme."""
    if scheme == BLOB_SCHEME or (scheme == HASH_SCHEME and path.suffix != ".py"):
        return file_hash(path)
    if scheme == HASH_SCHEME:
        return _cached(path, scheme, code_digest)
    raise ValueError(f"unknown hash scheme {scheme!r}")


def has_git(root: Path = ROOT) -> bool:
    return (root / ".git").exists()


def _git(root: Path, *args: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
            timeout=60,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        raise ProvenanceError(f"git {' '.join(args)} failed in {root}: {e}") from None


def tree_files(root: Path = ROOT) -> dict[str, str]:
    """Blob hash of every file under the measured roots that git tracks or does not ignore
    (what a copy of the working tree carries), from the files as they are on disk."""
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                  *MEASURED_ROOTS).split("\0")  # fmt: skip
    files = sorted({p for p in listed if p and (root / p).is_file()})
    return {p: file_hash(root / p) for p in files}


def git_state(root: Path = ROOT) -> dict:
    """The checkout's HEAD and whether the measured roots differ from it."""
    commit = _git(root, "rev-parse", "HEAD").strip()
    dirty = bool(_git(root, "status", "--porcelain", "--", *MEASURED_ROOTS).strip())
    return {"commit": commit, "dirty": dirty}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def prepare(root: Path = ROOT) -> dict:
    """Writes ``bench/PROVENANCE.json`` in a checkout: commit, dirty flag and the hash of
    every file under the measured roots, for a copy of the tree that has no ``.git``."""
    if not has_git(root):
        raise ProvenanceError(f"{root} is not a git checkout: prepare runs before the copy")
    doc = {**git_state(root), "date": _now(), "roots": list(MEASURED_ROOTS),
           "files": tree_files(root)}  # fmt: skip
    (root / PREPARED).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def source(root: Path = ROOT) -> dict:
    """Where commit and dirty flag come from: a clean git checkout; else the prepared file, when
    the tree is still the one it recorded, file for file (a copy of the tree made after
    ``prepare``, whatever ``.git`` travelled with it); else git as it is. Without git the
    prepared file's per-file hashes bound what the tree may hold (``check_tree`` refuses a tree
    that differs). Raises ``ProvenanceError`` with neither."""
    state = None
    if has_git(root):
        with contextlib.suppress(ProvenanceError):  # a .git that git cannot read
            state = git_state(root)
    if state is not None and not state["dirty"]:
        return {**state, "source": "git", "recorded": None}
    path = root / PREPARED
    if path.exists():
        doc = json.loads(_read(path))
        if state is None or not _differing(doc["files"], doc["files"], root):
            return {"commit": doc["commit"], "dirty": doc["dirty"], "source": PREPARED,
                    "recorded": doc["files"]}  # fmt: skip
    if state is not None:
        return {**state, "source": "git", "recorded": None}
    raise ProvenanceError(
        f"{root} has no .git and no {PREPARED}, so no result can name the code it "
        f"measured: run `python -m bench prepare` in the checkout before copying the tree "
        f"(and carry {PREPARED} with it)"
    )


def _differing(recorded: dict[str, str], paths: Iterable[str], root: Path) -> list[str]:
    out = []
    for p in paths:
        if p not in recorded:
            out.append(f"{p} (not in {PREPARED})")
        elif not (root / p).is_file():
            out.append(f"{p} (missing)")
        elif file_hash(root / p) != recorded[p]:
            out.append(f"{p} (changed)")
    return out


def _refuse(differing: list[str]) -> ProvenanceError:
    shown = "\n  ".join(differing[:20]) + ("\n  ..." if len(differing) > 20 else "")
    return ProvenanceError(
        f"the tree differs from {PREPARED} (it changed after `python -m bench prepare`); run "
        f"prepare again in the checkout and copy the tree anew:\n  {shown}"
    )


def check_tree(root: Path = ROOT) -> dict:
    """Before a benchmark runs: provenance can be taken, and a tree without git is still the
    one ``prepare`` recorded, file for file. Raises ``ProvenanceError`` otherwise."""
    src = source(root)
    if src["recorded"] is not None:
        differing = _differing(src["recorded"], src["recorded"], root)
        if differing:
            raise _refuse(differing)
    return src


_READS: set[str] | None = None  # files under ROOT opened for reading, relative


def track_reads() -> None:
    """Starts recording the files this process opens for reading under the tree (idempotent;
    an audit hook stays for the process's life). ``python -m bench`` calls it first thing."""
    global _READS
    if _READS is not None:
        return
    reads: set[str] = set()
    prefix = str(ROOT) + os.sep
    writing = os.O_WRONLY | os.O_RDWR

    def hook(event: str, args: tuple) -> None:
        if event != "open" or getattr(_OWN, "reading", False):
            return
        path, mode, flags = args
        if isinstance(mode, str):
            if any(c in mode for c in "wax+"):
                return
        elif isinstance(flags, int) and flags & writing:
            return
        if not isinstance(path, str | bytes | os.PathLike):  # a file descriptor
            return
        full = os.path.abspath(os.fsdecode(path))
        if full.startswith(prefix):
            reads.add(full[len(prefix) :])

    sys.addaudithook(hook)
    _READS = reads


def measured_files(root: Path = ROOT, roots: Iterable[str] = MEASURED_ROOTS) -> list[str]:
    """The files under ``roots`` (default: the measured roots) this process used so far
    (module docstring)."""
    roots = tuple(roots)
    if _READS is None:
        raise ProvenanceError(
            "the files this process read were not tracked from its start (call "
            "bench.core.provenance.track_reads() first; `python -m bench` does)"
        )
    used = set()
    for module in list(sys.modules.values()):
        f = getattr(module, "__file__", None)
        if f:
            try:
                used.add(Path(f).resolve().relative_to(root).as_posix())
            except ValueError:
                continue
    reads = {Path(p).as_posix() for p in list(_READS)}
    used |= reads
    for d in {Path(p).parent for p in reads}:  # weights beside a file read (a config.json)
        if (root / d).is_dir():
            used |= {(d / w.name).as_posix() for w in (root / d).iterdir()
                     if w.suffix in WEIGHT_SUFFIXES and w.is_file()}  # fmt: skip
    return sorted(
        p for p in used
        if p.split("/", 1)[0] in roots and "__pycache__" not in p
        and p not in NOT_MEASURED and (root / p).is_file()
    )  # fmt: skip


# What a stack's processes run (``python -m dhisparse.cli ...``): a benchmark that starts a
# stack imports these as well, so that its result's provenance names that code too.
STACK_MODULES = (
    "dhisparse.cli", "services.gateway.cli", "services.gateway.app", "services.gateway.settings",
    "services.worker.cli", "services.worker.server", "services.kv_host_store.cli",
)  # fmt: skip


def include_modules(names: Iterable[str]) -> None:
    """Imports modules that other processes of the benchmark run (a stack it starts), so that
    this process's results name their code too."""
    for name in names:
        importlib.import_module(name)


def code_hash(files: dict[str, str]) -> str:
    """One hash of (path, hash) pairs: equal exactly when the measured files are."""
    lines = "".join(f"{h}  {p}\n" for p, h in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def _driver_version() -> str | None:
    try:
        text = _read(Path("/proc/driver/nvidia/version")).decode()
        m = re.search(r"Kernel Module(?: for \S+)?\s+([0-9][0-9.]+)", text)
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.split()  # fmt: skip
        return out[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def gpu() -> dict | None:
    """The CUDA device the process used (none when it never imported torch or has none)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return {"name": torch.cuda.get_device_name(), "count": torch.cuda.device_count(),
            "driver": _driver_version(), "cuda": torch.version.cuda}  # fmt: skip


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    torch = sys.modules.get("torch")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__ if torch is not None else _version("torch"),
        "triton": _version("triton"),
        "platform": platform.platform(),
    }


def command_line(root: Path = ROOT) -> str:
    argv = list(sys.argv)
    if argv and Path(argv[0]).resolve() == root / "bench" / "__main__.py":
        return shlex.join(["python", "-m", "bench", *argv[1:]])
    return shlex.join(["python", *argv])


def _relative(path: str | Path, root: Path) -> str:
    p = Path(path).resolve()
    try:
        return p.relative_to(root).as_posix()
    except ValueError:
        return str(p)


def collect(
    inputs: Iterable[str | Path] = (), data: Iterable[str | Path] = (), root: Path = ROOT
) -> dict:
    """The provenance of a result written now. ``inputs``: files in the repository the result
    derives from (another result), checked by ``stale`` like code; ``data``: files outside it
    (a corpus), recorded by SHA-256. Code and inputs are recorded by ``measured_hash``.
    Raises ``ProvenanceError`` when it cannot be named."""
    src = source(root)
    files = {p: measured_hash(root / p) for p in measured_files(root)}
    if src["recorded"] is not None:
        differing = _differing(src["recorded"], files, root)
        if differing:
            raise _refuse(differing)
    return {
        "commit": src["commit"],
        "dirty": src["dirty"],
        "source": src["source"],
        "hash_scheme": HASH_SCHEME,
        "code_hash": code_hash(files),
        "files": files,
        "inputs": {_relative(p, root): measured_hash(Path(p).resolve()) for p in inputs},
        "data": {_relative(p, root): hashlib.sha256(_read(Path(p))).hexdigest() for p in data},
        "gpu": gpu(),
        "versions": versions(),
        "command": command_line(root),
        "date": _now(),
    }
