"""``python -m bench roofline`` (``command.py``): a decode step's and a prefill's kernels,
their regions, and the bytes and FLOPs each must move against the device's limits."""

from bench.roofline.command import add_arguments, run

__all__ = ["add_arguments", "run"]
