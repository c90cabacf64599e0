"""``dhisparse generate --tensor-parallel-size 2`` as real processes on the CPU (gloo): several
prompts print one process's tokens and the command exits 0. Rank 0 releases the followers when
its work is done, so a follower may exit 0 before rank 0 does: the supervisor reads that as the
group ending, not as a death."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.generate import add_arguments, run
from services.worker.group import launch
from services.worker.request.request import SamplingParams
from services.worker.settings import WorkerSettings

PROMPTS = ("The sparse indexer", "picks rows", "of the history")
FLAGS = ("--model", "tiny-glm", "--device", "cpu", "--kv-pool-mib", "48", "--max-model-len", "512",
         "--max-num-seqs", "4", "--max-tokens", "8", "--ignore-eos")  # fmt: skip
RANK0_TAIL_S = 2.0  # rank 0 lingers this long after releasing the followers


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([*FLAGS, *(a for t in PROMPTS for a in ("--prompt", t))])


def _one_process() -> list[list[int]]:
    eng = Engine(EngineConfig(model="tiny-glm", kv_pool_mib=48, max_model_len=512, max_num_seqs=4))
    tok = eng.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [tok.encode_prompt(t) for t in PROMPTS]
    return [r.output_ids for r in eng.generate(prompts, params)]


def slow_leader(settings: WorkerSettings, comm, args: argparse.Namespace) -> int:
    """``generate.generate_rank`` with a slow end: the followers, released, exit before it."""
    engine = Engine(settings.engine_config(comm.rank), comm=comm)
    try:
        return run(args, engine)
    finally:
        engine.group.stop()
        time.sleep(RANK0_TAIL_S)
        engine.close()


def test_followers_released_before_rank_0_ends_are_no_death() -> None:
    args = _args()
    settings = WorkerSettings(model="tiny-glm", device="cpu", kv_pool_mib=48, max_model_len=512,
                              max_num_seqs=4, tensor_parallel_size=2, metrics_port=0)  # fmt: skip
    assert launch(settings, slow_leader, args) == 0


def test_generate_over_two_ranks_prints_every_prompt_and_exits_0() -> None:
    argv = [sys.executable, "-m", "dhisparse.cli", "generate", *FLAGS, "--json",
            "--tensor-parallel-size", "2", *(a for t in PROMPTS for a in ("--prompt", t))]  # fmt: skip
    r = subprocess.run(
        argv, capture_output=True, text=True, timeout=180, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    outs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [o["prompt"] for o in outs] == list(PROMPTS)
    assert [o["token_ids"] for o in outs] == _one_process()
