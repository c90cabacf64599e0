"""Container health check for the dhisparse images (Docker HEALTHCHECK). Reads the same
``DHISPARSE_*`` port settings as the service it checks, so it follows a changed port.

    healthcheck.py gateway         # GET /health is 2xx (at least one worker is healthy)
    healthcheck.py worker          # the worker's gRPC Health RPC says the engine is ok
    healthcheck.py kv-host-store   # the metrics endpoint answers

Exit status 0 is healthy, 1 is not (what Docker expects), 2 is a usage error.
"""

from __future__ import annotations

import os
import sys
import urllib.request

TIMEOUT_S = 5.0


def _port(var: str, default: int) -> int:
    return int(os.environ.get(var, default))


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
        return 200 <= r.status < 300


def check_gateway() -> bool:
    return _http_ok(f"http://127.0.0.1:{_port('DHISPARSE_GATEWAY_PORT', 8000)}/health")


def check_kv_host_store() -> bool:
    return _http_ok(f"http://127.0.0.1:{_port('DHISPARSE_KV_STORE_METRICS_PORT', 9102)}/metrics")


def check_worker() -> bool:
    # An open gRPC port is not enough: the engine thread may have failed behind it.
    import grpc

    from dhisparse.rpc import worker_pb2, worker_pb2_grpc

    address = f"127.0.0.1:{_port('DHISPARSE_WORKER_PORT', 50051)}"
    with grpc.insecure_channel(address) as channel:
        reply = worker_pb2_grpc.WorkerStub(channel).Health(
            worker_pb2.HealthRequest(), timeout=TIMEOUT_S
        )
    return reply.ok


CHECKS = {"gateway": check_gateway, "worker": check_worker, "kv-host-store": check_kv_host_store}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CHECKS:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        ok = CHECKS[argv[0]]()
    except Exception as e:  # whatever keeps the service from answering makes it unhealthy
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
