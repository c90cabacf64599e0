"""Byte counts in words for ``dhisparse plan``'s tables: GPU figures in binary units (GiB, as
the paper prints them), host figures in decimal ones (GB, TB)."""

from __future__ import annotations

from dhisparse.capacity.model import GIB, TB

BINARY = (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10))
DECIMAL = (("TB", TB), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def binary_unit(nbytes: int) -> tuple[str, int]:
    """The largest binary unit in which ``nbytes`` is at least 0.1 (GiB for paper sizes)."""
    return next((u for u in BINARY if nbytes >= u[1] // 10), BINARY[-1])


def binary(nbytes: int) -> str:
    name, size = binary_unit(nbytes)
    return f"{nbytes / size:.3f} {name}"


def decimal(nbytes: int, digits: int = 3, strip: bool = False) -> str:
    """``nbytes`` in the largest decimal unit in which it is at least 0.1; ``strip``: ``digits``
    significant digits, trailing zeros dropped (else ``digits`` decimals)."""
    name, size = next((u for u in DECIMAL if nbytes >= u[1] // 10), DECIMAL[-1])
    value = f"{nbytes / size:.{digits}g}" if strip else f"{nbytes / size:.{digits}f}"
    return f"{value} {name}"
