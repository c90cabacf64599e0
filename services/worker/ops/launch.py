"""What the decode-time splits of the kernels aim for (split-K of the FP8 matmul, row splits of
sparse attention)."""

from __future__ import annotations

# Programs a launch aims for: two waves of 132 SMs, today's large data-center GPUs' count. A
# constant, not the device's own count, so a given shape is split, and summed, in the same
# order on every machine.
TARGET_PROGRAMS = 264
