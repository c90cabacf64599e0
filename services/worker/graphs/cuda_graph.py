"""CUDA graphs of the decode and verify passes and of the drafter's block pass.

A decode or verify pass, the model's forward and logits over a batch whose requests all add
the same number of tokens W (1 in a decode step, the block width K in a speculative verify
round), is captured once per (batch size, W, index-key width, which sources share a plan and
which are all direct, whether the drafter's target features are taken) and replayed with the
live batch copied into the graph's input tensors. The drafter's block pass (``Drafter.draft``)
is captured once per (batch size, whether any request samples). With ``GraphConfig.mtp_block``
a round's greedy MTP draft steps are one graph (``DecodeGraphs.mtp_block``), keyed by its
steps' keys: every step is planned on the host first, then one replay runs them all.

A launch-bound decode step spends most of its time issuing ~700 small kernels from Python; a
replay issues them in one call. Everything the pass decides on the host happens before the
replay: the engine begins the pass on the KV cache (the hierarchy's plans: one copy into the
plan rows the graph reads) and picks the graph. Inside the graph nothing reads the host: the
resolver's clock is a device scalar, its workspace is reserved at its largest before the first
capture, top-k masks with ``masked_fill``, and the index keys are gathered at a bucketed width
(``model.key_rows``) that eager decode and verify passes use too, so a replay computes what the
eager pass computes, bit for bit (``tests/worker/graphs/test_cuda_graph.py``, on a GPU).

A key is captured the second time a step meets it (with ``consecutive``, the second time in a
row): a capture costs several eager steps, and while requests arrive or finish one per step the
batch size changes every step, so most keys would never be replayed. Earlier sightings run eagerly;
the capturing one runs eagerly on the capture stream (warming every kernel the capture records)
and its result is used; the capture follows, without executing, and later steps with that key
replay. The graphs of one kind share one memory pool and never run concurrently, and write
their outputs into one shared buffer (``OutputArena``), from which a replay's outputs are
copied before the next pass: a graph holds no output memory of its own (a verify pass's logits
are [N, V] fp32), so many keys cost little memory. At most ``limit`` graphs are kept
(``graph_limit``: every key a full batch's ramps meet), the least recently used dropped
first."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from services.worker.kv.batch import ForwardBatch
from services.worker.kv.pass_rows import key_rows
from services.worker.kv.pass_state import PassState, Written
from services.worker.model.decoder import SparseDecoder
from services.worker.model.hot_vocab import HotHead
from services.worker.model.mla_mtp import MTPStep, greedy_block
from services.worker.serving.cache import KVCache

# A drafter's block pass (``Drafter.draft``): (slots, committed, anchors, temperatures, noise)
# -> (tokens, q, confidence)
DraftPass = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
]

# when a key is captured: at its second sighting, or once two passes in a row meet it
CAPTURE_POLICIES = ("second", "consecutive")
# graph keys a batch size can meet: a decode pass, verify passes at up to three widths, and
# the MTP layer's draft steps (with and without the target's hidden states; with MTP blocks,
# mostly a round's block instead)
KEYS_PER_BATCH = 6


def graph_limit(max_batch: int) -> int:
    """The decode graphs held at most: every key of every batch size up to ``max_batch``
    (requests arriving and finishing make each size appear), and no fewer than 64."""
    return max(64, KEYS_PER_BATCH * max_batch)


@dataclass(frozen=True)
class GraphConfig:
    """CUDA graphs on a GPU: whether decode and verify passes are captured and replayed, and
    when a key is captured (``CAPTURE_POLICIES``: at its ``second`` sighting, or when
    ``consecutive`` passes meet it, so a batch that changes every step, as in ramps and drains,
    is never captured). ``mtp``: the passes of a model served with its MTP layer are captured
    too (its lagged source's decode and verify passes and its draft steps); off, such a model
    runs eagerly. ``mtp_block``: a round's greedy MTP draft steps, where every request drafts
    each of them, are captured and replayed as one graph (``DecodeGraphs.mtp_block``) instead
    of a graph per step."""

    enabled: bool = True
    capture: str = "second"
    mtp: bool = True
    mtp_block: bool = False

    def __post_init__(self) -> None:
        if self.capture not in CAPTURE_POLICIES:
            raise ValueError(
                f"unknown graph capture policy {self.capture!r}; choose from {CAPTURE_POLICIES}"
            )


def pass_key(state: PassState, batch: ForwardBatch, features: dict | None) -> tuple:
    """The graph key of a decode or verify pass over ``batch``, once it began (``state``): batch
    size, queries per request, index-key width, which sources share a plan and which are all
    direct, and the feature layers taken."""
    return (
        batch.num_requests,
        batch.lens[0],
        key_rows(max(batch.ends())),
        *state.graph_key(),
        None if features is None else tuple(sorted(features)),
    )


def mtp_key(state: PassState, batch: ForwardBatch, hidden: bool, selection: bool) -> tuple:
    """The graph key of an MTP-only draft pass over ``batch``, once it began (``state``): batch
    size, index-key width, the plans' sharing, and whether the hidden states and the selection
    are given."""
    return (
        batch.num_requests, key_rows(max(batch.ends())), *state.graph_key(), not hidden,
        not selection,
    )  # fmt: skip


def eager_logits(
    model: SparseDecoder,
    kv: KVCache,
    tokens: torch.Tensor,
    batch: ForwardBatch,
    features: dict | None = None,
) -> torch.Tensor:
    """A decode or verify pass over ``batch``, begun on ``kv``, run eagerly: [N, V] logits
    (a decode pass's at each request's last token). What a captured graph holds."""
    hidden = model(tokens, batch, kv, features=features, begin=False)
    if batch.is_decode:
        hidden = hidden[batch.last_token_index]
    return model.logits(hidden)


def draft_key(slots: torch.Tensor, noise: torch.Tensor | None) -> tuple:
    """The graph key of a drafter's block pass: batch size, and whether any request samples."""
    return (len(slots), noise is not None)


class CaptureSchedule:
    """When each key is captured, and the graphs held: at most ``limit``, the least recently
    used dropped first. No device here: ``python -m bench graph-keys`` runs it on the CPU to count
    what a run would capture, replay and run eagerly."""

    def __init__(self, limit: int, capture_after: int, consecutive: bool) -> None:
        self.limit = limit
        self._graphs: OrderedDict[tuple, object] = OrderedDict()
        self.capture_after = capture_after  # the sighting of a key that captures it
        # count only sightings in a row: a batch that changes every step stays eager
        self.consecutive = consecutive
        self._seen: OrderedDict[tuple, int] = OrderedDict()  # keys not captured: sightings
        self._last: tuple | None = None  # the previous pass's key
        self.eager = 0  # passes run eagerly before their key was captured
        self.captures = 0
        self.replays = 0

    def lookup(self, key: tuple) -> tuple[object | None, bool]:
        """(the key's graph or None, whether to capture it now); counts the sighting."""
        g = self._graphs.get(key)
        last, self._last = self._last, key
        if g is not None:
            self._graphs.move_to_end(key)
            self.replays += 1
            return g, False
        seen = self._seen.pop(key, 0) + 1
        if self.consecutive and key != last:
            seen = 1
        if seen >= self.capture_after:
            return None, True
        self._seen[key] = seen
        if len(self._seen) > 4 * self.limit:
            self._seen.popitem(last=False)
        self.eager += 1
        return None, False

    def store(self, key: tuple, graph: object) -> None:
        """Holds the graph captured for ``key``, dropping the least recently used past
        ``limit``."""
        if len(self._graphs) >= self.limit:
            self._graphs.popitem(last=False)
        self._graphs[key] = graph
        self.captures += 1

    def __len__(self) -> int:
        return len(self._graphs)

    def held_keys(self) -> list[tuple]:
        """The keys whose graphs are held, the least recently used first."""
        return list(self._graphs)


def _tensors(out: object) -> list[torch.Tensor]:
    """The tensors in ``out`` (tensors, in tuples and dicts), in a fixed order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, tuple):
        return [t for v in out for t in _tensors(v)]
    return []


def _replaced(out: object, new: list[torch.Tensor]) -> object:
    """``out`` with its tensors (in ``_tensors``' order) taken from ``new``, front first."""
    if isinstance(out, torch.Tensor):
        return new.pop(0)
    if isinstance(out, dict):
        return {k: _replaced(v, new) for k, v in out.items()}
    if isinstance(out, tuple):
        parts = [_replaced(v, new) for v in out]
        return type(out)(*parts) if hasattr(out, "_fields") else tuple(parts)
    return out


class OutputArena:
    """One device buffer that the graphs of one kind write their outputs into, each graph's
    laid out from offset 0 (``ALIGN``-byte aligned). Sound because those graphs never run
    concurrently and a replay's outputs are copied out (``_cloned``) before the next pass. A
    graph whose outputs outgrow the buffer gets a larger one; graphs captured before keep
    theirs alive through their views."""

    ALIGN = 256

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buf: torch.Tensor | None = None

    @classmethod
    def _aligned(cls, t: torch.Tensor) -> int:
        """``t``'s bytes rounded up to ``ALIGN``: where the next output begins."""
        return -(-t.numel() * t.element_size() // cls.ALIGN) * cls.ALIGN

    @classmethod
    def nbytes(cls, out: object) -> int:
        return sum(cls._aligned(t) for t in _tensors(out))

    def reserve(self, out: object) -> None:
        """Room for outputs shaped as ``out``, allocated before a capture (never inside)."""
        need = self.nbytes(out)
        if self._buf is None or self._buf.numel() < need:
            self._buf = torch.empty(need, dtype=torch.uint8, device=self.device)

    def place(self, out: object) -> object:
        """``out`` copied into the buffer (``reserve``d for it): the same structure of views."""
        assert self._buf is not None, "reserve() before place()"
        views, at = [], 0
        for t in _tensors(out):
            n = t.numel() * t.element_size()
            view = self._buf[at : at + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            views.append(view)
            at += self._aligned(t)
        return _replaced(out, views)


class _Captures(CaptureSchedule):
    """A ``CaptureSchedule`` of graphs of one kind on a CUDA device: one memory pool, captured
    on one side stream."""

    def __init__(
        self, device: torch.device, limit: int, capture_after: int, consecutive: bool
    ) -> None:
        super().__init__(limit, capture_after, consecutive)
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.arena = OutputArena(device)

    def _run_then_capture(self, run: Callable[[], object]) -> object:
        """Runs ``run`` eagerly on the capture stream: its result is the step's."""
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            out = run()
        main.wait_stream(self.stream)
        return out

    def _record(
        self, run: Callable[[], object], like: object
    ) -> tuple[torch.cuda.CUDAGraph, object]:
        """Captures ``run`` (without executing it), whose outputs are shaped as ``like`` (its
        eager result): (the graph, its outputs, views of the shared ``arena``)."""
        self.arena.reserve(like)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a metrics thread reading counters meanwhile does not break the capture
        with torch.cuda.graph(
            graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
        ):
            out = self.arena.place(run())
        return graph, out


@dataclass
class _PassGraph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # the captured batch: holds every input tensor the graph reads
    tokens: torch.Tensor  # [N] the new tokens (with the batch's slots and positions, refilled)
    plan_rows: torch.Tensor | None  # [U, 5, R] the hierarchy plans' rows the graph reads
    completion_rows: torch.Tensor | None  # [2, G] the compressed rows the pass completes
    written: Written  # the rows the captured pass writes (read by the commit)
    inputs: tuple[torch.Tensor | None, ...]  # the pass's other inputs, refilled
    outputs: object  # what the pass returns: the graph's own tensors


def _static_batch(batch: ForwardBatch) -> ForwardBatch:
    """``batch`` with its own copies of every tensor a captured pass reads (a decode pass's
    slots are its token slots, its positions its starts)."""
    slots, positions = batch.slots.clone(), batch.positions.clone()
    token_slot, starts_t = slots, positions
    if not batch.is_decode:
        token_slot, starts_t = batch.token_slot.clone(), batch.starts_t.clone()
    return dataclasses.replace(
        batch, slots=slots, positions=positions, token_slot=token_slot, starts_t=starts_t,
        token_req=batch.token_req.clone(), cu_lens=batch.cu_lens.clone(),
    )  # fmt: skip


@dataclass(frozen=True)
class _BlockStep:
    """One draft step of an MTP block, planned: its batch, the payload's plans for it (views
    of ``plan_rows``; resident: none), and its graph key (``mtp_key``)."""

    batch: ForwardBatch
    plans: list
    plan_rows: torch.Tensor | None
    plan_index: tuple[int, ...]
    key: tuple


@dataclass
class _BlockGraph:
    graph: torch.cuda.CUDAGraph
    anchors: torch.Tensor  # [R] the first step's tokens, refilled
    steps: list[_BlockStep]  # each step's batch and plan rows, refilled
    tokens: torch.Tensor  # [R, S] the proposals: the graph's own (in the shared arena)
    written: Written  # the rows the last step writes


# A pass over the KV cache, begun there: (tokens [N], batch, other inputs) -> its outputs (tensors,
# in tuples and dicts)
PassRun = Callable[[torch.Tensor, ForwardBatch, tuple], object]


def _cloned(out: object) -> object:
    """``out`` with every tensor in it copied (the next replay overwrites the graph's own)."""
    return _replaced(out, [t.clone() for t in _tensors(out)])


class DecodeGraphs(_Captures):
    """Replays captured passes of ``model`` over ``kv`` (a CUDA device): decode and verify
    passes, batches of at most ``max_batch`` requests that each add the same W <=
    ``max_width`` tokens, and the MTP layer's draft passes (``mtp_step``), which never run
    beside them."""

    def __init__(
        self,
        model: SparseDecoder,
        kv: KVCache,
        max_batch: int,
        limit: int | None = None,
        capture_after: int = 2,
        consecutive: bool = False,
        max_width: int = 1,
        mtp_blocks: bool = False,
    ) -> None:
        """``limit``: the graphs held (default ``graph_limit(max_batch)``); ``mtp_blocks``: a
        round's greedy MTP draft steps are one graph (``mtp_block``)."""
        device = next(model.parameters()).device
        limit = graph_limit(max_batch) if limit is None else limit
        super().__init__(device, limit, capture_after, consecutive)
        self.model = model
        self.kv = kv
        self.max_batch = max_batch
        self.max_width = max_width
        self.mtp_blocks = mtp_blocks
        self._reserved = False

    def covers(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is a pass these graphs take: every request adds W <= max_width
        tokens (a prefill of short uniform chunks is too, but the engine asks only for
        decode and verify passes)."""
        w = batch.lens[0]
        return (
            w <= self.max_width
            and batch.num_requests <= self.max_batch
            and all(n == w for n in batch.lens)
        )

    def logits(
        self,
        tokens: torch.Tensor,
        batch: ForwardBatch,
        features: dict[int, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """[N, V] fp32 logits of every new token of ``batch`` (``covers``), whose new tokens are
        ``tokens`` [N]; writes the pass's rows into the KV cache as the eager forward does (the
        caller commits). ``features``: as ``SparseDecoder.forward`` takes them, filled."""
        assert self.covers(batch), "a pass of one width W <= max_width per request"
        self.kv.payload.begin(batch)
        key = ("pass", *pass_key(self.kv.payload.pass_state, batch, features))

        def run(t: torch.Tensor, b: ForwardBatch, _: tuple) -> object:
            feats = None if features is None else dict.fromkeys(features)
            return eager_logits(self.model, self.kv, t, b, feats), feats

        logits, feats = self._pass(key, tokens, batch, (), run)  # type: ignore[misc]
        if features is not None:
            features.update(feats)
        return logits

    def mtp_step(
        self,
        tokens: torch.Tensor,
        batch: ForwardBatch,
        hidden: torch.Tensor | None,
        selection: torch.Tensor | None,
        hot: HotHead | None = None,
    ) -> MTPStep:
        """The model's MTP-only draft pass (``mtp_step``) over a decode-shaped ``batch`` of the
        MTP source, replayed once its key was captured: batch size, index-key width, the
        plans' sharing, and whether the hidden states and the selection are given. ``hot``:
        the engine's hot head (``HotHead``), the same at every call: a graph holds its rows."""
        self.kv.payload.begin(batch)
        if batch.num_requests > self.max_batch:
            return self.model.mtp_step(
                tokens, batch, self.kv, hidden, selection, begin=False, hot=hot
            )
        state = self.kv.payload.pass_state
        key = ("mtp", *mtp_key(state, batch, hidden is not None, selection is not None))

        def run(t: torch.Tensor, b: ForwardBatch, inputs: tuple) -> object:
            return self.model.mtp_step(t, b, self.kv, *inputs, begin=False, hot=hot)

        out = self._pass(key, tokens, batch, (hidden, selection), run)
        assert isinstance(out, MTPStep)
        return out

    def mtp_block(
        self,
        anchors: torch.Tensor,
        batches: Sequence[ForwardBatch],
        share_index: bool,
        hot: HotHead | None = None,
    ) -> torch.Tensor:
        """``greedy_block`` of the model's MTP draft steps over ``batches`` (one per step, each
        decode-shaped, of the MTP source), replayed as one graph once its key was captured:
        the steps' keys (``mtp_key``) together. Every step is planned on the host first (the
        payload's ``begin``: host work only, each plan uploaded to a fresh tensor), and a replay
        refills each step's inputs and plan rows. ``hot``: as ``mtp_step`` takes it."""
        if batches[0].num_requests > self.max_batch:  # step by step, eagerly
            return greedy_block(partial(self.mtp_step, hot=hot), anchors, batches, share_index)
        state = self.kv.payload.pass_state
        steps = []
        for i, b in enumerate(batches):
            self.kv.payload.begin(b)
            key = mtp_key(state, b, i > 0, i > 0 and share_index)
            steps.append(_BlockStep(b, state.plans, state.plan_rows, state.plan_index, key))
        key = ("mtp_block", share_index, *(s.key for s in steps))
        g, capture = self.lookup(key)
        if capture:
            return self._capture_block(key, anchors, steps, share_index, hot)
        if g is None:
            return self._run_block(anchors, steps, share_index, hot)
        assert isinstance(g, _BlockGraph)
        g.anchors.copy_(anchors)
        for dst, src in zip(g.steps, steps, strict=True):
            dst.batch.slots.copy_(src.batch.slots)
            dst.batch.positions.copy_(src.batch.positions)
            if dst.plan_rows is not None:
                assert src.plan_rows is not None
                dst.plan_rows.copy_(src.plan_rows)
        g.graph.replay()
        state.written.update(g.written)
        return g.tokens.clone()

    def _run_block(
        self,
        anchors: torch.Tensor,
        steps: list[_BlockStep],
        share_index: bool,
        hot: HotHead | None,
    ) -> torch.Tensor:
        """The block's steps eagerly, each begun on its planned pass (``steps``)."""
        state = self.kv.payload.pass_state
        it = iter(steps)

        def run(
            t: torch.Tensor, b: ForwardBatch, h: torch.Tensor | None, sel: torch.Tensor | None
        ) -> MTPStep:
            s = next(it)
            state.begin(b, s.plans, s.plan_rows, s.plan_index)
            return self.model.mtp_step(t, b, self.kv, h, sel, begin=False, hot=hot)

        return greedy_block(run, anchors, [s.batch for s in steps], share_index)

    def _capture_block(
        self,
        key: tuple,
        anchors: torch.Tensor,
        steps: list[_BlockStep],
        share_index: bool,
        hot: HotHead | None,
    ) -> torch.Tensor:
        """Runs the block eagerly on the capture stream, then captures it for the key: each
        step begun on its own copy of the batch and on the plan rows the graph then reads."""
        self._reserve()
        out = self._run_then_capture(lambda: self._run_block(anchors, steps, share_index, hot))
        written = dict(self.kv.payload.pass_state.written)
        # each step's batch: the graph's own copy; its plan rows: the ones its plans are views
        # of (a fresh tensor per plan), which the graph keeps and a replay refills
        static = [dataclasses.replace(s, batch=_static_batch(s.batch)) for s in steps]
        g_anchors = anchors.clone()
        state = self.kv.payload.pass_state
        graph, tokens = self._record(
            lambda: self._run_block(g_anchors, static, share_index, hot), out
        )
        captured = dict(state.written)  # the last step's rows, as every replay writes them
        state.written.clear()
        state.written.update(written)
        self.store(key, _BlockGraph(graph, g_anchors, static, tokens, captured))
        return out

    def _pass(
        self, key: tuple, tokens: torch.Tensor, batch: ForwardBatch, inputs: tuple, run: PassRun
    ) -> object:
        """``run`` over (``tokens``, ``batch``, ``inputs``), begun on the KV cache: eager until
        its key is captured, then replayed with the live inputs copied into the graph's."""
        state = self.kv.payload.pass_state
        g, capture = self.lookup(key)
        if capture:
            return self._capture(key, tokens, batch, inputs, run)
        if g is None:
            return run(tokens, batch, inputs)
        assert isinstance(g, _PassGraph)
        g.tokens.copy_(tokens)
        g.batch.slots.copy_(batch.slots)
        g.batch.positions.copy_(batch.positions)
        if g.batch.token_slot is not g.batch.slots:  # a verify pass: per-token inputs too
            g.batch.token_slot.copy_(batch.token_slot)
            g.batch.starts_t.copy_(batch.starts_t)
        if g.plan_rows is not None:
            assert state.plan_rows is not None
            g.plan_rows.copy_(state.plan_rows)
        if g.completion_rows is not None:
            assert state.completion_rows is not None
            g.completion_rows.copy_(state.completion_rows)
        for dst, src in zip(g.inputs, inputs, strict=True):
            if dst is not None:
                dst.copy_(src)
        g.graph.replay()
        state.written.update(g.written)
        return _cloned(g.outputs)

    def _capture(
        self, key: tuple, tokens: torch.Tensor, batch: ForwardBatch, inputs: tuple, run: PassRun
    ) -> object:
        """Runs this pass eagerly on the capture stream, then captures it for the key."""
        self._reserve()
        state = self.kv.payload.pass_state
        out = self._run_then_capture(lambda: run(tokens, batch, inputs))
        static = _static_batch(batch)  # the graph's inputs: its own copies, refilled
        g_tokens = tokens.clone()
        g_inputs = tuple(None if x is None else x.clone() for x in inputs)
        written = dict(state.written)  # this step's, for its commit
        plan_rows, completion_rows = state.plan_rows, state.completion_rows
        graph, outputs = self._record(lambda: run(g_tokens, static, g_inputs), out)
        captured = dict(state.written)  # what every replay writes
        state.written.clear()
        state.written.update(written)
        self.store(key, _PassGraph(
            graph, static, g_tokens, plan_rows, completion_rows, captured, g_inputs, outputs
        ))  # fmt: skip
        return out

    def _reserve(self) -> None:
        """The resolver's workspace on the capture stream, at its largest (see
        ``reserve_workspace``)."""
        if self._reserved:
            return
        self._reserved = True
        self.kv.payload.reserve_graph_workspace(
            self.stream.cuda_stream, self.max_batch * self.max_width, self.max_batch
        )


@dataclass
class _DraftGraph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # slots, committed, anchors, temperatures[, noise]
    outputs: tuple[torch.Tensor | None, ...]  # tokens, q, confidence


class DraftGraphs(_Captures):
    """Replays captured block passes ``draft`` of a drafter whose weights are on ``device``, for
    batches of at most ``max_batch`` requests; the drafter's ring is read inside the graph, at
    its fixed address."""

    def __init__(
        self,
        draft: DraftPass,
        device: torch.device,
        max_batch: int,
        limit: int | None = None,
        capture_after: int = 2,
    ) -> None:
        """``limit``: the graphs held (default: both keys of every batch size, at least 64)."""
        limit = max(64, 2 * max_batch) if limit is None else limit
        super().__init__(device, limit, capture_after, consecutive=False)
        self.run = draft
        self.max_batch = max_batch

    def draft(
        self,
        slots: torch.Tensor,
        num_committed: torch.Tensor,
        anchors: torch.Tensor,
        temperatures: torch.Tensor,
        noise: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``Drafter.draft``, replayed once its key was captured."""
        inputs = (slots, num_committed, anchors, temperatures) + (() if noise is None else (noise,))
        if len(slots) > self.max_batch:
            return self.run(*inputs[:4], noise)
        key = draft_key(slots, noise)
        g, capture = self.lookup(key)
        if capture:
            out = self._run_then_capture(lambda: self.run(*inputs[:4], noise))
            static = tuple(x.clone() for x in inputs)
            s_noise = static[4] if noise is not None else None
            graph, outputs = self._record(lambda: self.run(*static[:4], s_noise), out)
            self.store(key, _DraftGraph(graph, static, outputs))  # type: ignore[arg-type]
            return out  # type: ignore[return-value]
        if g is None:
            return self.run(*inputs[:4], noise)
        assert isinstance(g, _DraftGraph)
        for dst, src in zip(g.inputs, inputs, strict=True):
            dst.copy_(src)
        g.graph.replay()
        tokens, q, conf = (None if o is None else o.clone() for o in g.outputs)
        assert tokens is not None and q is not None
        return tokens, q, conf
