"""Where shipped files are found: model and drafter directories given as paths relative to the
project root (``models/glm-dsa-mini``) resolve from any working directory."""

from __future__ import annotations

from pathlib import Path

# The repository (or installed tree) root: shipped weights live under ROOT/models.
ROOT = Path(__file__).resolve().parents[1]


def resolve_path(spec: str | Path) -> Path:
    """``spec`` as given when it exists (or is absolute), else the same relative path under the
    project root when that exists, else ``spec`` unchanged (for the caller's error)."""
    path = Path(spec)
    if path.exists() or path.is_absolute():
        return path
    shipped = ROOT / path
    return shipped if shipped.exists() else path
