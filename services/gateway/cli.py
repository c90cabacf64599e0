"""``dhisparse gateway``: the OpenAI-compatible HTTP gateway. Flags override the
``DHISPARSE_GATEWAY_*`` environment."""

from __future__ import annotations

import argparse
import logging

from dhisparse.flags import add_switch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8000)")
    parser.add_argument(
        "--workers",
        help="comma-separated worker gRPC addresses host:port (default 127.0.0.1:50051)",
    )
    parser.add_argument(
        "--model",
        help="model preset (tiny-glm: byte tokenizer) or the workers' model directory (its "
        "tokenizer, chat template and generation defaults)",
    )
    parser.add_argument(
        "--served-model-name", help="the model name clients use (default: the workers')"
    )
    parser.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on /v1")
    parser.add_argument("--max-request-bytes", type=int, help="larger bodies get 413")
    parser.add_argument(
        "--default-max-tokens", type=int, help="max_tokens when a request gives none"
    )
    parser.add_argument("--max-n", type=int, help="largest n (choices per request)")
    parser.add_argument(
        "--health-interval-s", type=float, help="seconds between polls of the workers (1)"
    )
    parser.add_argument(
        "--health-misses", type=int,
        help="polls a worker may miss in a row before it counts as unhealthy (3)",
    )  # fmt: skip
    parser.add_argument(
        "--redis-url",
        help="Redis URL of the capacity ledger shared by gateway replicas (default: in-process)",
    )
    parser.add_argument("--ledger-prefix", help="prefix of the ledger's Redis keys")
    parser.add_argument("--redis-max-connections", type=int, help="Redis connections (16)")
    parser.add_argument("--lease-ttl-s", type=float, help="seconds an unrenewed lease lives (10)")
    parser.add_argument(
        "--max-queue", type=int, help="requests that may wait for capacity per model (256)"
    )
    parser.add_argument(
        "--queue-deadline-s",
        type=float,
        help="seconds a request may wait for capacity (30): one expected to wait longer is "
        "refused at once with 429 and Retry-After",
    )
    parser.add_argument(
        "--admission-poll-s", type=float, help="seconds between a waiting request's tries"
    )
    parser.add_argument(
        "--worker-dead-after-s",
        type=float,
        help="seconds unhealthy before a worker's leases are released (15)",
    )
    parser.add_argument(
        "--resume-deadline-s",
        type=float,
        help="seconds a stream waits for its restarted worker to resume it (60; 0: never)",
    )
    parser.add_argument("--kv-page-size", type=int, help="the workers' --page-size (16)")
    add_switch(
        parser, "prefix-affinity",
        "route a request to a worker whose node likely holds its prompt's leading pages as a "
        "cached prefix, weighed against load (on); off: the least-loaded worker",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-affinity-weight", type=float,
        help="share of a worker's load that a predicted hit of the whole prompt outweighs (0.5)",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-affinity-max-pages", type=int,
        help="leading pages of a prompt keyed for routing (2048)",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-affinity-index-pages", type=int,
        help="pages the prefix-affinity index remembers, least recently recorded dropped (200000)",
    )  # fmt: skip
    add_switch(
        parser, "prefix-affinity-shared",
        "share prefix-affinity records with the other gateway replicas through the ledger's "
        "Redis (on, with --redis-url)",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-affinity-feed-entries", type=int,
        help="affinity records the shared Redis stream retains for a starting replica (4096)",
    )  # fmt: skip
    parser.add_argument("--log-level", help="debug, info, warning, error")


def main(args: argparse.Namespace) -> int:
    # Imported here so that `dhisparse --help` stays fast.
    import uvicorn

    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings

    overrides = {k: v for k, v in vars(args).items() if v is not None}
    settings = GatewaySettings(**overrides)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
    )
    return 0
