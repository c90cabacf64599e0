"""CUDA graphs of the decode pass: the model's forward and logits for a decode batch, captured
once per (batch size, index-key width, which sources share a plan and which are all direct) and
replayed with the live batch copied into the graph's input tensors.

A launch-bound decode step spends most of its time issuing ~700 small kernels from Python; a
replay issues them in one call. Everything the pass decides on the host happens before the
replay: the engine begins the pass on the KV cache (the hierarchy's plans: one copy into the
plan rows the graph reads) and picks the graph. Inside the graph nothing reads the host: the
resolver's clock is a device scalar, its workspace is reserved at its largest before the first
capture, top-k masks with ``masked_fill``, and the index keys are gathered at a bucketed width
(``model.key_rows``) that eager decode passes use too, so a replay computes what the eager pass
computes, bit for bit (``tests/worker/test_cuda_graph.py``, on a GPU).

A key is captured the second time a step meets it (with ``consecutive``, the second time in a
row): a capture costs several eager steps (measured on the H200: ~60 ms, against ~17 ms for an
eager step and 3-5 ms for a replay), and while requests arrive or finish one per step the batch
size changes every step, so most keys would never be replayed. Earlier sightings run eagerly;
the capturing one runs eagerly on the capture stream (warming every kernel the capture records)
and its result is used; the capture follows, without executing, and later steps with that key
replay. Graphs share one memory pool and never run concurrently; at most ``limit`` are kept,
the least recently used dropped first."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch

from services.worker.kv.batch import ForwardBatch
from services.worker.kv.cache import KVCache
from services.worker.model.model import DSAModel, key_rows

# when a key is captured: at its second sighting, or once two passes in a row meet it
CAPTURE_POLICIES = ("second", "consecutive")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # the captured batch: holds every input tensor the graph reads
    tokens: torch.Tensor  # [R] the new tokens (with batch.slots and .positions, refilled)
    plan_rows: torch.Tensor | None  # [U, 5, R] the hierarchy plans' rows the graph reads
    written: dict  # the payload's rows written by the pass (read by the commit)
    logits: torch.Tensor  # [R, V] the output


class DecodeGraphs:
    """Replays captured decode passes of ``model`` over ``kv`` (a CUDA device)."""

    def __init__(
        self,
        model: DSAModel,
        kv: KVCache,
        max_batch: int,
        limit: int = 64,
        capture_after: int = 2,
        consecutive: bool = False,
    ) -> None:
        self.model = model
        self.kv = kv
        self.max_batch = max_batch
        self.limit = limit
        self.device = next(model.parameters()).device
        self.stream = torch.cuda.Stream(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.capture_after = capture_after  # the sighting of a key that captures it
        # count only sightings in a row: a batch that changes every step stays eager
        self.consecutive = consecutive
        self._seen: OrderedDict[tuple, int] = OrderedDict()  # keys not captured: sightings
        self._last: tuple | None = None  # the previous pass's key
        self.eager = 0  # passes run eagerly before their key was captured
        self.captures = 0
        self.replays = 0
        self._reserved = False

    @staticmethod
    def supports(model: DSAModel) -> bool:
        """Sources without token rings (no compression, no local window): their passes write
        every row where it lives, with no host-sized scatter."""
        return all(src.compress == 1 and src.window == 0 for src in model.cfg.sources)

    def logits(self, tokens: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """[R, V] fp32 logits of a decode ``batch`` whose new tokens are ``tokens`` [R]; writes
        the pass's rows into the KV cache as the eager forward does (the caller commits)."""
        assert batch.is_decode, "only decode passes are captured"
        self.kv.begin(batch)
        payload = self.kv.payload
        plans = getattr(payload, "plans", [])
        key = (
            batch.num_requests,
            key_rows(max(batch.ends())),
            getattr(payload, "plan_index", ()),
            tuple(p.all_direct for p in plans),
        )
        g = self._graphs.get(key)
        last, self._last = self._last, key
        if g is None:
            seen = self._seen.pop(key, 0) + 1
            if self.consecutive and key != last:
                seen = 1
            if seen >= self.capture_after:
                return self._capture(key, tokens, batch)
            self._seen[key] = seen
            if len(self._seen) > 4 * self.limit:
                self._seen.popitem(last=False)
            self.eager += 1
            return self._eager(tokens, batch)
        self._graphs.move_to_end(key)
        g.tokens.copy_(tokens)
        g.batch.slots.copy_(batch.slots)
        g.batch.positions.copy_(batch.positions)
        if g.plan_rows is not None:
            g.plan_rows.copy_(payload.plan_rows)
        g.graph.replay()
        self.replays += 1
        if g.written:
            payload.written.update(g.written)
        return g.logits.clone()  # the next replay overwrites the graph's own

    def _eager(self, tokens: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(tokens, batch, self.kv, begin=False)
        return self.model.logits(hidden[batch.last_token_index])

    def _capture(self, key: tuple, tokens: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Runs this step eagerly on the capture stream, then captures its pass for the key."""
        self._reserve()
        main = torch.cuda.current_stream(self.device)
        payload = self.kv.payload
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            out = self._eager(tokens, batch)
        main.wait_stream(self.stream)
        if len(self._graphs) >= self.limit:
            self._graphs.popitem(last=False)
        # The graph's inputs: its own copies, which a replay refills.
        slots, positions = batch.slots.clone(), batch.positions.clone()
        static = dataclasses.replace(
            batch, slots=slots, positions=positions, token_slot=slots, starts_t=positions,
            token_req=batch.token_req.clone(), cu_lens=batch.cu_lens.clone(),
        )  # fmt: skip
        g_tokens = tokens.clone()
        written = dict(getattr(payload, "written", {}))  # this step's, for its commit
        plan_rows = getattr(payload, "plan_rows", None)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a metrics thread reading counters meanwhile does not break the capture
        with torch.cuda.graph(
            graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
        ):
            logits = self._eager(g_tokens, static)
        captured = dict(getattr(payload, "written", {}))
        if written or captured:
            payload.written.clear()
            payload.written.update(written)
        self._graphs[key] = _Graph(
            graph, static, g_tokens, plan_rows, captured, logits
        )  # fmt: skip
        self.captures += 1
        return out

    def _reserve(self) -> None:
        """The resolver's workspace on the capture stream, at its largest (see
        ``reserve_workspace``)."""
        if self._reserved:
            return
        self._reserved = True
        hot = getattr(self.kv.payload, "hot", None)
        if not hot:
            return
        from services.worker.kv.hierarchy.resolver_triton import reserve_workspace

        k = self.model.cfg.index_topk
        for entries in {h.entries for h in hot}:
            reserve_workspace(
                self.device, self.stream.cuda_stream, self.max_batch, k, self.max_batch, entries
            )

    def __len__(self) -> int:
        return len(self._graphs)
