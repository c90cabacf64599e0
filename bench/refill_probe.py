"""What a refill costs when it runs: the capacity benchmark's adaptive engine at one
concurrency (its model, contexts and KV budget: ``bench/capacity.py``), with every ``restore``
(the host -> device refill copy) timed twice, host time to return and time to complete
(synchronised), and each step that queued a refill or took over 40 ms printed.

    python bench/refill_probe.py --concurrency 48

Session 7 used it to find a first refill that built its copy kernel mid-run (217 ms of host
time, against 0.15-0.3 ms for each later refill of 12,928 rows)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench.capacity as cap


def main() -> int:
    # the capacity benchmark's flags (--concurrency, --overlap-refills, ...), its defaults
    # but for the host arena of the committed runs
    args = cap.parse_args(["--host-gib", "12", "--modes", "adaptive", *sys.argv[1:]])
    c = max(args.concurrency)
    _, _, budget, prompts = cap.setup(args)
    eng, _, _ = cap.build_engine("adaptive", args, budget)
    params = cap.SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    eng.generate(prompts[:2], params)  # the capacity benchmark's warm-up
    p, res = eng.kv.payload, eng.kv.payload.residency
    calls: list[tuple[int, float, float]] = []  # rows, host ms, completed ms
    restore = p.restore

    def timed(*x) -> None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        restore(*x)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        calls.append((x[1].numel(), 1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t0)))

    p.restore = timed
    for i in range(c):
        eng.add_request(f"r{i}", prompts[i], params)
    step = 0
    print("step  running  decode ms  pages queued  restores (rows, host ms, done ms)")
    while eng.has_work():
        queued, seen, d0 = res.stats.refill_pages, len(calls), eng.stats.decode_s
        eng.step()
        torch.cuda.synchronize()
        step += 1
        ms = 1e3 * (eng.stats.decode_s - d0)
        if res.stats.refill_pages != queued or ms > 40:
            rows = ", ".join(f"({n}, {h:.2f}, {d:.2f})" for n, h, d in calls[seen:])
            print(
                f"{step:4d}  {eng.num_running:7d}  {ms:9.1f}  "
                f"{res.stats.refill_pages - queued:12d}  {rows}"
            )
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
