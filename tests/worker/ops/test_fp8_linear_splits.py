"""Split-K of the FP8 matmul summed inside the kernel, under the interpreter, against the torch
form of the same launch (the kernel's partials summed by ``out.sum(dim=0)``, then bias, then
cast): bit for bit, for several (M, N, K, splits, bias, mode, x dtype, K step); the arrival
counters are zero after every call. The interpreter runs the programs one after another, so
this checks the arithmetic and the counter protocol (last arriver sums, resets); the GPU test
(``test_fp8_linear_splits_gpu.py``) checks them with programs running concurrently.

Every launch is also compared with ``sum_splits_ref``, the split order written out one add at
a time. torch's ``sum(dim=0)`` adds in that order up to 4 terms (checked here first): its
loops keep up to 4 accumulators, on the CPU as in its CUDA reduction; with more terms it
regroups them in ways that depend on the shape, so there the comparison is with
``sum_splits_ref`` alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from services.worker.ops.arrivals import CAPACITY
from services.worker.ops.fp8_linear import (
    fp8_linear_partials,
    fp8_linear_ref,
    fp8_linear_triton,
)
from services.worker.ops.fp8_linear_splits import k_splits, split_blocks, sum_splits_ref
from services.worker.ops.fp8_linear_tiles import DEFAULT_TILES, Tiles, launch_block_m, tiles_for
from tests.worker.ops.fp8_linear_cases import EPS32, assert_within, bound, make_case

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[3]

# (M, N, K, splits asked, bias, mode, x dtype, tiles); tiles None: the interpreter's default.
# Small tiles give several output tiles, so several counters; K 600 and 700 end ragged.
NARROW = Tiles(16, 32, 1, 1, split_programs=1)
NARROW2 = Tiles(16, 32, 1, 1, split_programs=1, k_step=2)
CASES = [
    (1, 200, 1000, 3, True, "w8a16", torch.bfloat16, None),
    (5, 80, 1000, 8, False, "w8a8", torch.float32, None),
    (17, 130, 700, 2, True, "w8a16", torch.float16, NARROW2),
    (40, 80, 600, 5, True, "w8a16", torch.float32, NARROW),
    (2, 304, 1500, 5, False, "w8a8", torch.bfloat16, NARROW2),
    (33, 96, 512, 4, True, "w8a8", torch.float16, NARROW),
    (3, 64, 2300, 18, True, "w8a16", torch.float32, None),
]


def own_counters() -> torch.Tensor:
    """A zeroed counter buffer of this test's own (the device's is shared)."""
    return torch.zeros(CAPACITY, dtype=torch.int32)


TORCH_IN_ORDER = 4  # torch's sum(dim=0) adds up to this many terms in order


def test_torch_sum_adds_up_to_4_terms_in_order() -> None:
    g = torch.Generator().manual_seed(0)
    for s, m, n in ((2, 5, 72), (3, 1, 200), (4, 17, 130), (4, 40, 33), (4, 1, 576)):
        p = torch.randn(s, m, n, generator=g) * torch.exp(4 * torch.randn(s, 1, 1, generator=g))
        assert torch.equal(p.sum(dim=0), sum_splits_ref(p, None, torch.float32))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_fused_split_sum_equals_the_torch_sum_bit_for_bit(case: int) -> None:
    m, n, k, splits, with_bias, mode, x_dtype, tiles = CASES[case]
    x, w_fp8, scale, bias = make_case(100 + case, m, n, k, "F32", x_dtype)
    b = bias.to(x_dtype) if with_bias and case % 2 else (bias if with_bias else None)
    counters = own_counters()
    kw = {"splits": splits, "tiles": tiles}
    fused = fp8_linear_triton(x, w_fp8, scale, b, mode, sum_splits=True, counters=counters, **kw)
    assert not counters.any(), "the last arriver resets its tile's counter"
    part = fp8_linear_partials(x, w_fp8, scale, mode, **kw)
    assert part.shape[0] > 1 and fused.dtype == x_dtype and fused.shape == (m, n)
    assert torch.equal(fused, sum_splits_ref(part, b, x_dtype))
    if part.shape[0] <= TORCH_IN_ORDER:
        torch_sum = fp8_linear_triton(x, w_fp8, scale, b, mode, sum_splits=False, **kw)
        assert torch.equal(fused, torch_sum)
    y_ref = fp8_linear_ref(x, w_fp8, scale, b, mode)
    assert_within(fused, y_ref, bound(x, w_fp8, scale, mode, y_ref, (k + 16) * EPS32))


def test_counters_stay_zero_over_repeated_calls() -> None:
    x, w_fp8, scale, bias = make_case(7, 20, 72, 700, "F32", torch.bfloat16)
    counters = own_counters()
    first = fp8_linear_triton(x, w_fp8, scale, bias, splits=3, tiles=NARROW, sum_splits=True,
                              counters=counters)  # fmt: skip
    for _ in range(2):
        again = fp8_linear_triton(x, w_fp8, scale, bias, splits=3, tiles=NARROW,
                                  sum_splits=True, counters=counters)  # fmt: skip
        assert torch.equal(again, first) and not counters.any()


def test_two_scale_blocks_per_iteration_change_nothing() -> None:
    """K_STEP 2 adds the blocks one by one in K order as K_STEP 1 does, a missing second block
    (5 blocks: K 600) included: the same bits."""
    for mode in ("w8a16", "w8a8"):
        x, w_fp8, scale, bias = make_case(9, 18, 72, 600, "F32", torch.float32)
        one = fp8_linear_triton(x, w_fp8, scale, bias, mode, splits=1, tiles=NARROW)
        two = fp8_linear_triton(x, w_fp8, scale, bias, mode, splits=1, tiles=NARROW2)
        assert torch.equal(one, two)


def test_splits_and_tiles_are_functions_of_the_shape() -> None:
    assert k_splits(9, 56, interpret=False) == 30 and k_splits(300, 56, interpret=False) == 1
    assert k_splits(9, 3, interpret=False) == 3 and k_splits(9, 56, interpret=True) == 1
    assert k_splits(9, 56, interpret=False, programs=528) == 56
    assert split_blocks(56, 30, 1) == (28, 2) and split_blocks(5, 5, 2) == (3, 2)
    assert split_blocks(12, 5, 2) == (3, 4) and split_blocks(7, 1, 2) == (1, 8)
    for m, bound_m in ((1, 16), (16, 16), (17, 32), (64, 64), (65, 128), (4096, 128)):
        t = tiles_for(m, interpret=False)
        assert launch_block_m(t, m) == bound_m
        assert t == next(tiles for top, tiles in DEFAULT_TILES if m <= top)
    assert all(t.split_programs <= CAPACITY for _, t in DEFAULT_TILES)
    assert tiles_for(3, interpret=True).split_programs == 1
    assert Tiles(16, 64, 4, 4, 264, 2).label() == "n64w4s4p264k2"


def test_contract_errors() -> None:
    with pytest.raises(ValueError, match="power of two"):
        Tiles(16, 48, 4, 4)
    with pytest.raises(ValueError, match="k_step"):
        Tiles(16, 64, 4, 4, k_step=3)
    with pytest.raises(ValueError, match="split_programs"):
        Tiles(16, 64, 4, 4, split_programs=CAPACITY + 1)
    x, w_fp8, scale, _ = make_case(0, 40, 72, 600, "F32", torch.float32)
    small = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="at least 9 int32"):
        fp8_linear_triton(x, w_fp8, scale, splits=2, tiles=NARROW, sum_splits=True,
                          counters=small)  # fmt: skip
    with pytest.raises(ValueError, match="int64"):
        fp8_linear_triton(x, w_fp8, scale, splits=2, tiles=NARROW, sum_splits=True,
                          counters=small.long())  # fmt: skip


def compile_for_sm90(tiles: Tiles) -> dict[str, bool]:
    """What the fused split-K kernel compiled for sm_90 (Triton's compiler and ptxas, no GPU)
    contains, with pointers and row strides 16-aligned as the launches' are. Runs outside
    the interpreter (``test_kernel_compiles_for_sm90`` calls it in a subprocess)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from services.worker.ops.fp8_linear_kernel import fp8_linear_kernel as kernel

    names = kernel.arg_names
    pointers = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
                "bias_ptr": "*fp32", "y_ptr": "*bf16", "part_ptr": "*fp32",
                "counter_ptr": "*i32"}  # fmt: skip
    unit = ("stride_xk", "stride_wk", "stride_wsk", "stride_yn", "stride_pn")
    consts = {
        "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": 128,
        "K_STEP": tiles.k_step, "SPLIT": True, "SUM_SPLITS": True, "A8": False,
        "HAS_BIAS": True, "DOT_DTYPE": tl.bfloat16, "PREC": "ieee", **dict.fromkeys(unit, 1),
    }  # fmt: skip
    aligned = [*pointers, "stride_xm", "stride_wn", "stride_ym", "stride_ps", "stride_pm", "K"]
    src = ASTSource(
        fn=kernel,
        signature={n: pointers.get(n, "constexpr" if n in consts else "i32") for n in names},
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )  # fmt: skip
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32),
        options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages},
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    return {
        "pipelined": "async_copy_global_to_local" in compiled.asm["ttgir"],
        "acq_rel_ticket": "atom.global.gpu.acq_rel.add" in ptx and "bar.sync" in ptx,
        "partials_past_l1": "ld.global.cg" in ptx,
    }


@pytest.mark.parametrize("tiles", [Tiles(16, 64, 4, 4), Tiles(64, 128, 8, 3, 528, 2)])
def test_kernel_compiles_for_sm90(tiles: Tiles) -> None:
    """Without a GPU: the kernel compiles for sm_90, its K loop is software-pipelined
    (asynchronous copies), the ticket is a gpu-scope acq_rel atomic after a CTA barrier and
    the partials are read past L1."""
    code = (
        "import json; from services.worker.ops.fp8_linear_tiles import Tiles; "
        "from tests.worker.ops.test_fp8_linear_splits import compile_for_sm90; "
        f"print(json.dumps(compile_for_sm90({tiles!r})))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    if proc.returncode != 0 and "ptxas" in proc.stderr:
        pytest.skip(f"no ptxas for sm_90 here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found == dict.fromkeys(found, True) and len(found) == 3, found
