"""``python -m bench <name> ...``: one tool for every benchmark. Each subcommand is a module
with ``add_arguments(parser)`` and ``run(args)``, imported only when it runs (``stale`` must not
pay for torch). ``run`` returns an exit status, or a result ``dict`` that is then written to
``--out`` with its provenance (``bench/core/output.py``; the option is added when the module
has none). Subcommands that write results are refused before they run when the code they
would measure cannot be named (``bench/core/provenance.py``).

A new subcommand is one line of ``COMMANDS``."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from dataclasses import dataclass
from types import ModuleType

from bench.core import UsageError, provenance
from bench.core.output import write_result


@dataclass(frozen=True)
class Command:
    module: str  # has add_arguments(parser) and run(args) -> int | dict | None
    help: str
    results: bool = True  # writes result files: provenance is checked before it runs
    torch: bool = True  # imports torch (and Triton kernels, interpreted without a GPU)


# fmt: off
COMMANDS: dict[str, Command] = {
    "resolver": Command("bench.resolver", "resolver latency, host recovery bandwidth (CUDA)"),
    "host-layout": Command("bench.host_layout", "host-row gather GB/s vs footprint, layouts (CUDA)"),
    "host-layout-serving": Command("bench.host_layout_serving",
                                   "serving-step host recovery per placement and order (CUDA)"),
    "host-row-shape": Command("bench.host_row_shape",
                              "host-row reads by row pitch and lane width (CUDA)"),
    "capacity": Command("bench.capacity", "resident/hisparse/adaptive: sessions, decode rate"),
    "spec": Command("bench.spec", "speculative vs plain decoding, closed loop in lockstep"),
    "serving": Command("bench.serving.cli", "closed-loop serving over the engine or HTTP"),
    "load": Command("bench.load.cli", "sessions and throughput under load, real dimensions"),
    "load-projection": Command("bench.load.project_cli",
                               "V3.2 / GLM-5.2 on 8 H200 from the roofline's region costs"),
    "projection": Command("bench.projection", "GLM-5.3 on 8 GPUs from a serving result"),
    "census": Command("bench.census", "where a trained model's selections fall vs random"),
    "cpu-stream": Command("bench.cpu_stream", "one stream through make run's stack on a CPU"),
    "prefix-turns": Command("bench.prefix_turns",
                            "a growing conversation through make run's stack, prefix reuse on/off"),
    "agent-trace": Command("bench.agent_trace",
                           "a multi-turn agent trace through make run's stack, reuse on/off"),
    "heldout-bpb": Command("bench.heldout_bpb", "bits/byte of the shipped weights, held out"),
    "acceptance": Command("bench.acceptance", "acceptance length of the shipped drafters"),
    "graph-keys": Command("bench.graph_keys", "spec loop passes a graph would replay (CPU)"),
    "step-timeline": Command("bench.step_timeline", "host phases of a replayed step (CUDA)"),
    "profile-step": Command("bench.profile_step",
                            "torch.profiler over decode steps or spec rounds: top operators"),
    "prepare": Command("bench.prepare", "write bench/PROVENANCE.json for a copy without .git",
                       results=False, torch=False),
    "stale": Command("bench.stale", "committed results whose measured code has changed",
                     results=False, torch=False),
    "ratios": Command("bench.ratios", "README's results table from the result JSONs",
                      results=False, torch=False),
    "device-run": Command("bench.device_run", "one part of the GPU runs: one device command",
                          results=False, torch=False),
    "gateway": Command("bench.gateway", "the gateway's overhead per request, HTTP vs gRPC",
                       torch=False),
    "fp8-linear": Command("bench.fp8_linear", "FP8 block-scaled matmul variants at real shapes"),
    "fp8-kv": Command("bench.fp8_kv", "fp8 KV vs the serving dtype: top-k recall, logit error",
                      results=False),
    "scaled": Command("bench.scaled", "real-dimension V3.2 / GLM-5 / V4 per mode, graphs (CUDA)"),
    "sparse-attention": Command("bench.sparse_attention",
                                "sparse MLA decode kernels and tile shapes side by side (CUDA)"),
    "select-topk": Command("bench.select_topk",
                           "the indexer's top-k: torch, bitonic and radix select, lockstep (CUDA)"),
    "verify-scores": Command("bench.verify_scores",
                             "a verify round's index scores: chunk product vs paged kernel (CUDA)"),
    "index-scores": Command("bench.index_scores",
                            "V4's fp32 index queries: IEEE dot vs three bf16 parts (CUDA)"),
    "fp8-moe": Command("bench.fp8_moe", "FP8 routed experts (fused MoE) variants at real shapes"),
    "fp4-moe": Command("bench.fp4_moe", "V4's FP4 routed experts: W4A16 vs FP8 vs bf16 (CUDA)"),
    # torch=False: the stack `up` starts inherits the environment as `make run` gives it
    "defaults": Command("bench.defaults", "make run's defaults end to end, a worker SIGKILLed",
                        torch=False),
    "adoption": Command("bench.adoption", "a live peer adopts a SIGKILLed worker's streams",
                        torch=False),
    "burst": Command("bench.burst", "a burst of completions against make run's defaults",
                     torch=False),
    "grammar-cost": Command("bench.grammar_cost",
                            "constrained decoding's cost per decode step, lockstep"),
    "grammar-host": Command("bench.grammar_host",
                            "a decode step's grammar work on the engine's thread, no model"),
    "gpu-tests": Command("bench.gpu_tests", "the GPU test suite, each test's outcome (CUDA)"),
    "slices": Command("bench.slices", "real-dimension slices vs transformers: errors (CUDA)"),
    "roofline": Command("bench.roofline", "decode step and prefill kernels vs the roofline"),
}
# fmt: on


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench", description="The benchmarks of dhisparse.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {n:<15}{c.help}" for n, c in COMMANDS.items()),
    )  # fmt: skip
    p.add_argument("command", choices=sorted(COMMANDS), metavar="command")
    return p


def _interpret_without_gpu() -> None:
    """Triton kernels run under the interpreter on a machine without CUDA; the variable must
    be set before any ``@triton.jit`` module is imported."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def parser_for(name: str) -> tuple[ModuleType, argparse.ArgumentParser]:
    """The subcommand's module and its argument parser."""
    cmd = COMMANDS[name]
    module = importlib.import_module(cmd.module)
    parser = argparse.ArgumentParser(prog=f"python -m bench {name}", description=cmd.help)
    module.add_arguments(parser)
    if cmd.results:
        with contextlib.suppress(argparse.ArgumentError):  # the module's own --out stays
            parser.add_argument("--out", help="result JSON (default: print it)")
    return module, parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        _top_parser().parse_args(argv[:1] or ["--help"])
        return 2
    name, rest = argv[0], argv[1:]
    cmd = COMMANDS[name]
    if cmd.results:
        provenance.track_reads()
    if cmd.torch:
        _interpret_without_gpu()
    module, parser = parser_for(name)
    args = parser.parse_args(rest)
    try:
        if cmd.results:
            provenance.check_tree()  # refused now, not after the run
        result = module.run(args)
        if isinstance(result, dict):
            if args.out:
                print(f"wrote {write_result(result, args.out)}")
            else:
                doc = {**result, "provenance": provenance.collect()}
                print(json.dumps(doc, indent=2))
            return 0
    except UsageError as e:
        parser.error(str(e))
    except provenance.ProvenanceError as e:
        what = "no result written: " if cmd.results else ""
        print(f"python -m bench {name}: {what}{e}", file=sys.stderr)
        return 2
    return int(result or 0)
