"""What a refill costs when it runs: the capacity benchmark's adaptive engine at one
concurrency (16K-token contexts, the same KV budget), with every ``restore`` (the host -> device
refill copy) timed twice, host time to return and time to complete (synchronised), and each
step that queued a refill or took over 40 ms printed.

    python bench/refill_probe.py --concurrency 48

Session 7 used it to find a first refill that built its copy kernel mid-run (217 ms of host
time, against 0.15-0.3 ms for each later refill of 12,928 rows)."""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench.capacity as cap
from dhisparse.tokenizer import ByteTokenizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--overlap-refills", action="store_true")
    a = ap.parse_args()
    args = types.SimpleNamespace(
        context=16384, decode_tokens=256, concurrency=[a.concurrency], resident_sessions=4,
        layers=8, k=512, hot_cache_rows=1024, page=64, host_gib=12, probe_sessions=0,
        device="cuda", eager=False, overlap_refills=a.overlap_refills, graph_capture="second",
        populate_payback=1.0,
    )  # fmt: skip
    cfg = cap.bench_model_config(args.layers, args.k)
    cap.TOKENIZER = ByteTokenizer()
    cap.MODEL = cap.build_model(cfg, seed=0, device="cuda", dtype=torch.bfloat16)
    per = cap.bytes_per_token(cfg, 2, payload=True)
    budget = int(4 * (args.context + args.decode_tokens + 16) * per * 1.02)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 256, (args.context,), generator=g).tolist() for _ in range(a.concurrency)
    ]
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
    for i in range(a.concurrency):
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
