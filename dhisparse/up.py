"""``dhisparse up``: the whole local stack — kv-host-store, worker(s), gateway — as supervised
child processes. A child that dies is restarted (as Kubernetes restarts a pod): at once the
first time, then with exponential backoff while it keeps dying. A restarted worker keeps its
``--worker-id``, so in a hierarchy mode it takes over the sessions its predecessor left in the
host store and the gateway re-attaches their streams. Ctrl-C or SIGTERM stops them all. A child
that dies before it comes up stops ``up`` at once, with the child's exit status and the last line
it wrote to stderr (its error): a configuration that cannot start is not restarted.

Its defaults run the system the paper describes: ``adaptive`` mode with durable sessions, on
the GPU when CUDA is available (CUDA graphs on, the worker's default), with a host arena that
must fit the machine (checked before anything starts)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

from dhisparse.devices import AUTO, resolve_device
from dhisparse.family.quantization_config import WEIGHT_DTYPES
from dhisparse.paths import resolve_path
from services.kv_host_store.errors import ArenaError
from services.kv_host_store.fit import check_arena_fits
from services.kv_host_store.settings import parse_size


@dataclass
class Child:
    name: str
    argv: list[str]
    port: int
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started: float = field(default=0.0)
    env: dict[str, str] = field(default_factory=dict)  # added to the environment
    # the last lines the child wrote to stderr (passed on to ours as they come)
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))

    def start(self) -> None:
        env = {**os.environ, **self.env} if self.env else None
        self.stderr_tail.clear()
        self.proc = subprocess.Popen(
            self.argv, start_new_session=True, env=env, stderr=subprocess.PIPE
        )
        self.started = time.monotonic()
        assert self.proc.stderr is not None
        threading.Thread(
            target=_pass_on, args=(self.proc.stderr, self.stderr_tail), daemon=True,
            name=f"{self.name}-stderr",
        ).start()  # fmt: skip
        print(f"[up] {self.name}: pid {self.proc.pid}: {' '.join(self.argv[3:])}", flush=True)

    def last_error(self) -> str:
        """The last non-empty line the child wrote to stderr ("" when none)."""
        return next((line for line in reversed(self.stderr_tail) if line.strip()), "")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _pass_on(src: BinaryIO, tail: deque[str]) -> None:
    """Copies a child's stderr to ours line by line, keeping the last lines in ``tail``."""
    out = sys.stderr.buffer
    for line in iter(src.readline, b""):
        tail.append(line.decode(errors="replace").rstrip("\n"))
        try:
            out.write(line)
            out.flush()
        except (OSError, ValueError):  # our stderr is gone: keep draining the child's
            pass


DEFAULT_DRAFTER = "mtp"  # on a CPU, for a model with an MTP layer (the shipped one has)
STABLE_S = 60.0  # a child that ran this long before dying restarts without backoff


def restart_delay(restarts: int) -> float:
    """Seconds before restart number ``restarts`` (1, 2, ...): a crashed worker's sessions wait
    for its successor, so the first restart is immediate; a crash loop backs off to 30 s."""
    return 0.1 if restarts <= 1 else min(30.0, 0.5 * 2 ** min(restarts - 2, 6))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="models/glm-dsa-mini",
        help="model directory (default: the shipped trained model) or a preset name (random "
        "weights)",
    )
    p.add_argument(
        "--drafter",
        default="auto",
        help="speculative drafter: a drafter directory, a kind (random weights), 'mtp' (the "
        "checkpoint's own MTP layer: DeepSeek-V3.2, GLM-5), 'none', or "
        "'auto' (default): on a CPU the model's MTP layer where it has one (the shipped model "
        "does), else none; none on a GPU, where speculation does not yet beat plain decoding "
        "on CUDA graphs (docs/results.md)",
    )
    p.add_argument("--spec-width", type=int, default=4, help="K_max: queries per verify round")
    p.add_argument("--width-policy", default="online", choices=["fixed", "paper", "online"])
    p.add_argument(
        "--mode",
        default="adaptive",
        choices=["resident", "hisparse", "adaptive"],
        help="serving mode (default adaptive: the load-adaptive hierarchy, durable sessions); "
        "resident keeps every row on the device and no host backups, for comparison",
    )
    p.add_argument(
        "--device",
        default=AUTO,
        help="cpu, cuda, or auto (default): cuda when torch sees a CUDA device, else cpu; "
        "worker i of N gets cuda:i",
    )
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
        help="KV rows and index keys: auto (the serving dtype, default) or fp8 (packed FP8 "
        "rows, half the bytes of bf16; docs/fp8_kv.md)",
    )  # fmt: skip
    p.add_argument(
        "--weight-dtype", default="auto", choices=list(WEIGHT_DTYPES),
        help="projections and routed experts: auto (FP8 checkpoints stay FP8, default), fp8, "
        "fp4 (DeepSeek-V4: FP4 routed experts, as released) or bf16 (docs/fp8_weights.md)",
    )  # fmt: skip
    p.add_argument(
        "--workers", type=int, default=1,
        help="workers (each one GPU, or --tensor-parallel-size GPUs)",
    )  # fmt: skip
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1,
        help="ranks per worker, one process and one GPU each (worker i: GPUs i*N .. i*N+N-1)",
    )  # fmt: skip
    p.add_argument("--expert-parallel", action="store_true",
                   help="each rank of a worker holds n_experts / N whole experts")  # fmt: skip
    p.add_argument(
        "--data-parallel-attention", action="store_true",
        help="each rank of a worker attends for its own requests (docs/deploy.md)",
    )  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--worker-port", type=int, default=50051, help="first worker's gRPC port")
    p.add_argument(
        "--worker-metrics-port",
        type=int,
        default=9101,
        help="first worker's Prometheus port (worker i: this + 10 i)",
    )
    p.add_argument("--kv-store-port", type=int, default=50061)
    p.add_argument("--kv-store-metrics-port", type=int, default=9102, help="its Prometheus port")
    p.add_argument(
        "--kv-store-capacity",
        default="1GiB",
        help="host arena size (default 1GiB); start-up fails unless it fits both the free "
        "space of the arena's filesystem and the available memory",
    )
    p.add_argument("--arena-path", default=f"/dev/shm/dhisparse-arena-{os.getuid()}")
    p.add_argument(
        "--kv-pool-mib", type=float,
        help="each worker's KV pool in MiB (default: the worker sizes it: on a GPU 80%% of "
        "its memory free once the model is loaded, 256 on a CPU; it logs what it chose)",
    )  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--no-restart", action="store_true", help="stop the stack when a child dies")
    p.add_argument(
        "--redis-url",
        help="the gateway's capacity ledger in Redis (default: in-process); not started here",
    )


def served_name(model: str) -> str:
    """The name clients send as ``model``, as the worker names it: a Hugging Face directory's
    (``hf_dir.model_name``), a home-made directory's configured name, else the preset's."""
    from dhisparse.family.hf_dir import is_hf_model_dir, model_name, read_config

    path = resolve_path(model)
    if is_hf_model_dir(path):
        return model_name(path, read_config(path))
    config = path / "config.json"
    if config.is_file():
        return json.loads(config.read_text()).get("name", model)
    return model


def has_mtp_layer(model: str) -> bool:
    """Whether ``model`` is a Hugging Face directory whose config declares an MTP layer."""
    from dhisparse.family.hf_dir import is_hf_model_dir, read_config

    path = resolve_path(model)
    return is_hf_model_dir(path) and read_config(path).get("num_nextn_predict_layers", 0) > 0


def _spec_flags(args: argparse.Namespace, device: str) -> list[str]:
    """The workers' speculative decoding flags on ``device`` (resolved: never 'auto');
    'none': plain decoding."""
    drafter = args.drafter
    if drafter == "auto":
        drafter = DEFAULT_DRAFTER if device == "cpu" and has_mtp_layer(args.model) else "none"
    if drafter in (None, "", "none"):
        return []
    return [
        "--drafter", drafter, "--spec-width", str(args.spec_width),
        "--width-policy", args.width_policy,
    ]  # fmt: skip


def port_open(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def http_ok(url: str) -> bool:
    """Whether ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as r:
            return r.status == 200
    except OSError:
        return False


def _wait_up(child: Child, ready: Callable[[], bool], timeout_s: float) -> int:
    """0 once ``ready()``; else, printed with why, the status ``up`` exits with: the child's
    own (1 for a signal) when it died first, with its last stderr line; 1 after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if not child.alive():
            code = child.proc.returncode if child.proc is not None else None
            time.sleep(0.2)  # its last lines reach the tail
            error = child.last_error() or "no message"
            print(f"[up] {child.name} exited with status {code} during start-up: {error}",
                  file=sys.stderr, flush=True)  # fmt: skip
            return code if code is not None and code > 0 else 1
        if time.monotonic() > deadline:
            print(f"[up] {child.name} did not come up within {timeout_s:.0f} s", file=sys.stderr)
            return 1
        time.sleep(0.2)
    return 0


def worker_device(device: str, index: int, ranks: int = 1) -> str:
    """Worker ``index``'s device: its own GPU when ``device`` is plain ``cuda``; a worker of
    several ranks is given ``cuda`` and sees its own GPUs alone (``worker_env``)."""
    if ranks > 1:
        return device
    return f"cuda:{index}" if device == "cuda" else device


def worker_env(device: str, index: int, ranks: int) -> dict[str, str]:
    """The GPUs worker ``index`` of ``ranks`` ranks sees: i*N .. i*N+N-1 of this machine's."""
    if device != "cuda" or ranks == 1:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(g) for g in range(index * ranks + ranks)]
    mine = gpus[index * ranks : (index + 1) * ranks]
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


def _parallel_flags(args: argparse.Namespace) -> list[str]:
    if args.tensor_parallel_size == 1:
        return []
    return [
        "--tensor-parallel-size", str(args.tensor_parallel_size),
        *(["--expert-parallel"] if args.expert_parallel else []),
        *(["--data-parallel-attention"] if args.data_parallel_attention else []),
    ]  # fmt: skip


def worker_argv(args: argparse.Namespace, index: int, device: str) -> list[str]:
    """``dhisparse worker`` flags of worker ``index`` on ``device`` (resolved: never 'auto').
    What they leave out is the worker's default: CUDA graphs on a GPU, durable sessions in
    the hierarchy modes."""
    return [
        sys.executable, "-m", "dhisparse.cli", "worker",
        "--host", args.host,
        "--port", str(args.worker_port + index),
        "--metrics-port", str(args.worker_metrics_port + 10 * index),
        "--model", args.model,
        "--mode", args.mode,
        "--device", worker_device(device, index, args.tensor_parallel_size),
        *(["--kv-pool-mib", str(args.kv_pool_mib)] if args.kv_pool_mib is not None else []),
        "--kv-cache-dtype", args.kv_cache_dtype,
        "--weight-dtype", args.weight_dtype,
        "--max-model-len", str(args.max_model_len),
        "--kv-store", f"{args.host}:{args.kv_store_port}",
        *_spec_flags(args, device),
        "--worker-id", f"worker-{index}",
        *_parallel_flags(args),
    ]  # fmt: skip


def main(args: argparse.Namespace) -> int:
    try:
        check_arena_fits(
            args.arena_path,
            parse_size(args.kv_store_capacity),
            "--kv-store-capacity (DHISPARSE_KV_STORE_CAPACITY)",
        )
    except (ArenaError, ValueError) as e:
        print(f"[up] {e}", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    how = ""
    if args.device == AUTO:
        how = " (auto: no CUDA device)" if device == "cpu" else " (auto: CUDA is available)"
    spec = _spec_flags(args, device)
    drafter = spec[1] if spec else "none"
    pool = "sized by each worker" if args.kv_pool_mib is None else f"{args.kv_pool_mib:g} MiB"
    print(f"[up] device {device}{how}, mode {args.mode}, drafter {drafter}, KV pool {pool}",
          flush=True)  # fmt: skip
    py = [sys.executable, "-m", "dhisparse.cli"]
    store = Child(
        "kv-host-store",
        [
            *py,
            "kv-host-store",
            "--host",
            args.host,
            "--port",
            str(args.kv_store_port),
            "--metrics-port",
            str(args.kv_store_metrics_port),
            "--capacity",
            args.kv_store_capacity,
            "--arena-path",
            args.arena_path,
        ],
        args.kv_store_port,
    )
    workers = [Child(f"worker-{i}", worker_argv(args, i, device), args.worker_port + i,
                     env=worker_env(device, i, args.tensor_parallel_size))
               for i in range(args.workers)]  # fmt: skip
    worker_addrs = ",".join(f"{args.host}:{w.port}" for w in workers)
    gateway = Child(
        "gateway",
        [
            *py,
            "gateway",
            "--host",
            args.host,
            "--port",
            str(args.port),
            "--model",
            args.model,
            "--workers",
            worker_addrs,
            *(["--redis-url", args.redis_url] if args.redis_url else []),
        ],
        args.port,
    )
    children = [store, *workers, gateway]
    stopping = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        store.start()
        if code := _wait_up(store, lambda: port_open(args.host, store.port), 60):
            return code
        for w in workers:
            w.start()
        for w in workers:
            if code := _wait_up(w, lambda w=w: port_open(args.host, w.port), 180):
                return code
        gateway.start()
        health = f"http://{args.host}:{args.port}/health"
        if code := _wait_up(gateway, lambda: http_ok(health), 60):
            return code
        print(
            f"\n[up] dhisparse is serving {served_name(args.model)} ({args.model}) at "
            f"http://{args.host}:{args.port}/v1\n"
            f"  curl -s http://{args.host}:{args.port}/v1/completions "
            "-H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{served_name(args.model)}", '
            '"prompt": "import os\\n\\n\\ndef main():", "max_tokens": 24, "temperature": 0}\'\n'
            "[up] Ctrl-C stops the stack.\n",
            flush=True,
        )
        while not stopping:
            time.sleep(0.5)
            for c in children:
                if c.alive() or stopping:
                    continue
                code = c.proc.returncode if c.proc else None
                if args.no_restart:
                    print(f"[up] {c.name} exited ({code}); stopping", file=sys.stderr)
                    return 1
                if time.monotonic() - c.started > STABLE_S:
                    c.restarts = 0  # it ran fine for a while: this is a new failure
                c.restarts += 1
                delay = restart_delay(c.restarts)
                print(f"[up] {c.name} exited ({code}); restart #{c.restarts} in {delay:.1f}s")
                time.sleep(delay)
                c.start()
        return 0
    finally:
        for c in reversed(children):
            c.stop()
        print("[up] stopped", flush=True)
