"""The benchmarks: one tool, ``python -m bench <name> ...`` (``bench/cli.py`` lists the
subcommands), over a small shared core (``bench/core/``: clocks, the lockstep loop, provenance,
result files, plots). Every result JSON carries the provenance of the code it measured;
``python -m bench stale`` lists committed results whose code has changed since."""
