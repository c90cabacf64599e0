"""``python -m bench device-run <part>``: one part of the GPU runs, sized for one command of the
device tool (at most 600 s; at most 8 files come back from $OUT). Each step is a ``python -m
bench ...`` (or pytest) process with its own time limit inside the part's budget; a step past
its limit is killed and the part goes on. Results, plots and a short ``table.md`` (the steps'
status and the ratios of the results written) go to ``--out`` (default $OUT); the steps' logs
to ``logs.tgz``.

    main         ``make run``'s defaults end to end on the GPU (``bench defaults``); resolver;
                 constrained decoding's cost (``bench grammar-cost``) and its host share (``grammar-host``);
                 capacity (resident / hisparse / adaptive in lockstep)
    spec         speculation against plain decoding on CUDA graphs: the shipped model's MTP
                 layer, then DFlash2
    spec-scaled  the real-dimension presets at 8K, C = 1 and 16, with their MTP layer at the
                 shipped model's acceptance beside plain decoding (``bench scaled --spec``),
                 attending the shipped model's replayed selections; first a verify
                 round's index scores (``bench verify-scores``) and a profile of a plain
                 step and of a round (``bench profile-step``),
                 one family per step (``--only spec-scaled-v32-scaled``)
    serving      serving at 8K inputs over the engine and over HTTP
    serving-32k  serving at 32K inputs, C up to 256
    tests        the GPU tests (``bench gpu-tests``), then the real-dimension slices against
                 transformers (``bench slices``)
    scaled       the real-dimension DeepSeek-V3.2 and GLM-5.2 per mode at 8K (``bench scaled``)
    scaled-32k   the same at 32K, one session
    scaled-v4    V4's GPU tests (graph replays and FP8 / FP4 weights included), then the
                 real-dimension DeepSeek-V4-Flash (``v4flash-scaled``, 43 layers, 32 experts)
                 per mode at 8K and at 32K, C = 1 and 4, on CUDA graphs, one weight format
                 and context per step (``--only scaled-v4-fp4-8k``): FP8 or FP4 experts on an
                 H100, bf16 (78 GiB of weights) on an H200
    host-layout  host-row gather GB/s against footprint, miss and region count, per layout
    host-layout-serving  a serving step's host recovery through the engine's resolver launches,
                 256 requests over a >= 32 GiB arena, scattered vs grouped placement
    roofline     every kernel of the real-dimension decode step, by region, against its
                 roofline (``bench roofline``): both families at 8K, C = 1, 4, 16, 64,
                 fused and unfused kernels in lockstep
    roofline-prefill  the same for one 8K prompt per family: time to first token vs peak
    load         the load evaluation (``bench load``, issue 45): per family, steps at 32K,
                 100K and 100K past the hierarchy's capacity (and the modes at 32K and 100K
                 with replayed selections, ``-replay``), each sized for one device
                 command of its own (``--only load-v32-scaled-32k``); up to four engines of
                 the plan's pool beside the weights: an H200
    kernels      the fused kernels' GPU tests (ops, graph replays and the hierarchy's bit
                 identity with and without fusion), then the program-shape sweeps of sparse
                 attention and the FP8 projections that set their defaults
    sparse-attention  the sparse attention kernels (tiled, one-pass) side by side at the real
                 decode shapes, over bf16 rows and over packed FP8 rows
    select-topk  the indexer's top-k (torch, bitonic, radix select) side by side at decode
                 shapes
    graph-tests  the CUDA graphs' GPU tests alone (``tests/worker/graphs``)
    adoption     a live peer adopts a SIGKILLed worker's streams: two workers of ``make run``'s
                 GPU defaults sharing the GPU (``bench adoption``)
    prefix       prefix reuse through ``make run``'s stack on the GPU: a 32-session agent
                 trace with and without reuse (``bench agent-trace``), a 30K-token
                 conversation's next turns (``bench prefix-turns``)

In the checkout, first ``python -m bench prepare`` (the GPU machine's copy has no ``.git``),
then run e.g. ``python -m bench device-run main`` there with ``bench/PROVENANCE.json`` carried.
A step that needs the corpus (``data/stdlib.u8``: the trained target's held-out prompts) is
preceded by building it there when it was not carried (``training.target.corpus``, from
that machine's Python standard library; each result records the corpus's SHA-256)."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import ratios
from bench.core import UsageError, provenance

CORPUS = "data/stdlib.u8"
MAX_FILES = 8  # what the device tool brings back from $OUT


@dataclass(frozen=True)
class Step:
    name: str
    command: str  # after ``python``, split as a shell would; "{out}" is the output folder
    timeout_s: float
    corpus: bool = False  # needs CORPUS

    def argv(self, out: Path) -> list[str]:
        return [sys.executable, *shlex.split(self.command.replace("{out}", str(out)))]


# every test marked gpu but the slices, each test's outcome in gpu_tests.json
GPU_TESTS = Step("gpu-tests", "-m bench gpu-tests --out {out}/gpu_tests.json", 420)
# the real-dimension slices against transformers (about 80 s each: 20 GB checkpoints through
# the machine's disk, never $OUT), their figures in slices.json
SLICES = Step(
    "slices",
    "-m bench slices --pytest-args '-s --basetemp=/tmp/dhisparse-slices' --out {out}/slices.json",
    220,
)
FAMILIES = ("v32-scaled", "glm5-scaled")
# the real-dimension models per mode on CUDA graphs, one family per step: at 8K with C = 1, 4;
# at 32K with C = 1 (each mode prefills every timed request twice, warm-up and run, and a 32K
# prefill takes seconds)
# GLM-5.2's hierarchy modes also with their IndexShare followers inline (five engines: private
# host arenas of 12 GiB each fit the machine)
SCALED_8K_ARGS = {
    "v32-scaled": ("v32", ""),
    "glm5-scaled": (
        "glm5",
        " --host-gib 12 --modes resident,hisparse,hisparse:inline,adaptive,adaptive:inline",
    ),
}
SCALED_STEPS = tuple(
    Step(
        f"scaled-{family}",
        f"-m bench scaled --family {family} --contexts 8192 --concurrency 1,4 "
        f"--decode-tokens 32{extra} --out {{out}}/scaled_{short}_8k.json",
        280,
    )
    for family, (short, extra) in SCALED_8K_ARGS.items()
)
SCALED_32K_STEPS = tuple(
    Step(
        f"scaled-32k-{family}",
        f"-m bench scaled --family {family} --contexts 32768 --concurrency 1 "
        f"--decode-tokens 32 --out {{out}}/scaled_32k_{family}.json",
        270,
    )
    for family in FAMILIES
)
# DeepSeek-V4-Flash at real dimensions per mode, one context and weight format per step (C = 1,
# 4), decode passes replayed as CUDA graphs (two warm-up runs: a key is captured at its second
# sighting). Weights: FP8 projections with FP8 routed experts (``fp8``, some 43 GB) or FP4 ones
# (``fp4``, the released form, some 25 GB): either fits an H100 beside the pools; bf16 (78 GiB)
# needs an H200. Per session at 32K (``dhisparse plan --model
# tests/fixtures/configs/deepseek-v4-flash --context 32768 --hot-cache-rows 4096``) 0.238 GiB
# resident, 0.232 GiB in the hierarchy and 0.181 GB of host backups, so the three engines' pools
# take some 3 GiB and the hierarchy engines' 8 GiB host arenas hold every session.
# First V4's GPU tests (every mode against transformers, the hierarchy in bf16 bit for bit, graph
# replays against eager passes, MTP speculation, the FP8 / FP4 weights), the fused FP4 MoE's,
# tiny-dsv4's graph replays, the sparse attention kernels' sinks at V4's shape, the
# hyper-connection kernel's and the tail RoPE's.
V4_TESTS = Step(
    "v4-tests",
    "-m bench gpu-tests tests/worker/model/test_v4_gpu.py "
    "tests/worker/model/test_v4_quantized_gpu.py tests/worker/ops/test_fp4_moe_gpu.py "
    "tests/worker/ops/test_sparse_attention.py tests/worker/ops/test_sparse_attention_onepass.py "
    "tests/worker/graphs/test_cuda_graph.py tests/worker/ops/test_hyper_mix.py "
    "tests/worker/ops/test_rope_tail.py tests/worker/ops/test_index_scores_paged.py "
    "tests/worker/ops/test_norm_rope_gpu.py tests/worker/model/test_v41_candidates.py "
    "tests/worker/ops/test_hyper_streams.py "
    "-k 'v4 or sink or compressed_windowed or fp4 or hyper_mix or hyper_streams or rope_tail "
    "or index_scores or norm_rope' "
    "--out {out}/gpu_tests_v4.json",
    420,
)
SCALED_V4_STEPS = (
    V4_TESTS,
    # V4-Flash's routed experts held in FP4, FP8 and bf16 side by side (``bench fp4-moe``)
    Step("fp4-moe", "-m bench fp4-moe --out {out}/fp4_moe.json", 150),
    # its indexer's fp32 queries: the IEEE dot against three bf16 parts (``bench index-scores``)
    Step("index-scores", "-m bench index-scores --out {out}/index_scores.json", 120),
    *(
        Step(
            f"scaled-v4-{weights}-{short}",
            f"-m bench scaled --family v4flash-scaled --weights {weights} --contexts {ctx} "
            f"--concurrency 1,4 --decode-tokens 32 --warmup-runs 2 --host-gib 8 "
            f"--out {{out}}/scaled_v4flash_{weights}_{short}.json",
            limit,
        )
        for weights in ("fp8", "fp4", "bf16")
        for short, ctx, limit in (("8k", 8192, 220), ("32k", 32768, 310))
    ),
)
# every kernel of the real-dimension decode step against its roofline (``bench roofline``): one
# family per step, resident at 8K, C = 1, 4, 16, 64 admitted in turn (C = 64 prefills 64 8K
# prompts), fused and unfused kernels in lockstep; a C whose prefill would pass the step's
# limit is skipped and said so, the smaller ones already measured
ROOFLINE_STEPS = tuple(
    Step(
        f"roofline-{family}",
        f"-m bench roofline --scaled {family} --mode resident --context 8192 "
        f"--concurrency 1,4,16,64 --variants fused,unfused --time-limit-s 200 "
        f"--out {{out}}/roofline_{family}_8k.json",
        240,
    )
    for family in FAMILIES
)
# one 8K prompt per family and variant: time to first token against the bf16 peak
ROOFLINE_PREFILL_STEPS = tuple(
    Step(
        f"roofline-prefill-{family}",
        f"-m bench roofline --scaled {family} --mode resident --concurrency '' "
        f"--prefill 8192 --variants fused,unfused "
        f"--out {{out}}/roofline_prefill_{family}_8k.json",
        200,
    )
    for family in FAMILIES
)
# the load evaluation, one family and context per step (run one per device command: ``--only``):
# the modes in lockstep at each C (the largest twice: the noise), then adaptive without and
# with MTP under each schedule; 256-token outputs and a 20 s window per variant so that requests
# finish and new ones wait inside it; points past --time-limit-s are skipped and listed. The
# hierarchy engines of a group share one host arena (at most 96 GiB of the machine's 128): a
# session's host rows and keys take about 0.43 GB at 32K and 1.3 GB at 100K (V3.2), so C stays
# where every engine of the group fits; ``-100k-cap`` (resident beside adaptive alone) takes C
# to 56, past V3.2's 50 hierarchy sessions at 100K: sessions held at equal memory (GLM-5.2
# holds 79, whose host rows would need some 112 GB: there C = 56 shows the resident bound only).
LOAD_ARGS = {
    "32k": "--contexts 32768 --concurrency 1,16,64 --spec-concurrency 48 --prefixes 8",
    "100k": "--contexts 100000 --concurrency 1,8,24 --spec-concurrency 12 --prefixes 4",
    "100k-cap": "--contexts 100000 --modes resident,adaptive --spec off --concurrency 56 "
    "--prefixes 4 --duration-s 40",
    # the modes again with the shipped model's selections replayed (``bench/load/replay.py``)
    "32k-replay": "--contexts 32768 --concurrency 1,16,64 --spec off --prefixes 8 "
    "--selections replay",
    "100k-replay": "--contexts 100000 --concurrency 1,8,24 --spec off --prefixes 4 "
    "--selections replay",
}
LOAD_STEPS = tuple(
    Step(
        f"load-{family}-{name}",
        f"-m bench load --family {family} --output-len 256 --duration-s 20 "
        f"--spec off,fixed,paper,online {args} --time-limit-s 440 "
        f"--out {{out}}/load_{family}_{name}.json --plot {{out}}/load_{family}_{name}",
        520,
    )
    for family in FAMILIES
    for name, args in LOAD_ARGS.items()
)
# issue 41's table: the real-dimension presets in adaptive mode at 8K, plain decoding beside
# their MTP layer at widths 2 and 4 and under the online policy (each verify round's acceptance forced
# to the shipped model's, the acceptance control), in lockstep (``bench scaled --spec``); one
# family per step. Each engine prefills every timed request twice (warm-up and run): C = 16 at
# 8K is some 100 prefills.
SPEC_SCALED_STEPS = (
    # a verify round's index scores: the chunk product against the paged decode kernel
    Step("verify-scores", "-m bench verify-scores --out {out}/verify_scores.json", 120),
    # where a round's device time goes against a plain step's (the top kernels, in the log)
    *(
        Step(
            f"profile-{name}-v32-scaled",
            "-m bench profile-step --scaled v32-scaled --modes adaptive --concurrency 1,16 "
            f"--context 8192 --graphs on --selections replay {flags} "
            f"--out {{out}}/profile_{name}_v32_8k.json",
            300,
        )
        for name, flags in (("decode", ""), ("round", "--drafter mtp --spec-width 4"))
    ),
    *(
        Step(
            f"spec-scaled-{family}",
            f"-m bench scaled --family {family} --contexts 8192 --concurrency 1,16 "
            "--decode-tokens 128 --modes adaptive --spec off,fixed:2,fixed:4,online:8 "
            f"--selections replay --host-gib 6 --out {{out}}/spec_scaled_{short}_8k.json",
            540,
        )
        for family, (short, _) in SCALED_8K_ARGS.items()
    ),
)
# the fused kernels: their GPU tests, then the sweeps that set the sparse
# attention's program shapes (``attention_tiles``) and the FP8 projections' (``DEFAULT_TILES``)
KERNEL_STEPS = (
    Step(
        "kernel-tests",
        "-m bench gpu-tests tests/worker/ops tests/worker/graphs "
        "tests/worker/hierarchy/test_hierarchy.py tests/worker/speculative/test_mtp_gpu.py "
        "--out {out}/gpu_tests_kernels.json",
        330,
    ),
    Step(
        "sparse-attention",
        "-m bench sparse-attention --kv bf16 --repeats 10 --out {out}/sparse_attention.json",
        150,
    ),
    Step(
        "fp8-linear",
        "-m bench fp8-linear --m 1,4,16,64 --repeats 15 --out {out}/fp8_linear_sweep.json",
        180,
    ),
)
# the decode step's sparse kernels (issue 40), every variant beside the others in lockstep: the
# sparse attention kernels (tiled and one-pass) over bf16 rows and over packed FP8 rows (gathered
# first, or read in the kernel), each its own step (each compiles a dozen programs); then, a
# part of its own, the indexer's top-k (torch's sort, the bitonic kernel, radix select)
SPARSE_ATTENTION_STEPS = tuple(
    Step(
        f"sparse-attention-{kv}",
        f"-m bench sparse-attention --kv {kv} --repeats 10 --out {{out}}/sparse_attention_{kv}.json",
        270,
    )
    for kv in ("bf16", "fp8")
)
SELECT_TOPK_STEPS = (
    Step("select-topk", "-m bench select-topk --repeats 10 --out {out}/select_topk.json", 420),
)
# `dhisparse up` with no flags on the GPU: the configuration it chose (device, mode, graphs,
# drafter, KV pool), and a worker SIGKILLed mid-stream 3 times losing nothing
DEFAULTS = Step("defaults", "-m bench defaults --out {out}/defaults.json", 200)
# constrained decoding's cost per decode step at C = 64, beside the same batch unconstrained
GRAMMAR_COST = Step(
    "grammar-cost",
    "-m bench grammar-cost --rounds 5 --timeline --out {out}/grammar_cost_gpu.json",
    150,
)
# its host share on the GPU machine's cores: the engine thread's grammar work, no model
GRAMMAR_HOST = Step("grammar-host", "-m bench grammar-host --out {out}/grammar_host_gpu.json", 60)
# the same at real dimensions: DeepSeek-V3.2 (v32-scaled, FP8, random weights built in place),
# whose step costs what a served model's does
GRAMMAR_COST_V32 = Step(
    "grammar-cost-v32",
    "-m bench grammar-cost --model v32-scaled --rounds 5 --kv-pool-mib 4096 --timeline "
    "--out {out}/grammar_cost_v32_gpu.json",
    200,
)
BUILD_CORPUS = Step("corpus", f"-m training.target.corpus --out {CORPUS}", 60)
SERVE = "-m bench serving --modes resident,hisparse,adaptive --quiet"
SERVE_8K = f"{SERVE} --output-len 32 --duration-s 4 --warmup-s 1.5 --input-lens 8192"

PARTS: dict[str, tuple[Step, ...]] = {
    "main": (
        DEFAULTS,
        Step(
            "resolver", "-m bench resolver --out {out}/resolver.json --plot {out}/resolver.png", 100
        ),
        GRAMMAR_COST,
        GRAMMAR_HOST,
        GRAMMAR_COST_V32,
        Step(
            "capacity",
            "-m bench capacity --host-gib 12 --probe-sessions 64 --trace "
            "--out {out}/capacity.json --plot {out}/capacity.png",
            260,
        ),
    ),
    "spec": (
        # the shipped model's own MTP layer (every pass on CUDA graphs), then DFlash2
        Step(
            "spec-mtp",
            "-m bench spec --concurrency 1,4,16,64 --widths '' --drafters mtp,mtp+block "
            "--pool-mib 2048 --warmup-per-client 2 --out {out}/spec_mtp.json "
            "--plot {out}/spec_mtp.png",
            300,
            corpus=True,
        ),
        Step(
            "spec",
            "-m bench spec --concurrency 1,16,64 --widths '' --drafters dflash2 "
            "--out {out}/spec.json --plot {out}/spec.png",
            330,
            corpus=True,
        ),
    ),
    "spec-scaled": SPEC_SCALED_STEPS,
    "serving": (
        Step(
            "serving",
            f"{SERVE_8K} --concurrency 1,4,16,64 --spec-modes adaptive "
            "--spec-concurrency 4,64 --drafters off,dflash,dspark,dflash2 "
            "--schedules fixed,paper,online --time-limit-s 250 --out {out}/serving.json "
            "--plot {out}/serving",
            280,
        ),
        Step(
            "serving-http",
            f"{SERVE_8K} --http --concurrency 1,4,16,64 --drafters off "
            "--time-limit-s 210 --out {out}/serving_http.json --log-dir {out}/logs/stack",
            240,
        ),
    ),
    "serving-32k": (
        # a 32K prefill takes a large share of a second: 128-token outputs and a 16 s window
        # after 6 s of warm-up (the first admissions' prefills) let requests finish inside it
        Step(
            "serving-32k",
            f"{SERVE} --output-len 128 --duration-s 16 --warmup-s 6 "
            "--concurrency 1,16,128,256 --drafters off,dflash --schedules online "
            "--spec-modes adaptive --spec-concurrency 128,256 --input-lens 32768 "
            "--time-limit-s 500 --out {out}/serving_32k.json --plot {out}/serving_32k",
            530,
        ),
    ),
    # a 64 GiB registered arena (about 15 s to set up), then some 700 timed copies
    "host-layout": (
        Step(
            "host-layout",
            "-m bench host-layout --out {out}/host_layout.json --plot {out}/host_layout.png",
            420,
        ),
    ),
    # four arenas of 32-40 GiB in turn (registration about 0.2 s/GiB), 3 cases each with the
    # resolve's and the copy's variants beside them (reads as queued: a sort by address cost
    # more than it gained, archive/08791f3)
    "host-layout-serving": (
        Step(
            "host-layout-serving",
            "-m bench host-layout-serving --no-sorted --variants "
            "--out {out}/host_layout_serving.json",
            360,
        ),
    ),
    "tests": (GPU_TESTS, SLICES),
    "scaled": SCALED_STEPS,
    "roofline": ROOFLINE_STEPS,
    "roofline-prefill": ROOFLINE_PREFILL_STEPS,
    "kernels": KERNEL_STEPS,
    "sparse-attention": SPARSE_ATTENTION_STEPS,
    "select-topk": SELECT_TOPK_STEPS,
    # the CUDA graphs' GPU tests alone (decode and verify replays in every mode, the followers'
    # branch, the draft graphs, the MTP rounds, FP8): a change to the graphs re-runs these
    "graph-tests": (
        Step(
            "graph-tests",
            "-m bench gpu-tests tests/worker/graphs --out {out}/gpu_tests_graphs.json",
            420,
        ),
    ),
    "scaled-32k": SCALED_32K_STEPS,
    "scaled-v4": SCALED_V4_STEPS,
    "load": LOAD_STEPS,
    # issue 46's stall on the GPU: two workers share it, each with a pool of its own
    "adoption": (
        Step(
            "adoption",
            "-m bench adoption --device cuda:0 --kv-pool-mib 8192 --out {out}/adoption.json",
            300,
        ),
    ),
    # prefix reuse through make run's stack on the GPU (the shipped model, plain decoding as
    # make run's GPU default): a 32-session agent trace with and without reuse, then a
    # conversation of a 30K-token history, its next turns' time to first token
    "prefix": (
        Step(
            "agent-trace",
            "-m bench agent-trace --device cuda --drafter none --kv-pool-mib 4096 "
            "--max-model-len 16384 --sessions 32 --concurrency 32 --system 4096 --first 512 "
            "--question 128 --new-tokens 64 --turns 4 --out {out}/agent_trace_gpu.json",
            330,
            corpus=True,
        ),
        # the same kind of trace on DeepSeek-V3.2 at real dimensions (the v32-scaled preset,
        # FP8, random weights built in place), whose prefill costs what a real model's does;
        # one stack at a time (one copy of the model on the device), answers sent back as ids
        Step(
            "agent-trace-v32",
            "-m bench agent-trace --model v32-scaled --device cuda --drafter none --answers ids "
            "--one-stack --kv-pool-mib 16384 --max-model-len 8192 --sessions 32 "
            "--concurrency 32 --system 2048 --first 256 --question 128 --new-tokens 32 "
            "--turns 3 --repeats 2 --host-gib 16 --out {out}/agent_trace_v32_gpu.json",
            540,
            corpus=True,
        ),
        Step(
            "prefix-turns",
            "-m bench prefix-turns --device cuda --drafter none --history 30000 --question 256 "
            "--new-tokens 64 --turns 3 --max-model-len 32768 --kv-pool-mib 8192 "
            "--out {out}/prefix_turns_gpu.json",
            220,
            corpus=True,
        ),
        # the same conversation in resident mode (device pages shared, nothing read from host):
        # beside adaptive's, it tells a turn's host reads from its first compilations
        Step(
            "prefix-turns-resident",
            "-m bench prefix-turns --device cuda --drafter none --mode resident --history 30000 "
            "--question 256 --new-tokens 64 --turns 3 --max-model-len 32768 --kv-pool-mib 8192 "
            "--out {out}/prefix_turns_gpu_resident.json",
            220,
            corpus=True,
        ),
    ),
}


@dataclass(frozen=True)
class Outcome:
    step: str
    status: str  # ok | failed (exit N) | timed out | skipped: ...
    seconds: float


def run_step(step: Step, out: Path, limit_s: float, log: Path) -> Outcome:
    """Runs one step in its own process group; kills the group past ``limit_s``."""
    argv = step.argv(out)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(argv) + "\n")
        f.flush()
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=provenance.ROOT, start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return Outcome(step.name, f"timed out after {limit_s:.0f} s", time.monotonic() - t0)
    status = "ok" if rc == 0 else f"failed (exit {rc})"
    return Outcome(step.name, status, time.monotonic() - t0)


def _tail(path: Path, lines: int) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def report(part: str, outcomes: list[Outcome], out: Path, logs: Path) -> str:
    """``table.md``: where the tree came from, each step's status and time, the GPU tests'
    summary line, and README's rows of the results this part wrote (``bench ratios``)."""
    src = provenance.source()
    lines = [f"# device-run {part}: commit {src['commit'][:12]}"
             + (" (dirty)" if src["dirty"] else "") + f", provenance from {src['source']}", "",
             "| step | status | seconds |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {o.step} | {o.status} | {o.seconds:.0f} |" for o in outcomes]
    tests = logs / f"{GPU_TESTS.name}.log"
    if tests.exists():
        lines += ["", "GPU tests:", "", "```", _tail(tests, 3), "```"]
    rows = ratios.table(out, present_only=True)
    if rows.count("\n") > len(ratios.HEADER):
        lines += ["", rows]
    return "\n".join(lines) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument(
        "--only", default="",
        help="comma-separated step names of any part to run instead of the part's own (the "
        "part names the run's table)",
    )  # fmt: skip
    ap.add_argument("--out", default=os.environ.get("OUT"), help="output folder (default $OUT)")
    ap.add_argument("--budget-s", type=float, default=540, help="the whole part's time")


def run(args: argparse.Namespace) -> int:
    if not args.out:
        raise UsageError("no output folder: give --out or set OUT")
    provenance.check_tree()  # every step would refuse to write its results otherwise
    steps = PARTS[args.part]
    if args.only:
        known = {step.name: step for part in PARTS.values() for step in part}
        names = [n for n in args.only.split(",") if n]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise UsageError(f"no step {', '.join(unknown)}; steps: {', '.join(sorted(known))}")
        steps = tuple(known[n] for n in names)
    if any(s.corpus for s in steps) and not (provenance.ROOT / CORPUS).exists():
        steps = (BUILD_CORPUS, *steps)
    out = Path(args.out).resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    outcomes = []
    for step in steps:
        left = args.budget_s - (time.monotonic() - t0)
        limit = min(step.timeout_s, left)
        if limit < 10:
            outcomes.append(Outcome(step.name, "skipped: the part's budget is spent", 0.0))
            continue
        print(f"== {time.strftime('%H:%M:%S')} {step.name} (at most {limit:.0f} s)", flush=True)
        outcomes.append(run_step(step, out, limit, logs / f"{step.name}.log"))
        print(f"   {outcomes[-1].status}, {outcomes[-1].seconds:.0f} s\n"
              + _tail(logs / f"{step.name}.log", 4), flush=True)  # fmt: skip
    (out / "table.md").write_text(report(args.part, outcomes, out, logs))
    with tarfile.open(out / "logs.tgz", "w:gz") as tar:
        tar.add(logs, arcname="logs")
    shutil.rmtree(logs)  # the archive holds them: fewer files to bring back
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    print((out / "table.md").read_text())
    print(f"{len(files)} files in {out}: {', '.join(files)}")
    if len(files) > MAX_FILES:
        print(f"more than {MAX_FILES} files: the device tool brings back only {MAX_FILES}",
              file=sys.stderr)  # fmt: skip
    return 0 if all(o.status == "ok" for o in outcomes) else 1
