"""``python -m bench capacity``: capacity and decode rate of resident / hisparse / adaptive
serving vs concurrency (``cli``: arguments, the result, its plot; ``sweep``: the engines and
the lockstep sweeps)."""

from __future__ import annotations

from .cli import add_arguments, run

__all__ = ["add_arguments", "run"]
