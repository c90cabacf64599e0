"""Garbage-collector work per serving mode: each mode's engine (the capacity benchmark's model,
contexts and KV budget, ``bench/capacity.py``) serves C requests to the end after the heap is
frozen as a worker freezes it; the collections it set off, per generation, and their pauses
are printed. It counts Python objects, not device work, so a CPU run at toy sizes shows what
the hot path allocates:

    python bench/gc_pauses.py --device cpu --context 1024 --decode-tokens 48 --concurrency 24 \
        --layers 2 --k 64 --hot-cache-rows 128 --page 16 --host-gib 1
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench.capacity as cap
from services.worker.engine.heap import GcPauses, freeze_heap


def main() -> int:
    args = cap.parse_args(["--modes", "hisparse,adaptive", "--probe-sessions", "0", *sys.argv[1:]])
    c = max(args.concurrency)
    _, _, budget, prompts = cap.setup(args)
    params = cap.SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    print(f"C = {c}: collections per generation (0, 1, 2), pause seconds per generation")
    for mode in args.modes.split(","):
        eng, _, _ = cap.build_engine(mode, args, budget)
        freeze_heap()
        for i in range(c):
            eng.add_request(f"r{i}", prompts[i], params)
        with GcPauses() as pauses:
            while eng.has_work():
                eng.step()
        seconds = ", ".join(f"{s:.4f}" for s in pauses.seconds)
        print(f"{mode:9s} collections {pauses.count}  pauses [{seconds}]")
        eng.close()
        gc.unfreeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())
