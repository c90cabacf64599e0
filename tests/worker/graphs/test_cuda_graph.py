"""CUDA graphs of the decode and verify passes and of the drafter's block pass
(``services/worker/graphs/cuda_graph.py``): replayed decode steps and speculative rounds give
the eager ones' logits bit for bit in every serving mode, while requests arrive and finish (so
batch sizes, index-key widths and hierarchy plans change between replays)."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.graphs.cuda_graph import (
    KEYS_PER_BATCH,
    DraftGraphs,
    GraphConfig,
    OutputArena,
    _tensors,
    graph_limit,
)
from services.worker.kv.config import FollowerPrefetch
from services.worker.kv.pass_rows import key_rows
from services.worker.model.mla_mtp import MTPStep
from services.worker.request.request import SamplingParams
from services.worker.speculative.config import SpeculationConfig
from tests.worker.model import serving
from tests.worker.mtp_fixture import FAMILIES, mtp_checkpoint

SHIPPED = "models/glm-dsa-mini"  # the default model: its MTP layer is trained


def test_key_rows_buckets_widths_by_an_eighth_of_their_power_of_two() -> None:
    prev = 0
    for rows in range(1, 70_000, 37):
        w = key_rows(rows)
        assert w >= rows and w >= prev  # covers every row, never shrinks as contexts grow
        assert w - rows < max(256, rows / 8)
        assert w % 256 == 0
        prev = w


def test_graphs_share_one_output_arena_laid_out_from_its_start() -> None:
    g = torch.Generator().manual_seed(7)
    step = MTPStep(
        torch.randn(3, 5, generator=g).to(torch.bfloat16),
        torch.randn(3, 11, generator=g),
        torch.randint(-1, 9, (3, 4), generator=g),
        torch.randint(0, 11, (3,), generator=g),
    )
    outs = (step, {"h": torch.randn(2, 7, generator=g)[:, 1:], "none": None})
    arena = OutputArena(torch.device("cpu"))
    arena.reserve(outs)
    placed = arena.place(outs)
    assert isinstance(placed[0], MTPStep) and placed[1]["none"] is None
    base = _tensors(placed)[0].data_ptr()
    for a, b in zip(_tensors(outs), _tensors(placed), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert b.is_contiguous() and (b.data_ptr() - base) % OutputArena.ALIGN == 0
    assert OutputArena.nbytes(outs) == 5 * OutputArena.ALIGN
    # a second graph's outputs begin where the first's did: the arena is shared
    small = torch.randn(4, generator=g)
    again = arena.place(small)
    assert again.data_ptr() == base and torch.equal(again, small)
    # outputs larger than the arena get a new one; views placed before keep theirs
    kept = _tensors(placed)[1].clone()
    big = torch.randn(1000, generator=g)
    arena.reserve(big)
    moved = arena.place(big)
    assert torch.equal(moved, big) and moved.data_ptr() != base
    assert torch.equal(_tensors(placed)[1], kept)


@pytest.mark.gpu
def test_graphs_of_growing_outputs_replay_from_the_shared_arena() -> None:
    """Block-pass graphs captured at batch sizes 1, 3, 8 and 2 (outputs that outgrow the arena
    twice, then fit it) replay in any order with the eager pass's outputs: a graph captured
    before the arena grew keeps its own buffer, and each replay's outputs are copies."""
    dev = torch.device("cuda")
    w = torch.randn(16, 33, device=dev, generator=torch.Generator(dev).manual_seed(5))

    def draft(slots, committed, anchors, temps, noise):
        x = torch.nn.functional.one_hot(anchors % 16, 16).float() + committed[:, None] / 7
        q = torch.softmax((x @ w) / (1.0 + temps[:, None]), -1)
        return q.argmax(-1) + slots, q, None

    graphs = DraftGraphs(draft, dev, max_batch=8)
    g = torch.Generator().manual_seed(9)

    def inputs(n: int) -> tuple[torch.Tensor, ...]:
        ints = torch.randint(0, 50, (3, n), generator=g).to(dev)
        return ints[0], ints[1], ints[2], torch.rand(n, generator=g).to(dev)

    for n in (1, 3, 8, 2):  # two sightings each: the second captures
        for _ in range(2):
            graphs.draft(*inputs(n), None)
    assert graphs.captures == 4
    held = []
    for n in (8, 1, 2, 3, 8, 1):
        args = inputs(n)
        tokens, q, conf = graphs.draft(*args, None)
        want_tokens, want_q, _ = draft(*args, None)
        assert conf is None and torch.equal(tokens, want_tokens) and torch.equal(q, want_q)
        held.append((q, want_q))
    assert graphs.replays == 6
    for got, want in held:  # copies: later replays left earlier outputs as they were
        assert torch.equal(got, want)


def test_the_graph_limit_holds_every_key_of_every_batch_size() -> None:
    assert graph_limit(1) == 64
    assert graph_limit(64) == KEYS_PER_BATCH * 64


def test_no_graphs_off_the_gpu() -> None:
    assert Engine(EngineConfig(model="tiny-glm")).passes.graphs is None
    with pytest.raises(ValueError, match="graph capture policy"):
        Engine(EngineConfig(model="tiny-glm", graphs=GraphConfig(capture="always")))


def _drive(
    mode: str,
    graphs: bool,
    capture: str = "second",
    drafter: str | None = None,
    kv_cache_dtype: str = "auto",
    followers: FollowerPrefetch = FollowerPrefetch(),
    fused: bool = False,
    model: str = "tiny-glm",
    pool_mib: int = 128,
    hot_rows: int = 64,
    mtp_block: bool = False,
    draft_vocab: int | None = None,
) -> tuple[Engine, list[tuple[str, int, torch.Tensor]]]:
    """``model``: a preset, or a checkpoint (one with its MTP layer for ``drafter="mtp"``,
    whose passes the graphs capture too); ``pool_mib``: the KV pool, which holds the token
    rings and the index-score workspace beside the rows; ``hot_rows``: the hierarchy's hot
    cache (at least the model's top-k); ``draft_vocab``: the MTP draft steps' hot vocabulary
    (ids 0 .. N-1)."""
    eng = Engine(
        EngineConfig(
            model=model, device="cuda", dtype="float32", mode=mode, kv_pool_mib=pool_mib,
            host_arena_mib=64, max_num_seqs=8, max_model_len=2048, max_prefill_tokens=4096,
            hot_cache_rows=hot_rows,
            graphs=GraphConfig(graphs, capture, mtp_block=mtp_block),
            speculation=SpeculationConfig(drafter, width=4, draft_vocab_size=draft_vocab),
            kv_cache_dtype=kv_cache_dtype, followers=followers, fused_kernels=fused,
        )
    )  # fmt: skip
    seen = serving.recorded_emits(eng)
    g = torch.Generator().manual_seed(11)
    lens, budgets = (700, 90, 1300, 400, 260), (60, 25, 48, 33, 60)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
    for i in range(3):
        eng.add_request(
            f"r{i}",
            prompts[i],
            SamplingParams(temperature=0.0, max_tokens=budgets[i], ignore_eos=True),
        )
    for _ in range(12):
        eng.step()
    for i in range(3, 5):
        eng.add_request(
            f"r{i}",
            prompts[i],
            SamplingParams(temperature=0.0, max_tokens=budgets[i], ignore_eos=True),
        )
    while eng.has_work():
        eng.step()
    return eng, seen


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("capture", ["second", "consecutive"])
@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_replayed_decode_steps_equal_the_eager_steps(mode: str, capture: str, fused: bool) -> None:
    """``fused``: both engines run the fused kernels (``--fused-kernels``)."""
    eager, ref = _drive(mode, graphs=False, fused=fused)
    graphed, got = _drive(mode, graphs=True, capture=capture, fused=fused)
    assert eager.passes.graphs is None and graphed.passes.graphs is not None
    assert graphed.passes.graphs.captures > 1 and graphed.passes.graphs.replays > 50
    # a key is captured at its second sighting: batch sizes seen for one step stay eager
    assert graphed.passes.graphs.eager >= graphed.passes.graphs.captures
    assert [(r, n) for r, n, _ in got] == [(r, n) for r, n, _ in ref]
    for (r, n, a), (_, _, b) in zip(ref, got, strict=True):
        assert torch.equal(a, b), f"{r} token {n}: logits differ"
    if mode == "hisparse":  # the replays resolved rows from the host too
        assert graphed.kv.payload.census.host > 0
    eager.close()
    graphed.close()


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", [None, "dflash"], ids=["plain", "dflash"])
@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_replayed_passes_over_compressed_windowed_sources_equal_the_eager_ones(
    mode: str, drafter: str | None
) -> None:
    """tiny-dsv4 (a source of rate 4 with a local window of 8 rows, read by its owner, a
    Reuse and a Reindex consumer): decode passes, and with DFlash verify passes, replayed
    from graphs give the eager passes' logits bit for bit; the rows a pass completes are
    written from the host's plan, the window read from the token ring inside the graph."""
    eager, ref = _drive(mode, graphs=False, drafter=drafter, model="tiny-dsv4")
    graphed, got = _drive(mode, graphs=True, drafter=drafter, model="tiny-dsv4")
    assert [(r, n) for r, n, _ in got] == [(r, n) for r, n, _ in ref]
    for (r, n, a), (_, _, b) in zip(ref, got, strict=True):
        assert torch.equal(a, b), f"{r} token {n}: logits differ"
    # fewer than tiny-glm's: a pass is keyed by how many rows it completes too
    assert graphed.passes.graphs is not None and graphed.passes.graphs.replays > 30
    eager.close()
    graphed.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["hisparse", "adaptive"])
def test_followers_resolved_in_a_parallel_branch_equal_inline(mode: str) -> None:
    """tiny-glm's IndexShare followers (layers 1-2 and 4-5) resolved on a side stream, in graph
    replays a parallel branch of the graph: the same logits as replays that resolve them
    inline at their producer, and as eager inline steps."""
    inline = FollowerPrefetch(overlap=False)
    eager, ref = _drive(mode, graphs=False, followers=inline)
    serial, base = _drive(mode, graphs=True, followers=inline)
    branched, got = _drive(mode, graphs=True)
    assert branched.kv.payload.selections.side_stream is not None
    assert serial.kv.payload.selections.side_stream is None
    assert branched.passes.graphs is not None and branched.passes.graphs.replays > 50
    for run in (base, got):
        assert [(r, n) for r, n, _ in run] == [(r, n) for r, n, _ in ref]
        for (r, n, a), (_, _, b) in zip(ref, run, strict=True):
            assert torch.equal(a, b), f"{r} token {n}: logits differ"
    assert branched.kv.payload.census == serial.kv.payload.census
    if mode == "hisparse":
        assert branched.kv.payload.census.host > 0
    for e in (eager, serial, branched):
        e.close()


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_replayed_speculative_rounds_equal_the_eager_rounds(mode: str, drafter: str) -> None:
    """Verify passes and the drafter's block passes replayed from graphs: the same tokens and
    the same logits for every emitted token as eager rounds, and plain greedy's tokens."""
    eager, ref = _drive(mode, graphs=False, drafter=drafter)
    graphed, got = _drive(mode, graphs=True, drafter=drafter)
    plain, base = _drive(mode, graphs=True)
    assert graphed.passes.graphs is not None and graphed.speculator is not None
    drafts = graphed.speculator.graphs
    assert drafts is not None and drafts.captures > 0 and drafts.replays > 10
    assert graphed.passes.graphs.replays > 10
    assert graphed.speculator.counters.accepted == eager.speculator.counters.accepted
    assert [(r, n) for r, n, _ in got] == [(r, n) for r, n, _ in ref]
    for (r, n, a), (_, _, b) in zip(ref, got, strict=True):
        assert torch.equal(a, b), f"{r} token {n}: logits differ"
    tokens = {(r, n): int(row[0].argmax()) for r, n, row in base}  # one row per token
    emitted = {}
    for r, n, rows in got:  # a round's rows: one per token it emitted, from output index n
        for j in range(rows.shape[0]):
            emitted[(r, n + j)] = int(rows[j].argmax())
    assert emitted == tokens
    for e in (eager, graphed, plain):
        e.close()


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", [*sorted(FAMILIES), SHIPPED])
@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_replayed_mtp_rounds_equal_the_eager_rounds(
    mode: str, checkpoint: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A checkpoint served with its MTP layer: decode and verify passes (which write the MTP
    layer's lagged source from the carry) and the MTP layer's draft steps replayed from graphs
    give the eager rounds' tokens and logits bit for bit, and plain greedy's tokens. The tiny
    checkpoints (each family's MTP form) have random MTP layers that rarely propose the target's
    token; the shipped model's trained layer does, so its rounds commit accepted drafts (the
    carry's lagged rows of several tokens)."""
    path = SHIPPED if checkpoint == SHIPPED else mtp_checkpoint(checkpoint, tmp_path_factory)[1]
    # the checkpoints' vocabularies and widths take a larger workspace than the presets', and
    # the shipped model selects 512 rows (its hot cache holds them; the prompts pass it)
    hot = 512 if checkpoint == SHIPPED else 64
    run = functools.partial(_drive, mode, model=str(path), pool_mib=512, hot_rows=hot)
    eager, ref = run(graphs=False, drafter="mtp")
    graphed, got = run(graphs=True, drafter="mtp")
    plain, base = run(graphs=True)
    graphs = graphed.passes.graphs
    assert graphs is not None and graphed.graphs_off_reason is None
    kinds = Counter(key[0] for key in graphs.held_keys())
    assert kinds["mtp"] > 0 and kinds["pass"] > 0 and graphs.replays > 20
    assert graphed.speculator is not None and eager.speculator is not None
    accepted = graphed.speculator.counters.accepted
    assert accepted == eager.speculator.counters.accepted
    assert accepted > 0 or checkpoint != SHIPPED
    assert [(r, n) for r, n, _ in got] == [(r, n) for r, n, _ in ref]
    for (r, n, a), (_, _, b) in zip(ref, got, strict=True):
        assert torch.equal(a, b), f"{r} token {n}: logits differ"
    tokens = {(r, n): int(row[0].argmax()) for r, n, row in base}
    emitted = {}
    for r, n, rows in got:
        for j in range(rows.shape[0]):
            emitted[(r, n + j)] = int(rows[j].argmax())
    assert emitted == tokens
    for e in (eager, graphed, plain):
        e.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["resident", "adaptive"])
def test_mtp_rounds_over_a_hot_vocabulary_replay_the_eager_rounds(mode: str) -> None:
    """The shipped model's MTP draft steps scoring half its vocabulary (the hot head inside
    the draft steps' graphs): replays give the eager rounds' tokens, logits and acceptance bit
    for bit, and plain greedy's tokens."""
    run = functools.partial(
        _drive, mode, model=SHIPPED, pool_mib=512, hot_rows=512, drafter="mtp", draft_vocab=4096
    )
    eager, ref = run(graphs=False)
    graphed, got = run(graphs=True)
    plain, base = _drive(mode, graphs=True, model=SHIPPED, pool_mib=512, hot_rows=512)
    hot = graphed.passes.hot_head
    assert hot is not None and hot.ids.numel() == 4096
    graphs = graphed.passes.graphs
    assert graphs is not None and graphed.graphs_off_reason is None
    kinds = Counter(key[0] for key in graphs.held_keys())
    assert kinds["mtp"] > 0 and graphs.replays > 20
    assert graphed.speculator is not None and eager.speculator is not None
    accepted = graphed.speculator.counters.accepted
    assert accepted > 0 and accepted == eager.speculator.counters.accepted
    assert [(r, n) for r, n, _ in got] == [(r, n) for r, n, _ in ref]
    for (r, n, a), (_, _, b) in zip(ref, got, strict=True):
        assert torch.equal(a, b), f"{r} token {n}: logits differ"
    tokens = {(r, n): int(row[0].argmax()) for r, n, row in base}
    emitted = {(r, n + j): int(rows[j].argmax()) for r, n, rows in got for j in range(len(rows))}
    assert emitted == tokens
    for e in (eager, graphed, plain):
        e.close()


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", [sorted(FAMILIES)[0], SHIPPED])
@pytest.mark.parametrize("mode", ["resident", "adaptive"])
def test_mtp_blocks_replayed_as_one_graph_equal_the_eager_rounds(
    mode: str, checkpoint: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``GraphConfig.mtp_block``: a round's greedy MTP draft steps, where every request drafts
    each of them, replayed as one graph (``DecodeGraphs.mtp_block``: every step planned on the
    host first, one replay) give the eager rounds' tokens and logits bit for bit; rounds in
    which a request near its end drafts fewer steps take the graph of each step."""
    path = SHIPPED if checkpoint == SHIPPED else mtp_checkpoint(checkpoint, tmp_path_factory)[1]
    hot = 512 if checkpoint == SHIPPED else 64
    run = functools.partial(_drive, mode, model=str(path), pool_mib=512, hot_rows=hot)
    eager, ref = run(graphs=False, drafter="mtp")
    blocks, got = run(graphs=True, drafter="mtp", mtp_block=True)
    graphs = blocks.passes.graphs
    assert graphs is not None and graphs.mtp_blocks
    kinds = Counter(key[0] for key in graphs.held_keys())
    assert kinds["mtp_block"] > 0 and kinds["pass"] > 0 and graphs.replays > 20
    assert blocks.speculator is not None and eager.speculator is not None
    assert blocks.speculator.counters.accepted == eager.speculator.counters.accepted
    assert [(r, n) for r, n, _ in got] == [(r, n) for r, n, _ in ref]
    for (r, n, a), (_, _, b) in zip(ref, got, strict=True):
        assert torch.equal(a, b), f"{r} token {n}: logits differ"
    for e in (eager, blocks):
        e.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_replayed_fp8_decode_steps_equal_the_eager_steps(mode: str) -> None:
    """``kv_cache_dtype="fp8"`` under CUDA graphs: the Triton FP8 store, the index-key and
    attention-row gathers into fixed workspaces are captured; replays give the eager logits
    bit for bit, and every mode gives resident fp8's tokens."""
    eager, ref = _drive(mode, graphs=False, kv_cache_dtype="fp8")
    graphed, got = _drive(mode, graphs=True, kv_cache_dtype="fp8")
    assert graphed.kv.payload.pool(0).dtype == torch.uint8
    assert graphed.passes.graphs is not None and graphed.passes.graphs.captures > 1
    assert graphed.passes.graphs.replays > 50
    assert [(r, n) for r, n, _ in got] == [(r, n) for r, n, _ in ref]
    for (r, n, a), (_, _, b) in zip(ref, got, strict=True):
        assert torch.equal(a, b), f"{r} token {n}: logits differ"
    if mode != "resident":
        resident, base = _drive("resident", graphs=True, kv_cache_dtype="fp8")
        tokens = lambda seen: [(r, n, int(x[0].argmax())) for r, n, x in seen]  # noqa: E731
        assert tokens(got) == tokens(base)
        resident.close()
    if mode == "hisparse":
        assert graphed.kv.payload.census.host > 0
    eager.close()
    graphed.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["resident", "hisparse"])
def test_replayed_fp8_speculative_rounds_equal_the_eager_rounds(mode: str) -> None:
    """Verify passes over fp8 rows, replayed: the eager rounds' logits and accepted tokens."""
    eager, ref = _drive(mode, graphs=False, drafter="dflash", kv_cache_dtype="fp8")
    graphed, got = _drive(mode, graphs=True, drafter="dflash", kv_cache_dtype="fp8")
    assert graphed.passes.graphs is not None and graphed.passes.graphs.replays > 10
    assert graphed.speculator.counters.accepted == eager.speculator.counters.accepted
    assert [(r, n) for r, n, _ in got] == [(r, n) for r, n, _ in ref]
    for (r, n, a), (_, _, b) in zip(ref, got, strict=True):
        assert torch.equal(a, b), f"{r} token {n}: logits differ"
    eager.close()
    graphed.close()
