"""What each rank of a test's group runs (importable: the ranks are spawned processes)."""

from __future__ import annotations

from dataclasses import astuple
from pathlib import Path
from types import SimpleNamespace

import torch

from dhisparse.family.parallel_layout import SINGLE, ParallelConfig
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.kv.config import KVCacheConfig
from services.worker.parallel.comm import LOCAL, Comm
from services.worker.request.request import SamplingParams
from services.worker.serving.cache import KVCache
from services.worker.speculative.config import SpeculationConfig
from services.worker.weights.model_io import load_model
from tests.worker.helpers import run_chunks

VOCAB = 300  # hf_tiny's
# the two-rank layouts the tests run, by ``ParallelConfig.name``: its flags
LAYOUTS = {
    "tp": {},
    "tp+ep": {"expert_parallel": True},
    "dp-attention": {"data_parallel_attention": True},
    "dp-attention+ep": {"data_parallel_attention": True, "expert_parallel": True},
}


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


# (prompt length, seed, chunks): chunks of at most hot / k queries past the hot cache, so
# their selections always fit it. Under data-parallel attention rank r runs PROMPTS[r]: the
# ranks run different passes, and their MoE rounds meet different layers.
PROMPTS = [(150, 7, [64, 64, 8, 8, 6]), (90, 8, [40, 30, 20])]


def model_pass(comm: Comm, path: Path, layout: dict | None, prompt: int = 0) -> dict:
    """One prompt through a model in chunks, over a hisparse KV cache whose hot cache is smaller
    than the prompt (the resolver recovers rows from the host): the logits (rank 0; under
    data-parallel attention every rank's, of its own prompt), every layer's locations, this
    rank's tensor sizes and the collectives run. ``prompt``: which of ``PROMPTS`` (one
    process; a group's ranks under data-parallel attention take their rank's)."""
    par = ParallelConfig(comm.size, **layout) if layout is not None else SINGLE
    model = load_model(path, parallel=par, comm=comm)
    kv = KVCache(model.cfg, KVCacheConfig(
        mode="hisparse", max_slots=1, max_model_len=256, dtype=torch.float32, page_size=16,
        hot_cache_rows=128, host_arena_bytes=8 << 20, kv_pool_bytes=16 << 20,
        max_prefill_tokens=64,
    ))  # fmt: skip
    trace: list = []
    exchange = model.expert_exchange
    n, seed, chunks = PROMPTS[comm.rank if exchange is not None else prompt]
    logits = model.logits(run_chunks(model, kv, ids(n, seed), chunks, trace=trace))
    if exchange is not None:  # this rank is done: serve the others' rounds until all are
        exchange.idle()
    kv.close()
    sizes = {n: t.numel() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    return {
        "logits": logits if comm.is_leader or exchange is not None else None,
        "locations": [t.locations for t in trace],
        "sizes": sizes,
        "collectives": dict(comm.calls),
        "rounds": (exchange.rounds, exchange.idle_rounds) if exchange is not None else None,
    }


def greedy(
    comm: Comm, path: Path, layout: dict | None, mode: str, drafter: str | None = None,
    n_prompts: int = 3,
) -> dict:  # fmt: skip
    """Greedy continuations of ``n_prompts`` prompts through the engine of every rank (rank 0
    driven, the others following), and what each rank's hierarchy resolved and prefilled."""
    par = ParallelConfig(comm.size, **layout) if layout is not None else SINGLE
    spec = SpeculationConfig(drafter, 4, "fixed") if drafter else SpeculationConfig()
    cfg = EngineConfig(
        model=str(path), mode=mode, max_num_seqs=4, max_model_len=512, page_size=16,
        host_arena_mib=16, hot_cache_rows=32, max_prefill_tokens=64, kv_pool_mib=48,
        parallel=par, speculation=spec,
    )  # fmt: skip
    eng = Engine(cfg, comm=comm if layout is not None else LOCAL)
    prompts = [ids(n, 100 + n).tolist() for n in (120, 45, 90)[:n_prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens = None
    if comm.is_leader or layout is None:
        tokens = [r.output_ids for r in eng.generate(prompts, params)]
        eng.group.stop()
    else:
        eng.group.follow(eng, eng.stats.drain_finished)
    census = eng.kv.payload.census
    out = {
        "tokens": tokens,
        "census": None if census is None else astuple(census),
        "steps": eng.group.lockstep.steps if eng.group.lockstep is not None else None,
        "drafts": eng.speculator.counters.drafts if eng.speculator is not None else None,
        "collectives": dict(comm.calls),
        "prefilled": eng.stats.prefill_tokens_computed,
    }
    eng.close()
    return out


def held_bytes(comm: Comm, loads: list[tuple[Path, dict | None, bool]]) -> list[dict[str, int]]:
    """For each (checkpoint, layout, MTP layer) of ``loads``: this rank's model as the worker
    loads it (``layout`` None: one process's, whole), its parameters' and buffers' bytes by
    name."""
    out = []
    for path, layout, mtp in loads:
        par = ParallelConfig(comm.size, **layout) if layout is not None else SINGLE
        model = load_model(path, mtp=mtp, parallel=par, comm=comm if layout is not None else LOCAL)
        tensors = [*model.named_parameters(), *model.named_buffers()]
        out.append({n: t.numel() * t.element_size() for n, t in tensors})
    return out


def sampled(comm: Comm, path: Path, layout: dict) -> dict:
    """Unseeded sampled continuations through the engine of every rank of a worker (a store
    owner, as served), and the seed each rank's default sampling generator took."""
    par = ParallelConfig(comm.size, **layout)
    cfg = EngineConfig(
        model=str(path), mode="resident", max_num_seqs=4, max_model_len=256, page_size=16,
        max_prefill_tokens=64, kv_pool_mib=32, parallel=par,
        owner=par.store_owner("w0", comm.rank),
    )  # fmt: skip
    eng = Engine(cfg, comm=comm)
    prompts = [ids(n, 200 + n).tolist() for n in (40, 25)]
    params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    tokens = None
    if comm.is_leader:
        tokens = [r.output_ids for r in eng.generate(prompts, params)]
        eng.group.stop()
    else:
        eng.group.follow(eng, eng.stats.drain_finished)
    unseeded = SimpleNamespace(generator=None)  # a request without a seed of its own
    out = {"tokens": tokens, "seed": eng.generator(unseeded).initial_seed(),
           "prefilled": eng.stats.prefill_tokens_computed}  # fmt: skip
    eng.close()
    return out


def prefix_turns(
    comm: Comm, path: Path, layout: dict, target: str | None, worker: str,
    prefix_cache: bool = True,
) -> dict:  # fmt: skip
    """Two conversations through the engine of every rank of worker ``worker`` (hisparse over
    a real node store, ``target``; resident, its pages shared on each rank's device, when
    None): both first turns, then both next turns (each its first turn, the answer and a
    question; under data-parallel attention on the other rank than its first turn). The tokens
    (rank 0), and what each rank prefilled and its prefix reuse counted."""
    from services.kv_host_store import KVHostStoreClient
    from services.worker.durable.host_link import HostLink

    par = ParallelConfig(comm.size, **layout)
    owner = par.store_owner(worker, comm.rank)
    client = host = None
    if target is not None:
        client = KVHostStoreClient(target)
        client.wait_ready(30)
        host = (client, client.map_arena()[1])
    cfg = EngineConfig(
        model=str(path), mode="hisparse" if host else "resident", max_num_seqs=4,
        max_model_len=512, page_size=16, hot_cache_rows=32, max_prefill_tokens=64,
        kv_pool_mib=48, parallel=par, owner=owner, prefix_cache=prefix_cache,
    )  # fmt: skip
    eng = Engine(cfg, host=host, comm=comm)
    if client is not None and eng.group.writes_host:  # a TP follower holds rank 0's regions
        HostLink(client, owner, 30.0, eng.kv.host_backups).register()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens, total = None, None
    if comm.is_leader:
        dp = eng.group.data_parallel
        firsts = [ids(100, 11).tolist(), ids(70, 12).tolist()]
        ends = _run(eng, "first", firsts, params, [0, 1] if dp else [None, None])
        nexts = [[*p, *r.output_ids, 5, 6, 7] for p, r in zip(firsts, ends, strict=True)]
        turns = _run(eng, "next", nexts, params, [1, 0] if dp else [None, None])
        tokens = [r.output_ids for r in [*ends, *turns]]
        prefix = eng.scheduler.prefix
        total = vars(prefix.stats.plus(eng.group.loads.others_prefix())) if prefix else None
        eng.group.stop()
    else:
        eng.group.follow(eng, eng.stats.drain_finished)
    prefix = eng.scheduler.prefix
    out = {
        "tokens": tokens,
        "prefilled": eng.stats.prefill_tokens_computed,
        "prefix": vars(prefix.stats) if prefix is not None else None,
        "total": total,
    }
    eng.close()
    if client is not None:
        client.close()
    return out


def _run(
    eng: Engine, name: str, prompts: list[list[int]], params: SamplingParams, ranks: list
) -> list:
    """``prompts`` as one batch to completion, prompt i on data-parallel rank ``ranks[i]``."""
    reqs = [
        eng.add_request(f"{name}-{i}", p, params, rank)
        for i, (p, rank) in enumerate(zip(prompts, ranks, strict=True))
    ]
    while eng.has_work():
        eng.step()
    return reqs


def adoption(comm: Comm, path: Path, target: str, received: int = 5) -> dict:
    """Peer adoption between two data-parallel-attention groups over a real node store
    (``target``): group A serves a session on each rank, then dies (nothing released); group
    B (the same layout: the rows' salt names it) adopts A's rank-0 session on its rank 1, A's
    rank-1 session on its rank 0, through rank 0's ``AsyncEngine`` and the worker's
    ``peer_adopter`` as the ``Adopt`` RPC runs them, and is refused a session the store does
    not hold. Rank 0 returns each stream's tokens (after ``received``), a single process's
    uncached tokens, and the refusal's code; every rank what B prefilled and resumed."""
    import asyncio

    from services.kv_host_store import KVHostStoreClient
    from services.worker.async_engine import AsyncEngine
    from services.worker.durable.adoption import AdoptFrom, NotAdopted, rank_adopter
    from services.worker.durable.host_link import HostLink
    from services.worker.engine.prefix_setup import prefix_salt
    from services.worker.server import peer_adopter

    par = ParallelConfig(comm.size, data_parallel_attention=True)
    client = KVHostStoreClient(target)
    client.wait_ready(30)
    host = (client, client.map_arena()[1])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = {"s0": ids(60, 21).tolist(), "s1": ids(40, 22).tolist()}

    def engine(worker: str, parallel: ParallelConfig, comm: Comm) -> Engine:
        owner = parallel.store_owner(worker, comm.rank)
        cfg = EngineConfig(
            model=str(path), mode="hisparse", max_num_seqs=4, max_model_len=512, page_size=16,
            hot_cache_rows=32, max_prefill_tokens=64, kv_pool_mib=48, parallel=parallel,
            owner=owner,
        )  # fmt: skip
        eng = Engine(cfg, host=host, comm=comm)
        eng.host_link = HostLink(client, owner, 30.0, eng.kv.host_backups,
                                 prefix_salt(cfg, eng.kv).root())  # fmt: skip
        eng.host_link.register()
        eng.group.adoptions.registered(eng.host_link, rank_adopter(eng, eng.host_link))
        return eng

    out: dict = {}
    dead = engine("wA", par, comm)
    if comm.is_leader:
        want = engine("ref", SINGLE, LOCAL).generate(list(prompts.values()), [params] * 2)
        out["want"] = {rid: r.output_ids[received:] for rid, r in zip(prompts, want, strict=True)}
        for rank, (rid, prompt) in enumerate(prompts.items()):
            dead.add_request(rid, prompt, params, rank)
        for _ in range(12):
            dead.step()
        dead.group.stop()
    else:
        dead.group.follow(dead, dead.stats.drain_finished)
    del dead  # SIGKILLed: its regions stay with the store, its lease still runs

    eng = engine("wB", par, comm)
    if comm.is_leader:
        assert eng.host_link is not None
        served = AsyncEngine(eng, adopter=peer_adopter(eng.host_link))

        async def stream(rid: str, source: AdoptFrom, rank: int | None) -> list[int]:
            outs = [o async for o in served.adopt(rid, source, received, rank)]
            return [t for o in outs for t in o.new_token_ids]

        async def run() -> None:
            got = await asyncio.gather(
                stream("s0", AdoptFrom("wA/dp0", fence=True), 1),
                stream("s1", AdoptFrom("wA/dp1", fence=True), 0),
            )
            out["got"] = dict(zip(prompts, got, strict=True))
            try:
                await stream("nope", AdoptFrom("wA/dp1"), 1)
            except NotAdopted as e:
                out["refused"] = e.code

        try:
            asyncio.run(run())
        finally:
            served.shutdown()
            eng.group.stop()
    else:
        eng.group.follow(eng, eng.stats.drain_finished)
    out["prefilled"] = eng.stats.prefill_tokens_computed
    out["resumed"] = eng.stats.sessions_resumed
    eng.close()
    client.close()
    return out
