"""The real stack for the HTTP-level benchmark: kv-host-store, one worker and the gateway as
separate processes on loopback (as ``dhisparse up`` starts them, but with every engine knob the
benchmark needs), stopped by PID however the run ends."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.core import provenance
from bench.core.processes import HOST, free_port, port_open, wait_ready
from bench.core.processes import stop as stop_processes
from dhisparse.up import http_ok
from services.worker.engine.config import EngineConfig


@dataclass
class Stack:
    """``with Stack(cfg, model_arg, host_bytes, log_dir) as s:`` serves ``cfg``'s engine at
    ``s.base``; the worker's Prometheus metrics at ``s.worker_metrics``, the gateway's at
    ``s.base + '/metrics'``. ``model_arg``: what the worker and gateway load (a preset name or
    a model directory)."""

    cfg: EngineConfig
    model_arg: str
    host_bytes: int
    log_dir: Path
    max_queue: int = 1024
    startup_s: float = 600.0
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.http, self.worker_port, self.store_port = free_port(), free_port(), free_port()
        self.metrics_port = free_port()
        self.arena = f"/dev/shm/dhisparse-bench-{os.getpid()}-{self.http}"
        self.base = f"http://{HOST}:{self.http}"
        self.worker_metrics = f"http://{HOST}:{self.metrics_port}/metrics"
        self.log = Path(self.log_dir) / f"stack-{self.http}.log"

    def _argv(self) -> list[list[str]]:
        py = [sys.executable, "-m", "dhisparse.cli"]
        c = self.cfg
        store = [*py, "kv-host-store", "--host", HOST, "--port", str(self.store_port),
                 "--metrics-port", "0", "--capacity", str(self.host_bytes),
                 "--arena-path", self.arena]  # fmt: skip
        worker = [*py, "worker", "--host", HOST, "--port", str(self.worker_port),
                  "--metrics-port", str(self.metrics_port), "--model", self.model_arg,
                  "--mode", c.mode, "--device", c.device, "--kv-pool-mib", str(c.kv_pool_mib),
                  "--page-size", str(c.page_size), "--max-num-seqs", str(c.max_num_seqs),
                  "--max-model-len", str(c.max_model_len),
                  "--max-prefill-tokens", str(c.max_prefill_tokens),
                  "--kv-store", f"{HOST}:{self.store_port}", "--worker-id", "bench-worker-0",
                  "--log-level", "WARNING"]  # fmt: skip
        if c.dtype:
            worker += ["--dtype", c.dtype]
        if c.hot_cache_rows:
            worker += ["--hot-cache-rows", str(c.hot_cache_rows)]
        if c.durable_sessions is not None:
            worker.append("--durable-sessions" if c.durable_sessions else "--no-durable-sessions")
        if not c.prefix_cache:
            worker.append("--no-prefix-cache")
        sp = c.speculation
        if sp.drafter:
            worker += ["--drafter", sp.drafter, "--spec-width", str(sp.width),
                       "--width-policy", sp.width_policy]  # fmt: skip
        gateway = [*py, "gateway", "--host", HOST, "--port", str(self.http),
                   "--model", self.model_arg, "--workers", f"{HOST}:{self.worker_port}",
                   "--max-queue", str(self.max_queue), "--queue-deadline-s", "3600",
                   "--kv-page-size", str(c.page_size), "--log-level", "warning"]  # fmt: skip
        return [store, worker, gateway]

    def __enter__(self) -> Stack:
        provenance.include_modules(provenance.STACK_MODULES)  # the code the processes run
        env = dict(os.environ)
        if not self.cfg.device.startswith("cuda"):
            env.setdefault("TRITON_INTERPRET", "1")
        store, worker, gateway = self._argv()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "ab")  # the children hold it open
        try:
            for argv, ready, what in (
                (store, lambda: port_open(self.store_port), "kv-host-store"),
                (worker, lambda: port_open(self.worker_port), "worker"),
                (gateway, lambda: http_ok(self.base + "/health"), "gateway"),
            ):
                self.procs.append(subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                ))  # fmt: skip
                wait_ready(ready, what, self.procs, self.log, self.startup_s)
        except BaseException:
            self.stop()
            raise
        finally:
            out.close()
        return self

    def log_lines(self, contains: str) -> list[str]:
        """The lines of the stack's log (its processes' output) that contain ``contains``."""
        if not self.log.exists():
            return []
        text = self.log.read_text(errors="replace")
        return [line for line in text.splitlines() if contains in line]

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Gateway first, store last; SIGTERM, then SIGKILL whatever did not exit, by PID."""
        stop_processes(self.procs)
        self.procs.clear()
        Path(self.arena).unlink(missing_ok=True)
