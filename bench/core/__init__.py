"""What every benchmark shares:

- ``clock``: wall time, a run's own time in lockstep, CUDA-event timing;
- ``lockstep``: stepping several runs in turn so a noisy host weighs on all alike;
- ``provenance``: the code, commit, GPU and versions a result was measured on;
- ``output``: writing a result JSON with its provenance;
- ``plots``: matplotlib without a display;
- ``steps``, ``model``: engine helpers and the benchmark model several benchmarks use.
"""

from __future__ import annotations


class UsageError(Exception):
    """A subcommand's arguments do not make sense together: ``python -m bench`` reports it
    as a usage error (exit status 2)."""
