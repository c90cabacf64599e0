"""Prefix-affinity routing as pure policy: page keys, the bounded index, and the ranking that
weighs a predicted prefix hit against load (``services.gateway.affinity``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.gateway.affinity import (
    AffinityConfig,
    PrefixAffinity,
    PrefixAffinityRouter,
    load_share,
)
from services.gateway.affinity_index import AffinityIndex, Matched, Place
from services.gateway.prefix_keys import PromptPrefix, chain_keys
from services.gateway.responses import cached_tokens
from services.gateway.routing import AdmissionJob, WorkerStatus

ROOT = Path(__file__).resolve().parents[2]
PAGE = 16
HISTORY = list(range(1000, 1640))  # 40 pages: a conversation so far
TURN = [*HISTORY, 7, 8, 9]  # its next turn


def worker(address: str, store: str = "", **kw: object) -> WorkerStatus:
    fields: dict = {"healthy": True, "max_num_seqs": 32, "page_size": PAGE, "prefix_cache": True}
    fields |= {"kv_store_id": store or f"store-{address}", **kw}
    return WorkerStatus(address=address, **fields)


def job(affinity: PrefixAffinity, tokens: list[int]) -> AdmissionJob:
    return AdmissionJob("r", len(tokens), 16, "m", affinity.prefix(tokens))


def served(affinity: PrefixAffinity, tokens: list[int], w: WorkerStatus) -> None:
    affinity.record(affinity.prefix(tokens).keys(PAGE), w)


# --- keys ------------------------------------------------------------------------------------


def test_keys_name_complete_pages_and_chain_from_the_first() -> None:
    keys = chain_keys(HISTORY, PAGE, 1000)
    assert len(keys) == 40 and len(set(keys)) == 40
    assert chain_keys(HISTORY[:47], PAGE, 1000) == keys[:2]  # a partial page has no key
    assert chain_keys(TURN, PAGE, 1000)[:40] == keys  # a continuation extends them
    changed = [*HISTORY[:5], 1, *HISTORY[6:]]  # one token of the first page differs
    assert not set(chain_keys(changed, PAGE, 1000)) & set(keys)
    assert chain_keys(HISTORY, 8, 1000)[0] != keys[0]  # another page size, other keys
    assert chain_keys(HISTORY, PAGE, 3) == keys[:3]


def test_another_process_computes_the_same_keys() -> None:
    """What another gateway replica computes for the same prompt, whatever its hash seed."""
    code = (
        "from services.gateway.prefix_keys import chain_keys; print(chain_keys(range(64), 16, 8))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=ROOT
    ).stdout
    assert out.strip() == str(chain_keys(list(range(64)), 16, 8))


def test_a_continued_prefix_has_the_keys_of_prompt_and_output() -> None:
    prefix = PromptPrefix(HISTORY[:100], max_pages=1000)
    assert prefix.continued(PAGE, HISTORY[100:300]) == chain_keys(HISTORY[:300], PAGE, 1000)
    assert PromptPrefix(HISTORY[:100], 3).continued(PAGE, HISTORY[100:]) == chain_keys(
        HISTORY, PAGE, 3
    )


# --- the index -------------------------------------------------------------------------------


def test_the_index_forgets_the_least_recently_recorded_pages_past_its_capacity() -> None:
    index = AffinityIndex(capacity=4)
    a, b = Place("a", "s1"), Place("b", "s2")
    index.record([1, 2, 3], a)
    index.record([10, 11], b)
    assert len(index) == 4  # the oldest chain's deepest page went first
    assert index.match([1, 2, 3], [a])["a"].pages == 2
    assert index.match([10, 11], [b])["b"].pages == 2
    index.record([1], a)  # recent again
    index.record([20], b)  # page 2 goes now, not 1
    assert len(index) == 4
    assert index.match([1, 2, 3], [a])["a"].pages == 1
    with pytest.raises(ValueError):
        AffinityIndex(capacity=0)


def test_a_match_reaches_the_deepest_page_its_node_served() -> None:
    index = AffinityIndex(capacity=100, holders=1)
    a, b = Place("a", "s1"), Place("b", "s2")
    index.record([1, 2, 3, 4], a)
    index.record([1], b)  # page 1's only holder is b now; a's store still holds its chain
    found = index.match([1, 2, 3, 4, 5], [a, b])
    assert (found["a"].pages, found["b"].pages) == (4, 1)
    assert index.match([5, 6], [a, b]) == {"a": Matched(), "b": Matched()}


def test_a_page_keeps_its_newest_holders() -> None:
    index = AffinityIndex(capacity=10, holders=2)
    places = [Place(f"w{i}", f"s{i}") for i in range(3)]
    for p in places:
        index.record([5], p)
    found = index.match([5], places)
    assert [found[p.address].pages for p in places] == [0, 1, 1]


def test_a_node_shares_what_any_of_its_workers_served() -> None:
    index = AffinityIndex(capacity=100)
    a, b, c = Place("a", "node1"), Place("b", "node1"), Place("c", "node2")
    index.record([1, 2, 3], a)
    found = index.match([1, 2, 3, 4], [a, b, c])
    assert (found["a"].pages, found["a"].own_pages) == (3, 3)
    assert (found["b"].pages, found["b"].own_pages) == (3, 0)
    assert found["c"].pages == 0
    # a restarted store has a new id: what the old one held does not match
    assert index.match([1], [Place("a", "node1-restarted")])["a"].pages == 0
    # without a store only the worker itself holds what it served
    solo = Place("d")
    index.record([7], solo)
    assert index.match([7], [solo, Place("e")]) == {
        "d": index.match([7], [solo])["d"],
        "e": index.match([], [Place("e")])["e"],
    }
    assert index.match([7], [solo])["d"].pages == 1


# --- ranking ---------------------------------------------------------------------------------


def test_a_prefix_match_beats_a_small_load_difference() -> None:
    affinity = PrefixAffinity()
    router = PrefixAffinityRouter(affinity)
    a, b = worker("a", num_running=4), worker("b", num_running=1)
    served(affinity, HISTORY, a)
    assert router.rank([a, b], (), job(affinity, TURN)) == ["a", "b"]
    # without the history, the least loaded goes first
    assert router.rank([a, b], (), job(affinity, list(range(5, 700)))) == ["b", "a"]


def test_a_heavily_loaded_worker_loses_to_an_idle_one() -> None:
    affinity = PrefixAffinity(AffinityConfig(weight=0.5))
    router = PrefixAffinityRouter(affinity)
    hot = worker("hot", num_running=24, kv_capacity_bytes=100, admitted_bytes=80)
    idle = worker("idle")
    served(affinity, HISTORY, hot)
    assert load_share(hot) == 0.8
    assert router.rank([hot, idle], (), job(affinity, TURN)) == ["idle", "hot"]
    # a heavier weight trades more load for the hit
    heavy = PrefixAffinity(AffinityConfig(weight=1.0))
    served(heavy, HISTORY, hot)
    assert PrefixAffinityRouter(heavy).rank([hot, idle], (), job(heavy, TURN))[0] == "hot"


def test_weight_zero_leaves_affinity_only_the_ties() -> None:
    affinity = PrefixAffinity(AffinityConfig(weight=0.0))
    router = PrefixAffinityRouter(affinity)
    a, b, c = worker("a", num_running=1), worker("b"), worker("c")
    served(affinity, HISTORY, c)
    assert router.rank([a, b, c], (), job(affinity, TURN)) == ["c", "b", "a"]


def test_an_unhealthy_or_excluded_worker_is_never_chosen() -> None:
    affinity = PrefixAffinity()
    router = PrefixAffinityRouter(affinity)
    down = worker("down", healthy=False)
    up = worker("up", num_running=20)
    served(affinity, HISTORY, down)
    served(affinity, HISTORY, up)
    assert router.rank([down, up], (), job(affinity, TURN)) == ["up"]
    assert router.rank([down, up], {"up"}, job(affinity, TURN)) == []
    assert router.pick([down], (), job(affinity, TURN)) is None


def test_a_node_mate_gets_the_hit_and_the_server_itself_breaks_the_tie() -> None:
    affinity = PrefixAffinity()
    router = PrefixAffinityRouter(affinity)
    a, b = worker("a", "node1"), worker("b", "node1")
    c = worker("c", "node2")
    served(affinity, HISTORY, b)
    for _ in range(3):  # whatever the rotation of ties
        assert router.rank([a, b, c], (), job(affinity, TURN)) == ["b", "a", "c"]
    # b is busier: a, on the same node, imports the same prefix
    busy_b = worker("b", "node1", num_running=8)
    assert router.rank([a, busy_b, c], (), job(affinity, TURN))[0] == "a"


def test_workers_without_a_prefix_cache_predict_no_hit() -> None:
    affinity = PrefixAffinity()
    router = PrefixAffinityRouter(affinity)
    a = worker("a", prefix_cache=False, num_running=3)
    b = worker("b")
    served(affinity, HISTORY, a)
    assert router.rank([a, b], (), job(affinity, TURN)) == ["b", "a"]
    assert affinity.predict(affinity.prefix(TURN), [a, b])["a"].pages == 0


def test_the_prediction_leaves_the_last_prompt_token_to_compute() -> None:
    affinity = PrefixAffinity()
    a = worker("a")
    served(affinity, HISTORY, a)
    assert affinity.predict(affinity.prefix(TURN), [a])["a"].pages == len(HISTORY)
    assert affinity.predict(affinity.prefix(HISTORY), [a])["a"].pages == len(HISTORY) - 1


def test_one_admission_matches_each_worker_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's ranking, the shared pages and the routing metric of one admission ask the
    index once per worker; a record in between (a newer index) asks again."""
    affinity = PrefixAffinity()
    a, b, c = worker("a"), worker("b"), worker("c", store="store-a")
    served(affinity, HISTORY, a)
    asked: list[tuple[str, ...]] = []
    match = affinity.index.match

    def counted(keys, places):
        asked.append(tuple(p.address for p in places))
        return match(keys, places)

    monkeypatch.setattr(affinity.index, "match", counted)
    prefix = affinity.prefix(TURN)
    first = affinity.predict(prefix, [a, b])
    assert first["b"].own_pages == 0
    assert affinity.predict(prefix, [b, a]) == first
    assert affinity.predict(prefix, [a, b, c])["c"].pages == len(HISTORY)  # a's node mate
    assert asked == [("a", "b"), ("c",)]
    served(affinity, TURN, b)
    assert affinity.predict(prefix, [a, b])["b"].own_pages == len(HISTORY)
    assert asked[-1] == ("a", "b")


def test_why_a_worker_was_chosen() -> None:
    affinity = PrefixAffinity()
    a, b = worker("a"), worker("b")
    prefix = affinity.prefix(TURN)
    assert affinity.routed(prefix, "a", [a, b]).reason == "load"
    served(affinity, HISTORY, a)
    assert affinity.routed(prefix, "a", [a, b]) == affinity.routed(prefix, "a", [a])
    assert affinity.routed(prefix, "a", [a, b]).reason == "affinity"
    assert affinity.routed(prefix, "a", [a, b]).predicted_tokens == len(HISTORY)
    assert affinity.routed(prefix, "b", [a, b]).reason == "load-over-affinity"
    assert affinity.routed(prefix, "b", [a, b]).predicted_tokens == 0


def test_a_job_without_a_prefix_is_ranked_least_loaded() -> None:
    router = PrefixAffinityRouter(PrefixAffinity())
    a, b = worker("a", num_running=2), worker("b")
    assert router.rank([a, b], ()) == ["b", "a"]
    assert router.rank([a, b], (), AdmissionJob("r", 3, 4)) == ["b", "a"]


def test_cached_tokens_of_a_response_count_each_prompt_once() -> None:
    assert cached_tokens([32], 1) == 32
    assert cached_tokens([32, 16], 2) == 16  # both choices found 16 cached
    assert cached_tokens([32, 32, 0, 16], 2) == 32  # two prompts of two choices each
    assert cached_tokens([], 1) == 0
