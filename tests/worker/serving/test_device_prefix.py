"""Prefix reuse on the device in resident mode: a conversation's next turn shares the device
pages its first turn left and computes only its new tokens, with the greedy tokens of the same
prompt served with no cache (under batch-invariant numerics, ``batch_invariant.py``, exactly);
requests sharing pages at once never write them; cached pages count as optional memory and give
way to live rows (no live row evicted); what keeps pages from being shared is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.prefix_setup import off_reason
from services.worker.request.request import Request, SamplingParams
from services.worker.serving.device_prefix import DevicePrefixReuse
from services.worker.speculative.config import SpeculationConfig
from tests import hf_tiny
from tests.worker.engine.batch_invariant import batch_invariant
from tests.worker.mtp_fixture import mtp_checkpoint, record_drafts

ANSWER = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SHIPPED = "models/glm-dsa-mini"
SOURCE = Path(__file__).resolve().parents[3] / "services/kv_host_store/intervals.py"


def make(**kw) -> Engine:
    base = dict(model="tiny-glm", mode="resident", kv_pool_mib=8, max_num_seqs=4)
    return Engine(EngineConfig(**{**base, "max_model_len": 512, **kw}))


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams = ANSWER) -> list:
    before = engine.stats.prefill_tokens_computed
    reqs = engine.generate(prompts, params)
    for r in reqs:
        r.cached = r.output().cached_prompt_tokens  # type: ignore[attr-defined]
    reqs[0].computed = engine.stats.prefill_tokens_computed - before  # type: ignore[attr-defined]
    return reqs


def next_turn(first: Request, question: list[int]) -> list[int]:
    return [*first.prompt_ids, *first.output_ids, *question]


@pytest.mark.parametrize(
    "model,kv_cache_dtype,drafter",
    [("tiny-glm", "auto", None), ("tiny-indexshare", "fp8", None), ("tiny-glm", "auto", "dflash")],
)
def test_the_next_turn_shares_the_first_turns_pages_with_the_uncached_tokens(
    model: str, kv_cache_dtype: str, drafter: str | None
) -> None:
    kw: dict = dict(model=model, kv_cache_dtype=kv_cache_dtype)
    if drafter is not None:
        kw["speculation"] = SpeculationConfig(drafter, 4)
    with batch_invariant():
        eng, ref = make(**kw), make(prefix_cache=False, **kw)
        assert isinstance(eng.scheduler.prefix, DevicePrefixReuse)
        context = eng.scheduler.prefix.context  # a drafter's own: computed by the prefill
        (first,) = run(eng, [list(range(10, 110))])
        prompt = next_turn(first, [(7 + i) % 200 for i in range(context + 5)])
        (turn,) = run(eng, [prompt])
        (want,) = run(ref, [prompt])
    assert turn.output_ids == want.output_ids
    shared = (100 + 24 - 1) // 16 * 16  # the first turn's complete pages
    assert turn.cached == shared and turn.computed == len(prompt) - shared
    assert turn.output().shared_prompt_tokens == shared  # its pages, seated from the record
    assert want.computed == len(prompt) and want.cached == want.output().shared_prompt_tokens == 0
    stats = eng.scheduler.prefix.stats
    assert (stats.hits, stats.hit_tokens, stats.left) == (1, shared, 2)


def test_requests_sharing_pages_at_once_never_write_them() -> None:
    """Three next turns of one conversation, with different questions, run together on the
    first turn's pages; then a fourth alone: each gives the uncached tokens (a write into a
    shared page would change the others')."""
    with batch_invariant():
        eng, ref = make(), make(prefix_cache=False)
        (first,) = run(eng, [list(range(30, 130))])
        prompts = [next_turn(first, [q, q + 1, q + 2]) for q in (3, 50, 97)]
        turns = run(eng, prompts)
        (later,) = run(eng, [next_turn(first, [5, 5, 5, 5])])
        want = run(ref, [*prompts, later.prompt_ids])
    assert [r.output_ids for r in [*turns, later]] == [r.output_ids for r in want]
    assert all(r.cached == 112 for r in [*turns, later])
    assert eng.scheduler.prefix.stats.hits == 4


def test_cached_pages_are_optional_memory_and_give_way_to_live_rows() -> None:
    """Distinct conversations fill the pool with cached prefixes; a long prompt then needs
    their pages: records are evicted least recently used first, the long request runs as with
    no cache, and the most recently used prefix still serves its next turn."""
    with batch_invariant():
        eng = make(kv_pool_mib=1, max_model_len=1024)
        ref = make(kv_pool_mib=1, max_model_len=1024, prefix_cache=False)
        idle = eng.kv.memory()
        firsts = [run(eng, [[(7 * i + j) % 250 + 3 for j in range(160)]])[0] for i in range(2)]
        cached = eng.kv.memory()
        assert cached.required == idle.required and cached.optional > 0
        assert cached.free == idle.free - cached.optional
        prefix = eng.scheduler.prefix
        assert len(prefix.records) == 2 and prefix.records.evictions == 0
        long = [(11 * j) % 250 + 3 for j in range(300)]  # 20 pages: 13 are free
        (got,) = run(eng, [long], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        (want,) = run(ref, [long], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert got.output_ids == want.output_ids and prefix.records.evictions == 1
        assert got.computed == len(long)  # nothing of it was cached
        (turn,) = run(eng, [next_turn(firsts[-1], [1, 2, 3])])
        (again,) = run(ref, [turn.prompt_ids])
    assert turn.output_ids == again.output_ids
    assert turn.cached == (160 + 24 - 1) // 16 * 16  # the younger conversation's pages


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_a_next_turn_speculating_with_the_mtp_layer_shares_and_drafts_as_without(
    family: str, tmp_path_factory
) -> None:
    """The MTP layer's source lags by one: a record holds its rows but the last, so the next
    turn copies the page that row goes to and seats the record's carry; it gives
    transformers' greedy tokens and drafts at every round what an engine with no cache
    drafts. The same prompt again matches fewer of a record's pages than it holds: computed."""
    ref, path = mtp_checkpoint(family, tmp_path_factory)
    kw = dict(model=str(path), speculation=SpeculationConfig("mtp", 4, "fixed"), kv_pool_mib=16)
    drafts: dict[str, dict] = {"eng": {}, "ref": {}}
    eng, plain = make(**kw), make(prefix_cache=False, **kw)
    record_drafts(eng, drafts["eng"])
    record_drafts(plain, drafts["ref"])
    (first,) = run(eng, [list(range(20, 110))])
    prompt = next_turn(first, [5, 6, 7, 8])
    (turn,) = run(eng, [prompt])
    (want,) = run(plain, [prompt])
    assert turn.output_ids == want.output_ids
    assert turn.output_ids == hf_tiny.greedy_under_reference(ref.target, prompt, turn.output_ids)
    assert turn.cached == (90 + 24 - 1) // 16 * 16 and turn.computed == len(prompt) - turn.cached
    _same_drafts(drafts, len(prompt))
    (again,) = run(eng, [first.prompt_ids])
    assert again.cached == 0 and again.output_ids == first.output_ids
    # a record whose last page ends inside a prefill chunk (its carry from the pass's hidden
    # states, not the carry ring)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    (short,) = run(eng, [list(range(40, 140))], one)
    prompt = next_turn(short, [9, 9, 9])
    for log in drafts.values():
        log.clear()
    (turn,) = run(eng, [prompt])
    (want,) = run(plain, [prompt])
    assert turn.cached == 96 and turn.output_ids == want.output_ids
    _same_drafts(drafts, len(prompt))


def _same_drafts(drafts: dict[str, dict], past: int) -> None:
    """Every draft the cached engine proposed past ``past`` committed tokens is the one the
    engine with no cache proposed there (drafts are keyed by tokens committed and anchor)."""
    mine = {k: v for k, v in drafts["eng"].items() if k[0] >= past}
    assert mine and all(drafts["ref"].get(k) == v for k, v in mine.items())


def test_what_keeps_device_pages_from_being_shared() -> None:
    on = make()
    assert off_reason(on.cfg, on.kv) is None
    mtp = make(model=SHIPPED, speculation=SpeculationConfig("mtp", 4))
    assert isinstance(mtp.scheduler.prefix, DevicePrefixReuse)  # its lagged pages copied
    v4 = make(model="tiny-dsv4")
    assert v4.scheduler.prefix is None and "compressed or windowed" in off_reason(v4.cfg, v4.kv)
    off = make(prefix_cache=False)
    assert off.scheduler.prefix is None and off_reason(off.cfg, off.kv) == "--no-prefix-cache"


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", [None, "mtp"])
def test_on_the_gpu_a_next_turn_shares_device_pages_under_cuda_graphs(drafter: str | None) -> None:
    """The shipped model in resident mode on the GPU, decode (and verify, and MTP draft)
    passes replayed from CUDA graphs: a conversation's next turn shares its first turn's
    device pages (the MTP layer's boundary page copied, its carry seated) and gives the
    tokens of an engine with no cache; only the new tokens are computed."""
    kw: dict = dict(model=SHIPPED, mode="resident", device="cuda", kv_pool_mib=512,
                    max_num_seqs=4, max_model_len=2048)  # fmt: skip
    if drafter is not None:
        kw["speculation"] = SpeculationConfig(drafter, 4, "fixed")
    eng, ref = make(**kw), make(prefix_cache=False, **kw)
    assert eng.graphs_off_reason is None and isinstance(eng.scheduler.prefix, DevicePrefixReuse)
    tok = eng.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    (first,) = run(eng, [tok.encode(SOURCE.read_text()[:2400])], params)
    prompt = next_turn(first, tok.encode("\n\ndef merge(a, b):"))
    (turn,) = run(eng, [prompt], params)
    (want,) = run(ref, [prompt], params)
    assert turn.output_ids == want.output_ids
    assert turn.cached == (len(first.prompt_ids) + 31) // 16 * 16
    assert turn.computed == len(prompt) - turn.cached
    assert eng.passes.graphs is not None and eng.passes.graphs.replays > 0
    for e in (eng, ref):
        e.close()
