"""The device's limits the roofline divides by: its copy rate, measured in the run (a large
device-to-device copy, bytes read + written per second), and its dense peak in FLOP/s from the
vendor's table by device name, beside the rate a large bf16 matmul reaches in the run."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

# (name fragment, bf16 dense, fp8 dense) FLOP/s, first match wins: the SXM parts' figures
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 756e12, 1513e12),
    ("H100 NVL", 835e12, 1671e12),
    ("H100", 989e12, 1979e12),
    ("H200", 989e12, 1979e12),
)


@dataclass(frozen=True)
class Limits:
    device: str  # the device's name
    copy_bytes_per_s: float  # measured
    matmul_flops_per_s: float  # measured (bf16 on a GPU, fp32 on the CPU)
    peak_bf16: float | None  # the table's; None when the device is not in it
    peak_fp8: float | None

    @property
    def compute(self) -> float:
        """The compute limit the roofline takes: the table's bf16 peak, or where the device has
        none (the CPU), the measured matmul rate (``compute_source`` says which)."""
        return self.peak_bf16 if self.peak_bf16 is not None else self.matmul_flops_per_s

    @property
    def compute_source(self) -> str:
        return "bf16 dense peak (table)" if self.peak_bf16 else "measured matmul (no table peak)"


def table_peak(name: str) -> tuple[float, float] | None:
    for fragment, bf16, fp8 in PEAKS:
        if fragment in name:
            return bf16, fp8
    return None


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` synchronised runs, after one warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_rate(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes read + written per second copying ``nbytes`` within ``device``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / t


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n matmul in ``dtype``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = _timed(lambda: a @ b, device, repeats)
    return 2.0 * n**3 / t


def measure(device: torch.device) -> Limits:
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peaks = table_peak(name) if cuda else None
    limits = Limits(
        device=name,
        copy_bytes_per_s=copy_rate(device, (2 << 30) if cuda else (64 << 20)),
        matmul_flops_per_s=matmul_rate(
            device, 8192 if cuda else 256, torch.bfloat16 if cuda else torch.float32
        ),
        peak_bf16=peaks[0] if peaks else None,
        peak_fp8=peaks[1] if peaks else None,
    )
    if cuda:  # the engine sizes its KV pool from the free memory: give the buffers back
        torch.cuda.empty_cache()
    return limits
