"""Speculative decoding in the engine: one verify pass per round over the KV hierarchy.

Per round and request r (anchor at position n = the committed tokens): the drafter proposes
K_r - 1 tokens; the target runs the chunk [anchor, x_1 .. x_{K_r-1}] at positions n .. n+K_r-1
in one pass with the rest of the batch (each query keeps its own selection and causal mask; the
resolver serves the union of a request's selections once, eq. 6); verification accepts A_r of
the proposals and emits a correction or bonus; positions n .. n+A_r are committed (eq. 7, and
the complete compressed rows of eq. 8) and the rest is never published. The drafter's context
advances with the same committed positions."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dhisparse.paths import resolve_path
from services.worker.graphs.cuda_graph import DraftGraphs
from services.worker.kv.batch import ForwardBatch
from services.worker.model.decoder import SparseDecoder
from services.worker.model.hot_vocab import HotHead
from services.worker.model.mla_decoder import MLADecoder
from services.worker.model.mla_mtp import MTPStepFn
from services.worker.model.v4_serving import V4Model
from services.worker.request.grammar_masks import Block
from services.worker.request.request import Request
from services.worker.serving.cache import KVCache
from services.worker.speculative.config import SpeculationConfig
from services.worker.speculative.drafters.config import DrafterConfig
from services.worker.speculative.drafters.io import DRAFTERS, build_drafter, load_drafter
from services.worker.speculative.drafters.mtp import MTPBlockFn, MTPDrafter
from services.worker.speculative.drafters.runtime import RuntimeDrafter
from services.worker.speculative.proposal import verify_ids
from services.worker.speculative.target import Target
from services.worker.speculative.verify import verify_batch
from services.worker.speculative.width_controller import WidthController
from services.worker.transfers import to_device


@dataclass
class SpecCounters:
    """Cumulative speculation counters (vLLM's conventions), read by metrics and benchmarks."""

    drafts: int = 0  # verification rounds (request-rounds)
    draft_tokens: int = 0  # proposals verified
    accepted: int = 0  # proposals accepted
    per_position: list[int] = field(default_factory=list)
    width: int = 0  # the block width in use (K, anchor included; 0/1: off)

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / max(self.drafts, 1)


class MTPPasses(Protocol):
    """The engine's passes of the MTP layer over its KV cache (``engine.passes.ModelPasses``)."""

    mtp_step: MTPStepFn  # one draft step
    mtp_block: MTPBlockFn  # a round's greedy draft steps at once
    hot_head: HotHead | None  # the hot ids the steps score (None: the whole vocabulary)


def make_drafter(
    spec: str, target: SparseDecoder, block: int, seed: int, mtp: MTPPasses | None = None
) -> RuntimeDrafter:
    """``spec``: a drafter kind (random weights, seeded), ``mtp`` (the target's own MTP layer,
    run by the engine's passes ``mtp``) or a checkpoint directory."""
    dtype = target.dtype
    if spec == MTPDrafter.kind:
        if not isinstance(target, MLADecoder | V4Model) or target.mtp is None or mtp is None:
            raise ValueError("the MTP drafter needs a target loaded with its MTP layer")
        return MTPDrafter(
            mtp.mtp_step, target.cfg.layers[target.mtp_layer].source, target.cfg.vocab_size,
            block, target.mtp_index_share, next(target.parameters()).device, mtp.mtp_block,
            mtp.hot_head,
        )  # fmt: skip
    if spec in DRAFTERS:
        cfg = DrafterConfig.for_target(target.cfg, spec, block_size=block)
        return build_drafter(cfg, target, seed=seed, dtype=dtype)
    path = resolve_path(spec)
    if not path.is_dir():
        kinds = sorted([*DRAFTERS, MTPDrafter.kind])
        raise ValueError(f"drafter {spec!r} is neither a kind {kinds} nor a directory")
    return load_drafter(path, target, dtype=dtype)


def _same(k: int) -> int:
    return k


# the target's verify pass: (tokens [N], batch, features) -> [N, V] fp32 logits
VerifyPass = Callable[[torch.Tensor, ForwardBatch, dict | None], torch.Tensor]


class Speculator:
    """The engine's speculative path: drafting, the verify pass and the commit, over the
    narrow ``Target`` the engine offers."""

    def __init__(
        self,
        target: Target,
        kv: KVCache,
        forward: VerifyPass,
        drafter: RuntimeDrafter,
        cfg: SpeculationConfig,
        max_slots: int,
        page_size: int,
        max_model_len: int,
        cold_passes: Callable[[], int] = lambda: 0,
    ) -> None:
        """``kv``: the cache the target's passes write, ``forward``: the target's verify pass
        (logits of every new token of a batch, its rows written uncommitted); ``cold_passes``:
        the target's passes so far that captured a CUDA graph or ran eagerly while graphs are
        on (a round that met one is no measure of its width's time)."""
        self.target = target
        self.kv = kv
        self.forward = forward
        self.target_cold = cold_passes
        self.max_model_len = max_model_len
        self.drafter = drafter
        # The widest block verified: the configured width, within the drafter's block.
        self.k_max = max(1, min(cfg.width, drafter.block_size))
        drafter.init_ring(max_slots, page_size=page_size)
        self.layers = tuple(drafter.target_layers)
        # The drafter's ring and staging are reserved for K_max and all slots at start, so every
        # width, off included, keeps the same sessions here.
        self.widths = WidthController(
            cfg.width_policy, self.k_max, dict.fromkeys(range(self.k_max + 1), max_slots)
        )
        self.counters = SpecCounters(per_position=[0] * (self.k_max - 1))
        self.graphs: DraftGraphs | None = None  # the block pass's CUDA graphs (on a GPU)
        # the width every rank of a group verifies: rank 0's choice (``Lockstep.agree``)
        self.agree: Callable[[int], int] = _same
        # the clock a round's time is read from (the online width policy's measure)
        self.clock: Callable[[], float] = time.perf_counter

    def capture(self, max_batch: int) -> None:
        """Replays the drafter's block passes from CUDA graphs (on a GPU). The MTP drafter has
        none: its steps are passes of the model over the KV cache, which the engine's
        graphs replay (``ModelPasses.mtp_step``)."""
        if isinstance(self.drafter, MTPDrafter):
            return
        self.graphs = DraftGraphs(self.drafter.draft, self.drafter.device, max_batch)

    def features(self) -> dict[int, torch.Tensor]:
        return dict.fromkeys(self.layers)  # type: ignore[arg-type]

    def follow(
        self, reqs: list[Request], batch: ForwardBatch, starts: list[int], feats: dict
    ) -> None:
        """After a plain pass (prefill or decode) that committed every token of ``batch``: one
        context write for all of them; a request's first pass here (from 0, or from the tokens
        it imported or adopted) starts a fresh draft context."""
        for req, start in zip(reqs, starts, strict=True):
            if start in (0, req.resumed_tokens):
                assert req.slot is not None
                self.drafter.begin(req.slot)
        self.drafter.append_context(
            batch.token_slot, batch.positions, feats, per_slot=max(batch.lens)
        )

    def release(self, slot: int) -> None:
        self.drafter.release(slot)

    @torch.no_grad()
    def round(self, reqs: list[Request], memory_waits: int = 0) -> list:
        """One verify round for ``reqs`` (all decoding); returns their outputs.
        ``memory_waits``: admissions waiting because memory binds (the width policy reads it)."""
        eng = self.target
        load = len(reqs)
        k = self.agree(self.widths.width(load, memory_waits))
        self.counters.width = k
        cold = self._cold_passes()
        t0 = self.clock()
        if k <= 1:
            outs = eng.run_pass(reqs)
            self.widths.observe(0, load, self.clock() - t0, cold=self._cold_passes() > cold)
            return outs
        caps = [self._cap(r, k) for r in reqs]
        anchors = [r.output_ids[-1] for r in reqs]
        starts = [r.num_tokens - 1 for r in reqs]
        prop = self.drafter.propose(
            [r.slot for r in reqs], anchors, starts, caps,
            [r.params.temperature for r in reqs], [eng.generator(r) for r in reqs],
            **({"run": self.graphs.draft} if self.graphs is not None else {}),
        )  # fmt: skip
        widths = prop.widths  # K_r <= caps[r]: the rows verified
        # The pass runs K queries for every request when each has room for them, so its shape,
        # and with it its CUDA graph, does not depend on which requests near their end: a
        # request of K_r < K verifies its first K_r rows, and its others (the anchor again)
        # are computed, never committed nor read.
        passed = [k] * load
        if any(c < k and not self._room(r, k) for r, c in zip(reqs, caps, strict=True)):
            passed = widths
        batch = ForwardBatch.build([r.slot for r in reqs], starts, passed, eng.device)
        feats = self.features()
        # the verify pass is launched on the proposals where they are; the host reads them
        # (one read-back for every request's) while the device verifies
        ids = verify_ids(prop.tokens, anchors, widths, passed)
        logits = self.forward(ids, batch, feats)  # [sum K, V]
        proposed = prop.tokens.tolist()
        cu = batch.cu
        # the grammars' masks, filled by their process while the device verifies
        eng.grammar_masks.fill(
            [
                Block(req.grammar, cu[r], widths[r], proposed[r][: widths[r] - 1])
                for r, req in enumerate(reqs)
                if req.grammar is not None
            ]
        )
        for r, req in enumerate(reqs):
            # row j scores the token after the anchor and proposals 1..j
            req.shape_logits(
                logits[cu[r] : cu[r] + widths[r]], proposed[r][: widths[r] - 1], eng.eos_token_ids
            )
        eng.grammar_masks.apply(logits)
        verified = logits
        if passed != widths:  # each request's first K_r rows
            rows = [j for r, w in enumerate(widths) for j in range(cu[r], cu[r] + w)]
            verified = logits[to_device(rows, eng.device)]
        verdicts = verify_batch(
            verified, widths, prop.tokens, prop.probs, [r.params for r in reqs],
            [eng.generator(r) for r in reqs], drafts=proposed,
        )  # fmt: skip
        committed = [s + v.num_accepted + 1 for s, v in zip(starts, verdicts, strict=True)]
        self.kv.commit(batch, committed)
        if self.drafter.context_window:  # a context of its own (the MTP layer's is the cache's)
            keep = [
                j for r, v in enumerate(verdicts) for j in range(cu[r], cu[r] + v.num_accepted + 1)
            ]
            keep_t = to_device(keep, eng.device)
            self.drafter.append_context(
                batch.token_slot[keep_t], batch.positions[keep_t],
                {i: f[keep_t] for i, f in feats.items()},
                per_slot=max(v.num_accepted for v in verdicts) + 1,
            )  # fmt: skip
        outs = []
        for r, (req, v) in enumerate(zip(reqs, verdicts, strict=True)):
            c = self.counters
            c.drafts += 1
            c.draft_tokens += widths[r] - 1
            c.accepted += v.num_accepted
            for i in range(v.num_accepted):
                c.per_position[i] += 1
            req.num_computed = committed[r]
            new = [*proposed[r][: v.num_accepted], v.next_token]
            outs.append(eng.emit(req, new, logits[cu[r] : cu[r] + len(new)]))
        self.widths.observe(
            k, load, self.clock() - t0,
            [v.num_accepted for v in verdicts], [w - 1 for w in widths],
            cold=self._cold_passes() > cold,
        )  # fmt: skip
        return outs

    def _cold_passes(self) -> int:
        """The target's cold passes and the drafter's block passes that captured or ran
        eagerly."""
        own = 0 if self.graphs is None else self.graphs.captures + self.graphs.eager
        return self.target_cold() + own

    def _cap(self, req: Request, k: int) -> int:
        """The most queries ``req`` can verify this round (anchor included): within its token
        budget and context, and with KV room for all of them (else one query)."""
        left = min(req.params.max_tokens - len(req.output_ids), self.max_model_len - req.num_tokens)
        cap = max(1, min(k, left))
        assert req.slot is not None
        if not self.kv.ensure(req.slot, req.num_tokens - 1 + cap):
            cap = 1
        return cap

    def _room(self, req: Request, k: int) -> bool:
        """Whether ``req`` has KV room for k queries this round, within its context (rows past
        what it commits are written, then never read)."""
        end = req.num_tokens - 1 + k
        assert req.slot is not None
        return end <= self.max_model_len and self.kv.ensure(req.slot, end)
