"""Where the host is while a decode step's graph runs: per mode and concurrency, the median
time (ms from the step's start, over ``--steps`` steps) at which each phase of
``Engine.step`` begins and ends, the replayed graph's device time, and the step's wall time.

    python -m bench step-timeline --modes resident,hisparse,adaptive --concurrency 1,4,16

A replayed decode step is: host work up to the launch (maintain, schedule, the batch, the
hierarchy's plans), the graph on the device, and the host's wait for the sampled tokens; the
commit runs on the host while the device works. Whatever the host does before ``replay>`` is
time the device sits idle, so a mode's overhead over resident serving shows up as a later
launch. Uses the capacity benchmark's model (``bench-glm``) on a CUDA device; ``--out`` writes
the medians as a result JSON.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.core.model import bench_model_config
from bench.core.output import write_result
from bench.core.steps import steady_engine
from bench.core.timeline import Timeline, medians
from dhisparse.tokenizer import ByteTokenizer
from services.worker.weights.model_io import build_model


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--modes", default="resident,hisparse,adaptive")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pool-gib", type=float, default=8.0)
    ap.add_argument("--out", default=None, help="result JSON of the medians")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    model = build_model(bench_model_config(8, 512), seed=0, device="cuda", dtype=torch.bfloat16)
    cs = [int(c) for c in args.concurrency.split(",")]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (args.context,), generator=g).tolist() for _ in range(max(cs))]
    tl = Timeline()
    tl.wrap_replay()
    tl.wrap_build()
    print(f"# step-timeline --modes {args.modes} --concurrency {args.concurrency}")
    print(
        f"# {torch.cuda.get_device_name()}; {args.context}-token contexts; "
        f"median ms of {args.steps} steps"
    )
    table = []
    for mode in args.modes.split(","):
        for c in cs:
            eng = steady_engine(
                mode, prompts[:c], args.context, args.pool_gib, model=model,
                tokenizer=ByteTokenizer(), device="cuda",
            )  # fmt: skip
            for _ in range(10):  # graphs captured, hot caches warm
                eng.step()
            tl.wrap(eng.kv, "maintain", "maintain")
            tl.wrap(eng.scheduler, "schedule", "schedule")
            tl.wrap(eng.kv, "begin", "plans")
            tl.wrap(eng.kv, "commit", "commit")
            rows = []
            for _ in range(args.steps):
                torch.cuda.synchronize()
                tl.marks.clear()
                tl.stamp("step>")
                eng.step()
                tl.stamp("<step")
                torch.cuda.synchronize()
                t0 = tl.marks[0][1]
                row = {k: (t - t0) * 1e3 for k, t in tl.marks}
                assert tl.events is not None, "no replay: the step ran eagerly"
                row["graph on device"] = tl.events[0].elapsed_time(tl.events[1])
                rows.append(row)
            med = medians(rows)
            device = med.pop("graph on device")
            order = sorted(med.items(), key=lambda kv: kv[1])
            print(
                f"{mode:9s} C={c:<3d} step {med['<step']:.2f} ms, graph on device {device:.2f}: "
                + "  ".join(f"{k} {v:.2f}" for k, v in order if k not in ("step>", "<step"))
            )
            table.append({"mode": mode, "concurrency": c, "step_ms": med["<step"],
                          "graph_on_device_ms": device, "marks_ms": dict(order)})  # fmt: skip
            eng.close()
            del eng
            torch.cuda.empty_cache()
    if args.out:
        doc = {"benchmark": "step-timeline", "machine": torch.cuda.get_device_name(),
               "context": args.context, "steps": args.steps, "rows": table}  # fmt: skip
        print(f"wrote {write_result(doc, args.out)}")
    return 0
