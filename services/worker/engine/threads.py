"""The host thread pool of a GPU engine."""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)


def limit_host_threads(threads: int = 1) -> None:
    """A GPU engine's host thread only prepares and launches work, and torch's CPU thread pool
    then only contends with it: a small CPU op that splits its work finely (``ForwardBatch``'s
    ``repeat_interleave`` splits by request) wakes the whole pool on every step, which costs
    milliseconds on a busy host (the H200 profile: 1.6-3.3 ms a step). As vLLM does for its
    GPU workers, the pool is cut to ``threads`` unless ``OMP_NUM_THREADS`` sets it."""
    if "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() <= threads:
        return
    log.info("torch CPU threads %d -> %d (a GPU engine)", torch.get_num_threads(), threads)
    torch.set_num_threads(threads)
