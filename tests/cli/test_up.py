"""`dhisparse up`'s defaults and its flags for the workers: adaptive mode, the device resolved
once (the GPU when CUDA is available), the default drafter following the resolved device, and
a host arena that must fit the machine."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dhisparse.devices import resolve_device
from dhisparse.up import DEFAULT_DRAFTER, _spec_flags, add_arguments, worker_argv
from tests.conftest import free_port
from tests.e2e.test_stack import stop_stack


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_defaults_are_the_papers_system() -> None:
    args = parse()
    assert (args.mode, args.device, args.drafter) == ("adaptive", "auto", "auto")
    assert args.kv_store_capacity == "1GiB"
    argv = worker_argv(args, 0, resolve_device(args.device))
    assert _flag(argv, "--mode") == "adaptive"
    assert _flag(argv, "--device") == ("cuda:0" if torch.cuda.is_available() else "cpu")
    # Durable sessions and CUDA graphs are the worker's defaults: nothing turns them off.
    assert not [a for a in argv if a.startswith("--no-")]
    assert "--kv-store" in argv  # durable sessions live in the node's host store
    assert parse("--mode", "resident").mode == "resident"  # kept for comparison


def test_weight_and_kv_dtypes_reach_every_worker() -> None:
    args = parse("--workers", "2", "--weight-dtype", "fp8", "--kv-cache-dtype", "fp8")
    for i in range(2):
        argv = worker_argv(args, i, "cpu")
        assert _flag(argv, "--weight-dtype") == "fp8" and _flag(argv, "--kv-cache-dtype") == "fp8"
    argv = worker_argv(parse(), 0, "cpu")
    assert _flag(argv, "--weight-dtype") == "auto" and _flag(argv, "--kv-cache-dtype") == "auto"
    # every dtype the worker takes, DeepSeek-V4's FP4 experts included
    assert _flag(worker_argv(parse("--weight-dtype", "fp4"), 0, "cpu"), "--weight-dtype") == "fp4"


def test_auto_device_is_the_gpu_when_cuda_is_available() -> None:
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    for device in ("cpu", "cuda", "cuda:1"):
        assert resolve_device(device) == device


def test_each_worker_gets_its_own_gpu() -> None:
    args = parse("--workers", "2")
    assert [_flag(worker_argv(args, i, "cuda"), "--device") for i in range(2)] == [
        "cuda:0",
        "cuda:1",
    ]
    assert _flag(worker_argv(args, 1, "cpu"), "--device") == "cpu"
    assert _flag(worker_argv(args, 1, "cuda"), "--worker-id") == "worker-1"


def test_auto_drafter_follows_the_resolved_device() -> None:
    """On a GPU speculation does not yet beat plain decoding on CUDA graphs, so the default
    there is plain decoding; on a CPU it is the model's own MTP layer, where it has one."""
    args = parse()
    cpu = _spec_flags(args, "cpu")
    assert DEFAULT_DRAFTER == "mtp"
    assert cpu[:2] == ["--drafter", DEFAULT_DRAFTER] and "--spec-width" in cpu
    assert _spec_flags(parse("--model", "tiny-glm"), "cpu") == []  # a preset: no MTP layer
    assert _spec_flags(args, "cuda") == []
    want = [] if torch.cuda.is_available() else cpu
    assert _spec_flags(args, resolve_device(args.device)) == want
    assert [a for a in worker_argv(args, 0, "cuda") if a == "--drafter"] == []


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_explicit_drafter_wins_on_any_device(device: str) -> None:
    flags = _spec_flags(parse("--drafter", "dspark", "--spec-width", "6"), device)
    assert flags == ["--drafter", "dspark", "--spec-width", "6", "--width-policy", "online"]
    assert _spec_flags(parse("--drafter", "none"), device) == []


def test_an_arena_that_does_not_fit_stops_up_before_it_starts_anything(tmp_path: Path) -> None:
    arena = Path("/dev/shm") / f"dhisparse-test-up-{tmp_path.name}"
    r = subprocess.run(
        [sys.executable, "-m", "dhisparse.cli", "up", "--port", str(free_port()),
         "--arena-path", str(arena), "--kv-store-capacity", "1EiB"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert "does not fit" in r.stderr and "lower --kv-store-capacity" in r.stderr, r.stderr
    assert "pid" not in r.stdout  # no child was started
    assert not arena.exists()


def test_a_worker_that_dies_at_start_up_stops_up_with_its_error(tmp_path: Path) -> None:
    """A pool too small for one request: the worker refuses to start, and ``up`` exits with
    its status and its message at once instead of waiting for it (or restarting it)."""
    http, worker, store, store_metrics, metrics = (free_port() for _ in range(5))
    arena = Path("/dev/shm") / f"dhisparse-test-up-{tmp_path.name}"
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dhisparse.cli", "up", "--port", str(http),
             "--worker-port", str(worker), "--kv-store-port", str(store),
             "--kv-store-metrics-port", str(store_metrics), "--arena-path", str(arena),
             "--worker-metrics-port", str(metrics), "--kv-pool-mib", "1", "--drafter", "none"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        code = proc.wait(120)
    finally:
        stop_stack(proc, log, str(arena))
    text = log.read_text()
    assert code == 1, text
    assert re.search(
        r"\[up\] worker-0 exited with status 1 during start-up: ValueError: a KV pool of "
        r"1048576 B leaves 0 pages",
        text,
    ), text
    assert "restart" not in text and "gateway: pid" not in text
