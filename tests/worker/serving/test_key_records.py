"""The hierarchy's index keys shared on the device (``serving.key_records``): a request that
imports a cached prefix on the worker that left it seats the cached key pages instead of
bringing its keys back from the host, with the keys a worker without them restores from the
host, bit for bit, and the uncached greedy tokens; the pages count as optional memory and give
way to any take from the pool."""

from __future__ import annotations

import pytest
import torch

from dhisparse.family.presets import preset_topology
from services.kv_host_store.prefix_index import page_hashes
from services.worker.engine.engine import Engine
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.request.request import SamplingParams
from services.worker.serving.key_records import KeyRecords, keys_unshareable
from tests.worker.engine.batch_invariant import batch_invariant
from tests.worker.serving.test_prefix_reuse import make, run, second_turn

FIRST = [(7 * i + 10) % 250 for i in range(320)]  # completes key pages of the shared pool


@pytest.fixture
def store():
    s = LocalHostStore(64 << 20)
    yield s
    s.close()


def spy_keys(engine: Engine) -> list[dict]:
    """Per adoption ``engine.kv`` seats: the key pages it was handed shared, the slot's first
    key pages after it, and the slot's keys of the imported tokens by producer layer."""
    kv, seen = engine.kv, []
    adopt = kv.adopt

    def spied(slot, request_id, regions, num_tokens, rings, max_tokens=None, shared_keys=None):
        ok = adopt(slot, request_id, regions, num_tokens, rings, max_tokens, shared_keys)
        if ok:
            slots, n = torch.tensor([slot]), torch.tensor([num_tokens])
            seen.append({
                "shared": shared_keys or {},
                "pages": {i: p.slot_pages(slot, len((shared_keys or {}).get(i, [])))
                          for i, p in kv.index_keys.pools.items()},
                "keys": {i: kv.index_keys.gather(i, slots, n, num_tokens)
                         for i in kv.index_keys.pools},
            })  # fmt: skip
        return ok

    kv.adopt = spied  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize(
    "mode,kv_cache_dtype", [("hisparse", "auto"), ("adaptive", "auto"), ("adaptive", "fp8")]
)
def test_the_leavers_worker_shares_its_key_pages_with_the_hosts_keys(
    store: LocalHostStore, mode: str, kv_cache_dtype: str
) -> None:
    kw = dict(mode=mode, kv_cache_dtype=kv_cache_dtype)
    with batch_invariant():
        w0 = make(store, "w0", **kw)
        first = run(w0, FIRST)
        prompt = second_turn(first, [7, 8, 9, 10, 11])
        records = w0.scheduler.prefix.key_records
        assert isinstance(records, KeyRecords) and len(records.records) == 1
        seen0 = spy_keys(w0)
        turn = run(w0, prompt)  # the leaver's worker: its key pages
        w1 = make(store, "w1", **kw)
        seen1 = spy_keys(w1)
        other = run(w1, prompt)  # another worker of the node: every key from the host
        ref = run(make(store, "ref", prefix_cache=False, **kw), prompt)
    assert turn.output_ids == other.output_ids == ref.output_ids
    assert w0.scheduler.prefix.stats.keys_shared == 1 and w1.scheduler.prefix.stats.keys_shared == 0
    assert turn.computed == other.computed < 0.1 * len(prompt)
    # the leaver's worker reports the tokens whose key pages it shares (the gateway settles on
    # them); the other shares none
    cached = turn.output().cached_prompt_tokens
    assert 320 <= turn.output().shared_prompt_tokens <= cached
    assert other.output().shared_prompt_tokens == 0 < other.output().cached_prompt_tokens
    (mine,), (theirs,) = seen0, seen1
    assert any(mine["shared"].values()) and not any(theirs["shared"].values())
    assert mine["pages"] == mine["shared"]  # seated as its first pages, not copied
    for layer, keys in mine["keys"].items():
        assert torch.equal(keys, theirs["keys"][layer])


def test_cached_key_pages_are_optional_memory_and_give_way(store: LocalHostStore) -> None:
    """After a request leaves, its key pages count as optional (eq. 3), not required; when the
    pool runs short, takes drop the records, least recently used first, and every request is
    still served with its uncached tokens."""
    w = make(store, "w0", mode="hisparse", kv_pool_mib=16, max_num_seqs=2)
    records = w.scheduler.prefix.key_records
    idle = w.kv.memory()
    run(w, FIRST)
    left = w.kv.memory()
    assert len(records.records) == 1
    assert left.optional > idle.optional and left.required == idle.required
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[(n + 3 * i) % 250 for n in FIRST] for i in range(1, 12)]  # distinct: no hit
    for p in prompts:
        run(w, p, params)
    assert records.records.evictions > 0
    ref = make(store, "ref", prefix_cache=False, mode="hisparse", kv_pool_mib=16, max_num_seqs=2)
    assert run(w, prompts[0], params).output_ids == run(ref, prompts[0], params).output_ids


def test_models_of_compressed_key_sources_keep_no_key_records() -> None:
    assert keys_unshareable(preset_topology("tiny-glm")) is None
    assert keys_unshareable(preset_topology("tiny-dsv4")) is not None


def test_a_record_keeps_the_pages_its_tokens_complete(store: LocalHostStore) -> None:
    """A record of T tokens holds the key pages before T (before T - 1 for a lagged source),
    and a reader of fewer tokens shares the pages before its own end."""
    w = make(store, "w0", mode="hisparse")
    run(w, FIRST)
    records = w.scheduler.prefix.key_records
    salt = w.scheduler.prefix.salt
    tokens = len(FIRST) // salt.page_size * salt.page_size
    ids = FIRST[:tokens]
    hashes = page_hashes(salt, ids)
    for layer, pool in w.kv.index_keys.pools.items():
        pages, covered = records.shared(hashes, ids, tokens)
        full = pages[layer]
        assert len(full) == tokens // pool.page_size > 0 and covered == tokens
        fewer = pool.page_size + salt.page_size
        pages, covered = records.shared(hashes, ids, fewer)
        assert pages[layer] == full[:1] and covered == fewer // records.page * records.page
