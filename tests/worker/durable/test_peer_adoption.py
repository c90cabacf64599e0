"""A live peer of the node takes one session over (``adopt_session``): the engine of another
owner id, running its own requests, adopts a session of a "dead" engine (dropped without
releasing anything) and continues it token for token, computing no prompt token; a peer of
another salt is refused before anything moves; a peer without room hands the session back for
the next adopter; the async engine's ``adopt`` catches the caller up from what it received; a
session drained right after its first manifest, in a manifest region a finished request used,
is adopted as itself; a drain hands over only what the client has tokens of."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from services.worker.async_engine import AsyncEngine, SessionsHandedOver
from services.worker.durable.adoption import AdoptFrom, NotAdopted, adopt_session
from services.worker.durable.host_link import HostLink
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.prefix_setup import prefix_salt
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.hierarchy.session import MANIFEST_SOURCE
from services.worker.request.request import Request, SamplingParams

PROMPT = list(range(10, 50))
LONG = [7 + i % 90 for i in range(96)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=60, ignore_eos=True)


@pytest.fixture
def store():
    s = LocalHostStore(64 << 20)
    yield s
    s.close()


def make(
    store: LocalHostStore,
    owner: str,
    max_num_seqs: int = 4,
    salt: str | None = None,
    model: str = "tiny-glm",
    **kw,
) -> tuple[Engine, HostLink]:
    kw = {"kv_pool_mib": 48, **kw}
    cfg = EngineConfig(
        model=model, mode="hisparse", max_num_seqs=max_num_seqs, max_model_len=512,
        owner=owner, **kw,
    )  # fmt: skip
    engine = Engine(cfg, host=(store, store.mapping))
    salt = prefix_salt(cfg, engine.kv).root() if salt is None else salt
    link = HostLink(store, owner, 30.0, engine.kv.host_backups, salt)
    link.register()
    return engine, link


def adopt(engine: Engine, link: HostLink, store, rid: str, source=AdoptFrom(), **kw) -> Request:
    return adopt_session(engine, store, link.owner, link.generation, rid, source, **kw)


FENCE_A = AdoptFrom("wA", fence=True)


@pytest.mark.parametrize(
    "model,params",
    [("tiny-glm", GREEDY), ("tiny-glm", SEEDED), ("tiny-dsv4", SEEDED)],
    ids=["greedy", "seeded", "dsv4-rings"],
)
def test_a_peer_continues_a_dead_workers_session_token_for_token(store, model, params) -> None:
    """tiny-dsv4 has compressed, windowed sources: their token rings come from the manifest."""
    ref, _ = make(store, "ref", model=model)
    (want,) = ref.generate([PROMPT], [params])
    del ref
    dead, _ = make(store, "wA", model=model)
    dead.add_request("r0", PROMPT, params)
    for _ in range(20):
        dead.step()
    del dead  # SIGKILLed: nothing released, its lease still runs
    peer, link = make(store, "wB", model=model)
    peer.add_request("own", list(range(60, 80)), GREEDY)  # the peer serves its own request
    peer.step()
    computed = peer.stats.prefill_tokens_computed
    req = adopt(peer, link, store, "r0", FENCE_A)
    assert len(req.output_ids) == 20
    while peer.has_work():
        peer.step()
    assert req.output_ids == want.output_ids
    assert peer.stats.prefill_tokens_computed == computed  # the adopted prompt: none of it
    peer.kv.host_backups.flush()
    assert store.stats().requests == 0  # both finished: released
    assert (store.stats().adoptions, store.stats().owners_fenced) == (1, 1)


def test_a_peer_of_another_salt_is_refused_and_nothing_moves(store) -> None:
    dead, _ = make(store, "wA")
    dead.add_request("r0", PROMPT, GREEDY)
    dead.step()
    del dead
    other, link = make(store, "wB", salt="another model")
    with pytest.raises(NotAdopted, match="another model or KV layout") as e:
        adopt(other, link, store, "r0", FENCE_A)
    assert e.value.code == "failed_precondition"
    (info,) = store.list_requests()
    assert info.owner == "wA"
    assert not other.has_request("r0")
    with pytest.raises(NotAdopted) as missing:
        adopt(other, link, store, "nope")
    assert missing.value.code == "not_found"


def test_a_peer_without_room_hands_the_session_back(store) -> None:
    dead, _ = make(store, "wA")
    dead.add_request("r0", PROMPT, GREEDY)
    for _ in range(5):
        dead.step()
    del dead
    full, link = make(store, "wB", max_num_seqs=1)
    full.add_request("own", list(range(60, 80)), GREEDY)
    full.step()
    with pytest.raises(NotAdopted, match="no free slot") as e:
        adopt(full, link, store, "r0", FENCE_A, hand_back=True)
    assert e.value.code == "resource_exhausted"
    (info,) = [i for i in store.list_requests(adoptable_only=True) if i.request_id == "r0"]
    assert info.owner == "wB"  # handed back: adoptable, by the next one with room
    roomy, link_c = make(store, "wC")
    req = adopt(roomy, link_c, store, "r0", AdoptFrom("wB"))
    assert len(req.output_ids) == 5


def test_the_async_engine_adopts_and_catches_the_caller_up(store) -> None:
    ref, _ = make(store, "ref")
    (want,) = ref.generate([PROMPT], [GREEDY])
    del ref
    dead, _ = make(store, "wA")
    dead.add_request("r0", PROMPT, GREEDY)
    for _ in range(15):
        dead.step()
    del dead
    peer, link = make(store, "wB")
    received = 9  # the client had 9 tokens when the stream broke; the manifest holds 15

    def adopter(engine: Engine, rid: str, source: AdoptFrom, rank: int | None) -> Request:
        return adopt_session(engine, store, link.owner, link.generation, rid, source)

    async def run() -> list:
        eng = AsyncEngine(peer, adopter=adopter)
        try:
            with pytest.raises(NotAdopted):
                async for _ in eng.adopt("nope", FENCE_A, 0):
                    pass
            return [o async for o in eng.adopt("r0", FENCE_A, received)]
        finally:
            eng.shutdown()

    outs = asyncio.run(run())
    assert [t for o in outs for t in o.new_token_ids] == want.output_ids[received:]
    assert outs[0].cached_prompt_tokens == len(PROMPT) and outs[-1].finished


def _manifest_offset(store: LocalHostStore, link: HostLink, rid: str) -> int:
    """Where ``rid``'s manifest region lies in the arena, as the store says."""
    regions = store.lookup(rid, link.owner, link.generation)
    (region,) = [r for r in regions if r.source == MANIFEST_SOURCE]
    return region.offset


def test_a_session_drained_after_its_first_manifest_is_adopted_not_a_stale_one(store) -> None:
    """The rolling restart's race: a draining worker hands over a request that has written one
    manifest version (into half 1) into a manifest region a finished request used before, whose
    own last version (in half 0) is higher. The peer resumes the new request, not the old."""
    ref, _ = make(store, "ref")
    (want,) = ref.generate([list(range(60, 100))], [GREEDY])
    del ref
    draining, link_a = make(store, "wA")
    draining.add_request("old", PROMPT, GREEDY)  # same sizes as "new": the same region again
    draining.step()
    old_at = _manifest_offset(store, link_a, "old")
    while draining.has_work():
        draining.step()
    draining.kv.host_backups.flush()  # its regions are back with the store
    draining.add_request("new", list(range(60, 100)), GREEDY)
    draining.step()  # the prompt and the first token: manifest version 1
    assert _manifest_offset(store, link_a, "new") == old_at
    link_a.close()  # SIGTERM: the generation ends, what it holds is adoptable
    del draining
    peer, link = make(store, "wB")
    req = adopt(peer, link, store, "new", AdoptFrom("wA"))
    assert len(req.output_ids) == 1
    while peer.has_work():
        peer.step()
    assert req.output_ids == want.output_ids


def test_a_drain_hands_over_what_the_client_has_tokens_of_and_ends_the_rest(store) -> None:
    """A request whose client has no token yet (mid chunked prefill: its manifest may not exist
    yet) is not handed over: its regions go back to the store, so the caller's
    start-over under the same id on a peer is admitted there; the started one is adopted."""
    ref, _ = make(store, "ref")
    want = ref.generate([PROMPT, LONG], [GREEDY, GREEDY])
    del ref
    engine, link_a = make(store, "wA", max_prefill_tokens=32, prefix_cache=False)  # no import
    holding = threading.Event()
    eng: AsyncEngine

    def hold(_: Engine, outputs: list) -> None:
        """Once "a" has a token and "b" is part-way through its prompt, the engine thread
        steps no more until the drain stopped it."""
        a, b = engine.request("a"), engine.request("b")
        if a is None or b is None or not a.output_ids or not 0 < b.num_computed < len(LONG):
            return
        holding.set()
        while not eng.draining:
            time.sleep(0.001)

    async def stream(rid: str, prompt: list[int], got: list[int]) -> BaseException | None:
        try:
            async for out in eng.generate(rid, prompt, GREEDY):
                got.extend(out.new_token_ids)
        except SessionsHandedOver as e:
            return e
        return None

    async def run() -> tuple[list[int], list[int], list]:
        nonlocal eng
        eng = AsyncEngine(engine, on_step=hold, on_shutdown=link_a.close)
        a, b = [], []
        tasks = [
            asyncio.create_task(stream("a", PROMPT, a)),
            asyncio.create_task(stream("b", LONG, b)),
        ]
        assert await asyncio.to_thread(holding.wait, 120.0)
        assert await asyncio.to_thread(eng.drain) == 1
        return a, b, await asyncio.gather(*tasks)

    a, b, ends = asyncio.run(run())
    assert a == want[0].output_ids[: len(a)] and a and b == []
    assert all(isinstance(e, SessionsHandedOver) for e in ends)
    assert [i.request_id for i in store.list_requests()] == ["a"]  # "b"'s regions are freed
    peer, link = make(store, "wB")
    req = adopt(peer, link, store, "a", AdoptFrom("wA"))
    peer.add_request("b", LONG, GREEDY)  # the gateway starts "b" over, under its id
    restarted: list[int] = []
    while peer.has_work():
        restarted += [t for o in peer.step() if o.request_id == "b" for t in o.new_token_ids]
    assert req.output_ids == want[0].output_ids
    assert restarted == want[1].output_ids


def test_unseeded_sampling_keeps_its_law_across_an_adoption(store) -> None:
    """Unseeded sampled sessions, adopted by a live peer right after their first token: the
    token the peer samples next follows the law an uninterrupted engine samples it from
    (chi-square homogeneity of the second token, grouped by the first, against the same
    sessions run without a move). Every worker draws its own random stream
    (``EngineConfig.sampling_seed``): six dead workers in a row do not repeat one sample."""
    from tests.worker.speculative.stats import chi2_homogeneity

    params = SamplingParams(temperature=0.25, max_tokens=2, ignore_eos=True)
    rounds, per_round = 6, 64
    ref, _ = make(store, "ref", max_num_seqs=per_round, kv_pool_mib=96)
    plain = [
        out.output_ids
        for _ in range(rounds)
        for out in ref.generate([PROMPT] * per_round, [params] * per_round)
    ]
    del ref
    peer, link = make(store, "wB", max_num_seqs=per_round, kv_pool_mib=96)
    moved = []
    for i in range(rounds):
        dead, _ = make(store, f"wA{i}", max_num_seqs=per_round, kv_pool_mib=96)
        reqs = [dead.add_request(f"r{i}-{j}", PROMPT, params) for j in range(per_round)]
        while any(not r.output_ids for r in reqs):
            dead.step()
        assert all(len(r.output_ids) == 1 for r in reqs)
        del dead  # SIGKILLed after its first tokens
        adopted = [adopt(peer, link, store, r.request_id, AdoptFrom(f"wA{i}", fence=True))
                   for r in reqs]  # fmt: skip
        while peer.has_work():
            peer.step()
        moved += [r.output_ids for r in adopted]
    assert all(len(t) == 2 for t in plain + moved)
    vocab = peer.model.cfg.vocab_size
    groups = []
    for first in {t[0] for t in plain} & {t[0] for t in moved}:
        a = torch.bincount(torch.tensor([t[1] for t in plain if t[0] == first]), minlength=vocab)
        b = torch.bincount(torch.tensor([t[1] for t in moved if t[0] == first]), minlength=vocab)
        groups.append((a, b))
    # the first tokens themselves: sampled before the move, by engines of the same law
    firsts = [torch.bincount(torch.tensor([t[0] for t in s]), minlength=vocab)
              for s in (plain, moved)]  # fmt: skip
    p_first, _ = chi2_homogeneity([(firsts[0], firsts[1])])
    p_next, df = chi2_homogeneity(groups)
    assert df >= 3, "too few shared cells to test the law"
    assert p_first > 1e-3 and p_next > 1e-3, (p_first, p_next, df)
