"""Chunked prefill in the engine, every serving mode, both presets: prompts of 50-200 tokens
prefilled in chunks of a few tokens, interleaved with the other requests' decode steps.

- Under batch-invariant numerics (``batch_invariant.py``) every query of every pass reads
  exactly the selection and attention inputs an unchunked prefill reads, and the stored rows
  and index keys after prefill are the same, bit for bit; so are the greedy tokens.
- Under the ordinary numerics greedy tokens equal an unchunked prefill's, with speculative
  decoding too; a preempted partial prefill recomputes to the same tokens; and a durable
  session whose worker died part-way through a prefill resumes from its computed prefix."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import services.worker.model.decoder as model_mod
from dhisparse.family.presets import preset_topology
from services.worker.durable.adoption import adopt_sessions
from services.worker.durable.host_link import HostLink
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.kv.config import bytes_per_token
from services.worker.kv.workspace import index_score_bytes
from services.worker.request.request import Request, SamplingParams
from services.worker.speculative.config import SpeculationConfig
from tests.worker.engine.batch_invariant import batch_invariant

MODELS = ["tiny-glm", "tiny-dsv4"]
MODES = ["resident", "hisparse", "adaptive"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LENS = (180, 50, 90)  # prompt lengths


def prompts(*lens: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def config(model: str, mode: str, budget: int | None, **kw) -> EngineConfig:
    """``budget``: prefill tokens per step (chunked); None: each prompt whole."""
    kw.setdefault("max_num_seqs", 4)
    return EngineConfig(
        model=model, mode=mode, kv_pool_mib=kw.pop("kv_pool_mib", 24), host_arena_mib=32,
        max_model_len=512, max_prefill_tokens=budget or 512, chunked_prefill=budget is not None,
        **kw,
    )  # fmt: skip


class Recorder:
    """Wraps an engine's model: what attention read at every (layer, request, position), and
    each request's stored rows and index keys at the step its prefill ended."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.read: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.stored: dict[str, list[torch.Tensor]] = {}
        forward = engine.model.forward

        def traced(input_ids, batch, kv, trace=None, features=None, begin=True):
            layers: list = []
            out = forward(input_ids, batch, kv, trace=layers, features=features, begin=begin)
            rid = {r.slot: r.request_id for r in engine.scheduler.running}
            where = list(zip(batch.token_slot.tolist(), batch.positions.tolist(), strict=True))
            for tr in layers:
                for j, (slot, pos) in enumerate(where):
                    self.read[(tr.layer, rid[slot], pos)] = (tr.selection[j], tr.rows[j])
            return out

        engine.model.forward = traced  # type: ignore[method-assign]

    def run(self, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
        eng = self.engine
        reqs = [eng.add_request(f"r{i}", p, params) for i, p in enumerate(ps)]
        while eng.has_work():
            eng.step()
            for r in reqs:
                if r.output_ids and r.request_id not in self.stored:
                    self.stored[r.request_id] = self._stored(r)
        return [r.output_ids for r in reqs]

    def _stored(self, req: Request) -> list[torch.Tensor]:
        """The request's rows of every source and index keys of every producer, its prompt's."""
        kv, cfg, slot = self.engine.kv, self.engine.model_cfg, req.slot
        assert slot is not None
        out = []
        for s in range(len(cfg.sources)):
            n = cfg.rows_for_tokens(s, len(req.prompt_ids))
            if kv.host_backups is not None:  # every prefill row is backed up (write-through)
                out.append(kv.host_backups.rows_view(slot, s, 0, n).clone())
            else:
                pool = kv.payload.pools[s]  # type: ignore[attr-defined]
                out.append(pool.gather_padded(torch.tensor([slot]), torch.tensor([n]), n)[0])
        for layer in cfg.index_producers:
            n = cfg.rows_for_tokens(cfg.layers[layer].source, len(req.prompt_ids))
            out.append(kv.index_keys.gather(layer, torch.tensor([slot]), torch.tensor([n]), n)[0])
        return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", MODELS)
def test_chunks_read_and_store_exactly_what_a_whole_prefill_does(model: str, mode: str) -> None:
    ps = prompts(120, 50, 90)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with batch_invariant():
        whole = Recorder(Engine(config(model, mode, None)))
        want = whole.run(ps, params)
        chunked = Recorder(Engine(config(model, mode, 7)))
        got = chunked.run(ps, params)
    assert got == want
    assert whole.read.keys() == chunked.read.keys()
    for key, (sel, rows) in whole.read.items():
        csel, crows = chunked.read[key]
        assert torch.equal(sel, csel), f"layer, request, position {key}: selection differs"
        assert torch.equal(rows, crows), f"layer, request, position {key}: inputs differ"
    for rid, tensors in whole.stored.items():
        for a, b in zip(tensors, chunked.stored[rid], strict=True):
            assert torch.equal(a, b), f"{rid}: stored rows or index keys differ"


@pytest.fixture(scope="module")
def whole() -> dict[str, list[list[int]]]:
    """Greedy tokens with every prompt prefilled whole (resident: every mode computes the same)."""
    ps = prompts(*LENS)
    return {m: Engine(config(m, "resident", None)).generate(ps, GREEDY) for m in MODELS}


@pytest.mark.parametrize(
    "model,mode", [("tiny-glm", "resident"), ("tiny-glm", "hisparse"), ("tiny-dsv4", "adaptive")]
)
def test_chunked_greedy_tokens_equal_a_whole_prefill(whole, model: str, mode: str) -> None:
    engine = Engine(config(model, mode, 16))
    beside = 0  # steps whose chunks ran beside other requests' decode steps
    schedule = engine.scheduler.schedule

    def counted():
        nonlocal beside
        out = schedule()
        assert out.prefill_tokens <= 16
        beside += bool(out.decode and out.prefill)
        return out

    engine.scheduler.schedule = counted  # type: ignore[method-assign]
    got = engine.generate(prompts(*LENS), GREEDY)
    assert [r.output_ids for r in got] == [r.output_ids for r in whole[model]]
    assert beside >= 5
    engine.kv.payload.residency.check()
    engine.close()


@pytest.mark.parametrize("mode", ["resident", "adaptive"])
def test_speculative_decoding_after_a_chunked_prefill_equals_plain_greedy(whole, mode) -> None:
    spec = SpeculationConfig("dflash", 4, "fixed")
    engine = Engine(config("tiny-glm", mode, 16, speculation=spec, max_num_seqs=6))
    got = engine.generate(prompts(*LENS), GREEDY)
    assert [r.output_ids for r in got] == [r.output_ids for r in whole["tiny-glm"]]
    assert engine.speculator is not None and engine.speculator.counters.drafts > 0
    engine.close()


def test_a_preempted_partial_prefill_recomputes_to_the_same_tokens() -> None:
    """Pools of 12 pages (10 for the tokens, 2 of slack, one per slot): r0's 2 and r1's 10;
    r0's third page, as it decodes, preempts r1 part-way through its prefill, and r1 starts
    again once r0 is done."""
    ps = prompts(20, 150)
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ]
    want = Engine(config("tiny-glm", "resident", None)).generate(ps, params)
    per_token = bytes_per_token(preset_topology("tiny-glm"), 4, payload=True)
    pool = 10 * 16 * per_token / 2**20
    cfg = config("tiny-glm", "resident", 8, kv_pool_mib=pool, page_size=16, max_num_seqs=2)
    engine = Engine(cfg)
    assert engine.kv.tokens_capacity == 10 * 16
    victims: list[tuple[str, int]] = []  # (request, tokens computed) of each preempted prefill
    preempt = engine.scheduler._preempt

    def recorded(victim, out):
        if victim.prefilling:
            victims.append((victim.request_id, victim.num_computed))
        preempt(victim, out)

    engine.scheduler._preempt = recorded  # type: ignore[method-assign]
    got = engine.generate(ps, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert len(victims) == 1 and 0 < victims[0][1] < 150, victims


@pytest.fixture
def store():
    s = LocalHostStore(64 << 20)
    yield s
    s.close()


@pytest.mark.parametrize("model,mode", [("tiny-glm", "hisparse"), ("tiny-dsv4", "adaptive")])
def test_a_session_that_dies_mid_prefill_resumes_from_its_computed_prefix(
    store, model: str, mode: str
) -> None:
    ps = prompts(150, 40)

    def make(owner: str) -> Engine:
        engine = Engine(config(model, mode, 16, owner=owner), host=(store, store.mapping))
        HostLink(store, owner, 30.0, engine.kv.host_backups).register()
        return engine

    want = Engine(config(model, "resident", None)).generate(ps, GREEDY)
    first = make("w0")
    for i, p in enumerate(ps):
        first.add_request(f"r{i}", p, GREEDY)
    for _ in range(5):  # r0's first 80 tokens; r1 waits
        first.step()
    assert first.requests["r0"].num_computed == 80 and not first.requests["r0"].output_ids
    del first  # dies: no release, no flush
    second = make("w0")
    report = adopt_sessions(second, store, "w0", second.kv.host_backups.generation)
    assert report.resumed == ["r0"] and not report.released  # r1 never had a manifest
    r0 = second.requests["r0"]
    assert r0.prefilling and r0.num_computed == 80
    second.add_request("r1", ps[1], GREEDY)
    while second.has_work():
        second.step()
    assert r0.output_ids == want[0].output_ids
    assert second.stats.prefill_tokens_computed == 150 - 80 + 40  # nothing computed twice
    assert r0.output().cached_prompt_tokens == 80


def gpu_config(mode: str, budget: int | None) -> EngineConfig:
    return EngineConfig(
        model="tiny-glm", device="cuda", mode=mode, kv_pool_mib=256, host_arena_mib=64,
        max_num_seqs=4, max_model_len=2048, max_prefill_tokens=budget or 2048,
        chunked_prefill=budget is not None, hot_cache_rows=64,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_on_the_gpu_with_graphs_and_triton(mode: str) -> None:
    """Chunks of 200 tokens through the Triton resolver and attention, decode steps replayed
    as CUDA graphs between them: the tokens of a whole prefill."""
    ps = prompts(700, 90, 1300)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = Engine(gpu_config(mode, None)).generate(ps, params)
    engine = Engine(gpu_config(mode, 200))
    got = engine.generate(ps, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert engine.passes.graphs is not None and engine.passes.graphs.replays > 0
    engine.close()


@pytest.mark.gpu
def test_the_index_score_workspace_stays_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """What selection allocates in a pass, measured around it, against ``index_score_bytes``:
    a 1900-token prompt in chunks of 600 (blocks of 512 queries against up to 1900 keys), short
    prompts beside its last chunk, then decode steps."""
    engine = Engine(replace(gpu_config("resident", 600), kv_pool_mib=512))
    bound = index_score_bytes(engine.model_cfg, engine.kv.cfg)
    peaks: list[int] = []
    select = model_mod.select_rows

    def measured(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():  # a graph's capture (its warm-up is measured)
            return select(*args, **kwargs)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = select(*args, **kwargs)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        return out

    monkeypatch.setattr(model_mod, "select_rows", measured)  # what the forward calls
    engine.generate(prompts(1900, 12, 14, 10), SamplingParams(temperature=0.0, max_tokens=4))
    assert bound / 2 < max(peaks) <= bound, (max(peaks), bound)
    engine.close()
