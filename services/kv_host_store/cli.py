"""``dhisparse kv-host-store``: run the node's host KV store. Flags override the environment
(``DHISPARSE_KV_STORE_*``), which overrides the defaults."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from pydantic import ValidationError

from dhisparse.flags import add_switch
from services.kv_host_store.errors import ArenaError
from services.kv_host_store.server import serve
from services.kv_host_store.settings import KVHostStoreSettings

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="bind address for gRPC and metrics (127.0.0.1)")
    parser.add_argument("--port", type=int, help="gRPC port, 0 for any free one (50061)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus port, 0 for any (9102)")
    parser.add_argument("--arena-path", help="arena file (/dev/shm/dhisparse-arena)")
    parser.add_argument("--capacity", help="arena size: bytes or e.g. 1GiB, 512MiB (1GiB)")
    parser.add_argument("--alignment", help="region alignment in bytes, a power of two (4096)")
    add_switch(parser, "remove-arena-on-exit", "unlink the arena file on shutdown (on)")
    add_switch(parser, "preallocate", "reserve the arena's tmpfs pages at start (off)")
    parser.add_argument(
        "--orphan-ttl-s",
        type=float,
        help="free a dead worker's unadopted requests after this many seconds (300)",
    )
    parser.add_argument(
        "--placement-policy", help="where new regions go: packed, grouped, scattered (packed)"
    )
    parser.add_argument("--placement-extent", help="grouped placement's extent size (256MiB)")
    parser.add_argument("--log-level", default="INFO", help="logging level (INFO)")


_SETTINGS_FLAGS = (
    "host",
    "port",
    "metrics_port",
    "arena_path",
    "capacity",
    "alignment",
    "remove_arena_on_exit",
    "preallocate",
    "orphan_ttl_s",
    "placement_policy",
    "placement_extent",
)


def settings_from_args(args: argparse.Namespace) -> KVHostStoreSettings:
    """Settings from the environment, with every flag that was given taking precedence."""
    overrides: dict[str, Any] = {
        k: getattr(args, k) for k in _SETTINGS_FLAGS if getattr(args, k, None) is not None
    }
    return KVHostStoreSettings(**overrides)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        settings = settings_from_args(args)
    except ValidationError as e:
        print(f"dhisparse kv-host-store: invalid settings:\n{e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(settings))
    except (ArenaError, OSError, RuntimeError) as e:
        # Arena held by another store, /dev/shm too small, port in use (grpc: RuntimeError).
        log.error("kv-host-store failed to start: %s", e)
        return 1
    return 0
