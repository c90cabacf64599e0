"""Prefix reuse between worker processes over a real ``dhisparse kv-host-store`` process: a
worker process answers a conversation's first turn, leaves its pages in the store and is
SIGKILLed; a worker in this process, another owner of the same node, imports them for the next
turn over gRPC and gives the tokens of the same prompt served with no cache."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.kv_host_store import KVHostStoreClient
from services.worker.durable.host_link import HostLink
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.request.request import SamplingParams
from tests.kv_host_store.conftest import store_client
from tests.worker.engine.batch_invariant import batch_invariant

ROOT = Path(__file__).resolve().parents[3]
PROMPT = list(range(10, 150))
ANSWER = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

# The first worker: one turn, its answer on stdout, then SIGKILL (nothing released, nothing
# flushed: the cached prefix was handed to the store when the request finished).
FIRST_TURN = """
import json, os, signal, sys
from services.kv_host_store import KVHostStoreClient
from services.worker.request.request import SamplingParams
from tests.worker.engine.batch_invariant import batch_invariant
from tests.worker.serving.test_prefix_reuse_store import PROMPT, ANSWER, engine

client = KVHostStoreClient(sys.argv[1])
w0 = engine(client, "w0", True)
with batch_invariant():
    (req,) = w0.generate([PROMPT], ANSWER)
print(json.dumps([req.output_ids, w0.scheduler.prefix.stats.left]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def engine(client: KVHostStoreClient, owner: str, prefix_cache: bool) -> Engine:
    """A worker of the node whose store ``client`` reaches (registered as ``owner``)."""
    client.wait_ready(30)
    _info, mapping = client.map_arena()
    cfg = EngineConfig(
        model="tiny-glm", mode="hisparse", kv_pool_mib=48, max_num_seqs=4, max_model_len=512,
        owner=owner, prefix_cache=prefix_cache,
    )  # fmt: skip
    e = Engine(cfg, host=(client, mapping))
    HostLink(client, owner, 30.0, e.kv.host_backups).register()
    return e


@pytest.fixture
def client() -> Iterator[KVHostStoreClient]:
    with store_client("prefix") as c:
        yield c


def test_a_killed_workers_prefix_serves_another_worker_of_the_node(
    client: KVHostStoreClient,
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", FIRST_TURN, client.target], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    answer, left = json.loads(done.stdout)
    assert left == 1 and client.stats().prefix_records == 1
    prompt = [*PROMPT, *answer, 3, 1, 4]
    w1 = engine(client, "w1", True)
    ref = engine(client, "ref", False)
    with batch_invariant():
        (turn,) = w1.generate([prompt], ANSWER)
        (want,) = ref.generate([prompt], ANSWER)
    assert turn.output_ids == want.output_ids
    stats = w1.scheduler.prefix.stats
    assert stats.hits == 1 and stats.hit_tokens == (len(PROMPT) + len(answer) - 1) // 16 * 16
    assert w1.stats.prefill_tokens_computed == len(prompt) - stats.hit_tokens
    assert w1.stats.prefill_tokens_computed <= 0.1 * len(prompt)
    assert ref.stats.prefill_tokens_computed == len(prompt)
    assert client.stats().prefix_hits == 1
