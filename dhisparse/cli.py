"""The ``dhisparse`` command. Each subcommand lives in its own module, imported only when run
(``dhisparse plan`` must not pay for importing torch)."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with add_arguments(parser) and main(args) -> int | None, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("dhisparse.up", "start the whole local stack: kv-host-store, worker(s), gateway"),
    "gateway": ("services.gateway.cli", "run the OpenAI-compatible HTTP gateway"),
    "worker": ("services.worker.cli", "run a GPU worker (gRPC) in front of the engine"),
    "kv-host-store": ("services.kv_host_store.cli", "run the node's host KV store (gRPC)"),
    "generate": ("services.worker.generate", "offline generation straight on the engine"),
    "plan": ("dhisparse.capacity.cli", "size GPUs and host memory with the capacity model"),
    "verify": ("services.worker.verify.cli", "check a model's first layers against transformers"),
}


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dhisparse",
        description="Sparse-attention LLM serving over a load-adaptive KV hierarchy.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {n:<15}{h}" for n, (_, h) in COMMANDS.items()),
    )
    p.add_argument("command", choices=sorted(COMMANDS), metavar="command")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        _top_parser().parse_args(argv[:1] or ["--help"])
        return 2
    name, rest = argv[0], argv[1:]
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"dhisparse {name}", description=help_text)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    return int(module.main(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
