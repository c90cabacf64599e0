"""``python -m bench fp4-moe``: DeepSeek-V4-Flash's routed experts (D = 4096, I = 2048, top_k =
6, the SwiGLU clamped at 10, by default) held three ways, side by side in one run (CUDA).

Variants, for each expert count E and batch of T tokens: FP4-held W4A16 (``FP4Experts``: the
released e2m1 codes and UE8M0 exponents as they are, ``fp4_moe_triton``), FP8-held W8A16 (the
same weights re-held as e4m3 in 128x128 blocks by ``fp4_to_fp8_blocks``, ``fp8_moe_triton``),
and bf16 torch grouped_mm (``routed_experts`` over the dequantized weights in bf16). The FP4
weights are random codes with per-32 scales spread over ``2 * --scale-spread + 1`` binades
around the one that gives the weights a standard deviation of about ``K**-0.5``; the run
records how many values the FP8 re-holding could not keep exact (none within 14 binades).
Routing is uniform at random (distinct experts per token), fixed per case. Each variant is
captured in a CUDA graph of ``--inner`` calls (or launched eagerly with ``--no-graph``) and timed
with CUDA events; the variants alternate within each repeat, the first one rotating
(``bench/core/lockstep.py``), and the medians over ``--repeats`` are reported. Bandwidth is the
bytes of the experts the routing touches (packed codes and uint8 exponents; e4m3 and fp32
scales; or bf16) over the median time. Error is against the fp32 computation on the exact
weights (``fp4_moe_ref`` of fp32 x): relative Frobenius, and max |error| / max |y|."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from bench import fp8_moe
from bench.core import UsageError
from services.worker.model.fp4_experts import FP4Experts
from services.worker.model.fp8_experts import FP8Experts
from services.worker.model.grouped_experts import routed_experts
from services.worker.model.v4_moe import clamped_swiglu
from services.worker.ops.fp4_e2m1 import FP4_GROUP
from services.worker.ops.fp4_moe import dequantize_expert, fp4_moe_ref, fp4_moe_triton, fp4_tiles
from services.worker.ops.fp4_to_fp8 import fp4_to_fp8_blocks
from services.worker.ops.fp8_moe import fp8_moe_triton

VARIANTS = ("w4a16_triton", "w8a16_triton", "bf16_torch")
E2M1_RMS = 2.93  # sqrt(mean(v**2)) over the eight e2m1 magnitudes


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--experts", default="256,32", help="routed expert counts E")
    ap.add_argument("--tokens", default="1,4,16,64", help="batch sizes T")
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=2048, help="I, per expert")
    ap.add_argument("--limit", type=float, default=10.0, help="the SwiGLU's clamp (swiglu_limit)")
    ap.add_argument("--scale-spread", type=int, default=3, help="binades each side of the base")
    ap.add_argument("--repeats", type=int, default=30, help="timed repeats per variant")
    ap.add_argument("--inner", type=int, default=20, help="calls per timed graph replay")
    ap.add_argument("--no-graph", action="store_true", help="launch eagerly, no CUDA graph")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results/fp4_moe.json")


def parse(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The (E, T) cases asked for, E-major; raises ValueError on bad ones."""
    cases = fp8_moe.parse(args)
    if args.d_model % FP4_GROUP or args.intermediate % FP4_GROUP:
        raise ValueError(f"--d-model and --intermediate must be multiples of {FP4_GROUP}")
    if not args.limit > 0 or args.scale_spread < 0:
        raise ValueError("--limit must be positive and --scale-spread at least 0")
    return cases


class Held:
    """E experts held three ways on the GPU, made one expert at a time."""

    def __init__(self, e: int, args: argparse.Namespace, g: torch.Generator) -> None:
        d, i, spread = args.d_model, args.intermediate, args.scale_spread

        def pair(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
            codes = torch.randint(0, 256, (rows, cols // 2), generator=g, device="cuda")
            base = 127 + round(torch.log2(torch.tensor(cols**-0.5 / E2M1_RMS)).item())
            exps = torch.randint(-spread, spread + 1, (rows, cols // FP4_GROUP), generator=g,
                                 device="cuda") + base  # fmt: skip
            return codes.to(torch.uint8), exps.to(torch.uint8).view(torch.float8_e8m0fnu)

        gates = [pair(i, d) for _ in range(e)]
        ups = [pair(i, d) for _ in range(e)]
        downs = [pair(d, i) for _ in range(e)]
        self.fp4 = FP4Experts.from_checkpoint(gates, ups, downs, args.limit)
        blocks = [[fp4_to_fp8_blocks(*p) for p in pairs] for pairs in (gates, ups, downs)]
        self.fp8_inexact = sum(b.inexact for pairs in blocks for b in pairs)
        fp8_pairs = [[b[:2] for b in pairs] for pairs in blocks]
        self.fp8 = FP8Experts.from_checkpoint(*fp8_pairs, "w8a16", args.limit)
        del gates, ups, downs, blocks, fp8_pairs
        self.gate_up = torch.empty(e, 2 * i, d, dtype=torch.bfloat16, device="cuda")
        self.down = torch.empty(e, d, i, dtype=torch.bfloat16, device="cuda")
        for j in range(e):
            self.gate_up[j] = dequantize_expert(
                self.fp4.gate_up_proj[j], self.fp4.gate_up_proj_scale[j]
            )
            self.down[j] = dequantize_expert(self.fp4.down_proj[j], self.fp4.down_proj_scale[j])

    def weights(self) -> tuple[torch.Tensor, ...]:
        f = self.fp4
        return f.gate_up_proj, f.gate_up_proj_scale, f.down_proj, f.down_proj_scale

    def bytes_per_expert(self) -> dict[str, int]:
        """The bytes one expert's weights take in each variant."""
        fp8 = self.fp8
        fp8_scales = fp8.gate_up_proj_scale_inv[0].numel() + fp8.down_proj_scale_inv[0].numel()
        return {
            "w4a16_triton": sum(t[0].numel() for t in self.weights()),
            "w8a16_triton": fp8.gate_up_proj[0].numel() + fp8.down_proj[0].numel() + 4 * fp8_scales,
            "bf16_torch": 2 * (self.gate_up[0].numel() + self.down[0].numel()),
        }


def run_case(t: int, held: Held, args: argparse.Namespace, g: torch.Generator) -> dict:
    e, d, k, limit = held.fp4.n, args.d_model, args.top_k, args.limit
    x = torch.randn(t, d, generator=g, device="cuda").bfloat16()
    idx = torch.rand(t, e, generator=g, device="cuda").topk(k, dim=1).indices
    w = torch.rand(t, k, generator=g, device="cuda") + 0.1
    w = w / w.sum(dim=1, keepdim=True)
    fp4, fp8 = held.weights(), held.fp8
    fp8_weights = (
        fp8.gate_up_proj, fp8.gate_up_proj_scale_inv, fp8.down_proj, fp8.down_proj_scale_inv,
    )  # fmt: skip
    y32 = fp4_moe_ref(x.float(), idx, w, *fp4, limit)
    act = clamped_swiglu(limit)
    fns: dict[str, Callable[[], torch.Tensor]] = {
        "w4a16_triton": lambda: fp4_moe_triton(x, idx, w, *fp4, limit),
        "w8a16_triton": lambda: fp8_moe_triton(x, idx, w, *fp8_weights, "w8a16", limit),
        "bf16_torch": lambda: routed_experts(x, idx, w, held.gate_up, held.down, act),
    }
    touched = int(idx.unique().numel())  # the experts whose weights are read
    per_expert = held.bytes_per_expert()
    rows = fp8_moe.timed_variants(fns, y32, args, lambda v: touched * per_expert[v])
    return {
        "experts": e, "tokens": t, "pairs": t * k, "experts_touched": touched,
        "fp4_tile": fp4_tiles(t * k, e, False)._asdict(), "variants": rows,
    }  # fmt: skip


def run(args: argparse.Namespace) -> int | dict:
    try:
        cases = parse(args)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if not torch.cuda.is_available():
        print("fp4-moe needs a CUDA device (none is available)", file=sys.stderr)
        return 2
    import triton

    g = torch.Generator(device="cuda").manual_seed(args.seed)
    results, inexact = [], {}
    for e in dict.fromkeys(e for e, _ in cases):
        held = Held(e, args, g)
        inexact[e] = held.fp8_inexact
        results += [run_case(t, held, args, g) for e2, t in cases if e2 == e]
        del held
        torch.cuda.empty_cache()
    print(fp8_moe.table(results, VARIANTS))
    return {
        "bench": "fp4-moe",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "d_model": args.d_model,
        "intermediate": args.intermediate,
        "top_k": args.top_k,
        "limit": args.limit,
        "scale_spread": args.scale_spread,
        "fp8_inexact_values": {str(e): n for e, n in inexact.items()},
        "graph": not args.no_graph,
        "inner": args.inner,
        "repeats": args.repeats,
        "routing": "uniform at random, distinct experts per token, weights normalised",
        "error_reference": "fp4_moe_ref of fp32 x: fp32 matmuls on the exact FP4 weights",
        "bandwidth_bytes": "experts touched x (3 I D / 2 codes + 3 I D / 32 exponents), "
        "or x (3 I D e4m3 + fp32 128x128 scales), or x 6 I D for bf16",
        "cases": results,
    }
