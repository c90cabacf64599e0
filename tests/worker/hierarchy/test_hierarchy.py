"""The KV hierarchy gives attention exactly the rows resident serving gives it (eq. 12)."""

from __future__ import annotations

import pytest
import torch

from dhisparse.family.presets import preset, preset_topology
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig
from services.worker.model.decoder import LayerTrace
from services.worker.ops.fusion import kernel_fusion
from services.worker.request.request import SamplingParams
from services.worker.serving.cache import KVCache
from services.worker.weights.model_io import build_model
from tests.worker.helpers import make, with_workspace


def drive(
    name: str,
    mode: str,
    seed: int,
    prompt_lens: list[int],
    steps: int,
    device: str = "cpu",
    triton_attention: bool = False,
    **kv_kw,
) -> tuple[list[list[LayerTrace]], list[torch.Tensor], list[list[int]], KVCache]:
    """Prefills each prompt (one pass, several requests), then decodes all requests together
    greedily; returns per-pass traces, per-pass logits and the generated tokens."""
    model = build_model(
        preset(name), seed=seed, device=device, dtype=kv_kw.get("dtype", torch.float32)
    )
    if triton_attention:
        model.use_triton_attention()
    kv_cfg = KVCacheConfig(
        mode=mode,
        max_slots=len(prompt_lens) + 1,
        max_model_len=1024,
        page_size=16,
        kv_pool_bytes=64 << 20,
        host_arena_bytes=32 << 20,
        device=device,
        **kv_kw,
    )
    kv = KVCache(model.cfg, with_workspace(model.cfg, kv_cfg))
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=g).to(device) for n in prompt_lens]
    slots = list(range(1, len(prompts) + 1))  # not starting at 0: slot arithmetic is exercised
    total = max(prompt_lens) + steps + 1
    for s, p in zip(slots, prompts, strict=True):
        assert kv.admit(s, f"r{s}", len(p), total)
    traces, logits_all = [], []
    batch = ForwardBatch.build(slots, [0] * len(prompts), prompt_lens, device)
    trace: list[LayerTrace] = []
    hidden = model(torch.cat(prompts), batch, kv, trace=trace)
    kv.commit(batch, prompt_lens)
    logits = model.logits(hidden[batch.last_token_index])
    traces.append(trace), logits_all.append(logits)
    tokens = [[int(t)] for t in logits.argmax(-1)]
    lens = list(prompt_lens)
    for _ in range(steps):
        for s, n in zip(slots, lens, strict=True):
            assert kv.ensure(s, n + 1)
        batch = ForwardBatch.build(slots, lens, [1] * len(slots), device)
        trace = []
        ids = torch.tensor([t[-1] for t in tokens], device=device)
        hidden = model(ids, batch, kv, trace=trace)
        lens = [n + 1 for n in lens]
        kv.commit(batch, lens)
        logits = model.logits(hidden)
        traces.append(trace), logits_all.append(logits)
        for t, nxt in zip(tokens, logits.argmax(-1).tolist(), strict=True):
            t.append(nxt)
    return traces, logits_all, tokens, kv


CASES = [
    ("tiny-glm", 0, 1, "torch"),  # B = k: every selection exactly fills the hot cache
    ("tiny-glm", 1, 2, "torch"),
    ("tiny-glm", 2, 4, "torch"),
    ("tiny-dsv4", 3, 1, "torch"),
    ("tiny-dsv4", 4, 3, "torch"),
    ("tiny-glm", 5, 1, "triton"),  # the fused kernels (CPU interpreter here)
    ("tiny-dsv4", 6, 2, "triton"),
]


def assert_same_run(ref: tuple, run: tuple, rows_dtype: torch.dtype | None = None) -> None:
    """Two ``drive`` results agree bit for bit: per pass and layer the selection and the
    attention inputs (of ``rows_dtype`` when given), then the logits and the tokens."""
    ref_traces, ref_logits, ref_tokens = ref[:3]
    traces, logits, tokens = run[:3]
    for ref_pass, pass_ in zip(ref_traces, traces, strict=True):
        for a, b in zip(ref_pass, pass_, strict=True):
            assert a.layer == b.layer
            assert torch.equal(a.selection, b.selection)
            assert rows_dtype is None or a.rows.dtype == rows_dtype
            assert torch.equal(a.rows, b.rows), f"layer {a.layer}: attention inputs differ"
    for a, b in zip(ref_logits, logits, strict=True):
        assert torch.equal(a, b)
    assert tokens == ref_tokens


@pytest.mark.parametrize(("name", "seed", "b_over_k", "resolver"), CASES)
def test_hisparse_attention_inputs_and_logits_are_bit_identical(
    name: str, seed: int, b_over_k: int, resolver: str
) -> None:
    k = preset_topology(name).index_topk
    lens = [97, 40, 161]  # crossing pages, the ring, and compression groups
    steps = 30 if resolver == "torch" else 8  # the Triton interpreter is slow on the CPU
    ref = drive(name, "resident", seed, lens, steps=steps)
    run = drive(
        name, "hisparse", seed, lens, steps=steps, hot_cache_rows=b_over_k * k, resolver=resolver
    )
    assert_same_run(ref, run)
    kv = run[3]
    census = kv.payload.census
    assert census.host > 0 and census.hot > 0 and census.direct > 0, census
    kv.close()


FP8_CASES = [
    ("tiny-glm", 0, 1, "torch", torch.float32),
    ("tiny-glm", 2, 2, "torch", torch.bfloat16),
    ("tiny-dsv4", 3, 1, "torch", torch.float32),  # compressed rows, a bf16 local window
    ("tiny-glm", 5, 1, "triton", torch.float32),  # the fused resolver copies packed bytes
]


@pytest.mark.parametrize(("name", "seed", "b_over_k", "resolver", "dtype"), FP8_CASES)
def test_fp8_hisparse_attention_inputs_and_logits_are_bit_identical(
    name: str, seed: int, b_over_k: int, resolver: str, dtype: torch.dtype
) -> None:
    """``kv_cache_dtype="fp8"``: rows and keys are packed, and the hierarchy moves the packed
    bytes, so the dequantized attention inputs equal resident fp8 serving's bit for bit."""
    k = preset_topology(name).index_topk
    lens = [97, 40, 161]
    steps = 20 if resolver == "torch" else 6
    kw = dict(kv_cache_dtype="fp8", dtype=dtype)
    ref = drive(name, "resident", seed, lens, steps, **kw)
    run = drive(
        name, "hisparse", seed, lens, steps, hot_cache_rows=b_over_k * k, resolver=resolver, **kw
    )
    kv = run[3]
    assert kv.payload.pool(0).dtype == torch.uint8 == ref[3].payload.pool(0).dtype
    assert_same_run(ref, run, rows_dtype=dtype)
    census = kv.payload.census
    assert census.host > 0 and census.hot > 0 and census.direct > 0, census
    kv.close()


@pytest.mark.parametrize("name", ["tiny-glm", "tiny-dsv4"])
def test_hisparse_engine_greedy_matches_resident(name: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (150, 33, 260, 90)]
    ref = Engine(EngineConfig(model=name, kv_pool_mib=16)).generate(prompts, params)
    eng = Engine(
        EngineConfig(model=name, mode="hisparse", kv_pool_mib=32, host_arena_mib=32, max_num_seqs=8,
                     max_prefill_tokens=4096)
    )  # fmt: skip
    got = eng.generate(prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert eng.kv.payload.census.host > 0
    eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", ["tiny-glm", "tiny-dsv4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_hisparse_on_gpu_is_bit_identical_with_the_triton_kernels(
    name: str, dtype: str, kv_cache_dtype: str, fused: bool
) -> None:
    """On the device: Triton resolver (host reads from the registered arena) and Triton
    attention in both modes; attention inputs, logits and tokens identical. In fp8 the Triton
    FP8 store writes packed rows and keys, the resolver copies packed bytes and the Triton FP8
    gather dequantizes into the attention workspace. ``fused``: both modes run the fused
    kernels (index keys scored where each mode stores them, page lookups, top-k, ...)."""
    k = preset_topology(name).index_topk
    lens = [300, 77, 513, 150]
    kw = dict(device="cuda", triton_attention=True, dtype=getattr(torch, dtype),
              kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    with kernel_fusion(fused):
        ref = drive(name, "resident", 9, lens, steps=40, **kw)
        run = drive(
            name, "hisparse", 9, lens, steps=40, hot_cache_rows=2 * k, resolver="triton", **kw
        )
    kv = run[3]
    assert (kv.payload.pool(0).dtype == torch.uint8) == (kv_cache_dtype == "fp8")
    assert_same_run(ref, run)
    assert kv.payload.census.host > 0
    kv.close()


@pytest.mark.parametrize("name", ["tiny-glm", "tiny-dsv4"])
def test_decode_plans_built_ahead_are_the_plans_begin_would_build(name: str) -> None:
    """A decode commit plans the next decode pass while the device runs; when that pass comes
    (same slots, one token on, nothing seated or released) its plans, their device rows and
    the ring history are what planning it then gives. Requests of different lengths finish
    at different steps, so the batch changes and stale plans must be refused."""
    eng = Engine(
        EngineConfig(model=name, mode="hisparse", kv_pool_mib=32, host_arena_mib=32,
                     max_num_seqs=3, max_prefill_tokens=4096)
    )  # fmt: skip
    p = eng.kv.payload
    begin, used = p.begin, []

    def checked(batch: ForwardBatch) -> None:
        ring_hi = {slot: list(v) for slot, v in p.store.tail_hi.items()}
        plans, rows, index = p.planner.plan(batch, ring_hi)
        used.append(p._next is not None and p._next.matches(batch, p._epoch))
        begin(batch)
        st = p.pass_state
        assert st.plan_index == index and torch.equal(st.plan_rows, rows)
        assert p.store.tail_hi == ring_hi
        assert [(q.lo, q.hi, q.scratch, q.scratch_rows, q.all_direct) for q in st.plans] == [
            (q.lo, q.hi, q.scratch, q.scratch_rows, q.all_direct) for q in plans
        ]

    p.begin = checked
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (120, 40, 300, 75, 9)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 12, 21, 5, 17)
    ]
    eng.generate(prompts, params)
    assert sum(used) > 20 and not all(used), used  # taken in steady decode, refused otherwise
    eng.close()


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
def test_room_asked_again_within_held_pages_takes_nothing(mode: str) -> None:
    """``ensure`` remembers the tokens a slot holds without new pages: asks within them (every
    decode step and verify round) change nothing; an ask beyond takes pages; a released slot
    starts from none."""
    kw = {"mode": mode, "kv_pool_bytes": 8 << 20, "page_size": 16}
    if mode != "resident":
        kw["hot_cache_rows"] = 64
    _, kv = make("tiny-dsv4", **kw)  # compressed sources: rows per page differ by pool

    def held() -> list[int]:
        return [p.rows_room(1) for p in kv.index_keys.pools.values()]

    assert kv.admit(1, "r", 40, 400)
    before, room = held(), kv._ensured[1]
    assert room >= 40
    for n in range(41, room + 1):
        assert kv.ensure(1, n)
    assert held() == before
    assert kv.ensure(1, room + 1) and kv._ensured[1] > room
    assert all(kv.index_keys.pages_needed(1, n) == 0 for n in range(kv._ensured[1] + 1))
    assert kv.index_keys.pages_needed(1, kv._ensured[1] + 1) > 0
    kv.release(1)
    assert held() == [0] * len(before)
    # a new request in the slot: the old one's room is forgotten, its asks take pages
    assert kv.admit(1, "s", 10, 20)
    small = held()
    assert kv.ensure(1, 60) and held() > small
