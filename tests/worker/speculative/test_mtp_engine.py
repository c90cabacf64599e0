"""The MTP drafter in the engine (``--drafter mtp``) on tiny checkpoints of both families with an
appended MTP layer: verified greedy output is transformers' greedy continuation in every serving
mode, and a durable session that speculates survives its worker without a prompt recompute."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from services.worker.durable.host_link import HostLink
from services.worker.engine.engine import Engine
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.kv.config import ResidencyConfig
from services.worker.request.request import SamplingParams
from services.worker.speculative.config import SpeculationConfig
from services.worker.speculative.drafters.mtp import MTPDrafter
from tests import hf_tiny
from tests.worker.model import serving
from tests.worker.mtp_fixture import (
    FAMILIES,
    check_speculating_resume,
    mtp_checkpoint,
    record_drafts,
)
from tests.worker.mtp_reference import MTPReference

SPEC = SpeculationConfig("mtp", 4, "fixed")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[MTPReference, Path]:
    return mtp_checkpoint(request.param, tmp_path_factory)


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, hf_tiny.VOCAB, (n,), generator=g).tolist()


def _engine(path: Path, mode: str, host: tuple | None = None, **kw) -> Engine:
    return serving.engine(path, mode, host, **({"speculation": SPEC, "kv_pool_mib": 48} | kw))


@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_speculative_greedy_equals_transformers_greedy(family, mode: str) -> None:
    """Six requests, three arriving while the first three speculate, prompts prefilled in
    chunks of at most 64 tokens: every output is transformers' greedy continuation; the MTP
    layer drafted for every round; in hisparse most selected rows come from host, in adaptive
    admissions reclaim optional history."""
    ref, path = family
    kw: dict = {}
    if mode == "adaptive":
        kw = dict(
            kv_pool_mib=serving.tight_pool_mib(path, speculation=SPEC),
            residency=ResidencyConfig(populate_pages=4),
        )
    eng = _engine(path, mode, **kw)
    assert isinstance(eng.speculator.drafter, MTPDrafter)
    assert eng.graphs_off_reason is not None
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reqs = []
    for i, n in enumerate((200, 90, 260, 60, 180, 230)):
        if i == 3:
            for _ in range(12):
                eng.step()
        reqs.append(eng.add_request(f"r{i}", _ids(n, 400 + n), params))
    while eng.has_work():
        eng.step()
    for r in reqs:
        assert len(r.output_ids) == 20
        assert r.output_ids == hf_tiny.greedy_under_reference(
            ref.target, r.prompt_ids, r.output_ids
        )
    c = eng.speculator.counters
    assert c.drafts > 0 and c.draft_tokens > 0
    if mode == "hisparse":
        census = eng.kv.payload.census
        assert census.host > census.hot, census
    if mode == "adaptive":
        st = eng.kv.payload.residency.stats
        assert st.reclaim_events > 0, st
    eng.close()


@pytest.mark.parametrize("mode", ["hisparse", "adaptive"])
def test_a_speculating_session_resumes_without_a_prompt_recompute(family, mode: str) -> None:
    """An engine speculating with the MTP drafter is dropped mid-stream; its successor adopts
    the sessions from the host store — the MTP layer's rows, index keys and carry included —
    and continues them speculating, token for token as an uninterrupted run (greedy, and
    seeded sampling), without computing a prompt token."""
    _, path = family
    prompts = [_ids(n, 500 + n) for n in (100, 40)]
    check_speculating_resume(functools.partial(_engine, path, mode), prompts, 24)


@pytest.mark.parametrize("mode", ["hisparse", "adaptive"])
def test_a_prefix_hit_speculates_as_the_uncached_request_does(family, mode: str) -> None:
    """A conversation's next turn on another worker of the node imports the pages its first
    turn left — the MTP layer's rows and keys and the page carries with the target's — and
    computes only its new tokens. Its tokens are transformers' greedy continuation, and its MTP
    layer drafts at every step what an engine with no prefix cache drafts (acceptance after a
    hit equals acceptance without: the drafter's context came back whole)."""
    ref, path = family
    store = LocalHostStore(64 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    drafts: dict[str, dict[tuple[int, int], list[int]]] = {}

    def make(owner: str, **kw) -> Engine:
        engine = _engine(path, mode, owner=owner, host=(store, store.mapping), **kw)
        HostLink(store, owner, 30.0, engine.kv.host_backups).register()
        record_drafts(engine, drafts.setdefault(owner, {}))
        return engine

    first_turn = make("w0")
    (first,) = first_turn.generate([_ids(150, 77)], params)
    prompt = [*first.prompt_ids, *first.output_ids, *_ids(9, 78)]
    worker = make("w1")
    before = worker.stats.prefill_tokens_computed
    (turn,) = worker.generate([prompt], params)
    computed = worker.stats.prefill_tokens_computed - before
    uncached = make("ref", prefix_cache=False)
    (alone,) = uncached.generate([prompt], params)
    stats = worker.scheduler.prefix.stats
    assert stats.hits == 1 and computed == len(prompt) - stats.hit_tokens
    # every whole page of the first turn's computed tokens (its last token never was)
    assert stats.hit_tokens == (len(first.prompt_ids) + len(first.output_ids) - 1) // 16 * 16
    assert turn.output_ids == alone.output_ids
    assert turn.output_ids == hf_tiny.greedy_under_reference(ref.target, prompt, turn.output_ids)
    hit, plain = drafts["w1"], drafts["ref"]
    assert hit and hit == plain
    for engine in (first_turn, worker, uncached):
        engine.close()
    store.close()
