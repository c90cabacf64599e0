"""The MTP drafter (``--drafter mtp``): the checkpoint's own multi-token-prediction layer, run
autoregressively for K_r - 1 steps (docs/mtp.md).

Unlike the windowed drafters it keeps no state of its own: its context is the MTP layer's KV
source in the hierarchy, which every target pass fills (``MLADecoder``, ``V4Model``), so
``begin``, ``append_context`` and ``release`` have nothing to do, and a resumed session drafts
at once.
Step i of a round over the anchor at position n is one MTP-only pass over the token at n + i
(the anchor, then step i-1's proposal) with the hidden state before it (the target's, from the
carry, then step i-1's); with ``share_index`` (``index_share_for_mtp_iteration``) steps after
the first attend the rows the first selected. With a hot head (``model.hot_vocab``) each step
scores only the hot ids: greedy proposals are the step's ``tokens`` (vocabulary ids), and a
sampled proposal's q is spread back over the whole vocabulary, zero outside the hot set."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from services.worker.kv.batch import ForwardBatch
from services.worker.model.hot_vocab import HotHead
from services.worker.model.mla_mtp import MTPStepFn, greedy_block
from services.worker.speculative.config import MTP
from services.worker.speculative.proposal import (
    Proposal,
    draw,
    exp_noise,
    finish,
    per_request,
    tempered,
)
from services.worker.transfers import to_device

# (anchors [R], each step's batch, share_index) -> [R, S] greedy proposals (``greedy_block``)
MTPBlockFn = Callable[[torch.Tensor, Sequence[ForwardBatch], bool], torch.Tensor]


class MTPDrafter:
    kind: ClassVar[str] = MTP
    target_layers: tuple[int, ...] = ()  # conditioned on the carry, not on layer features
    context_window: int = 0  # its context is the KV cache's

    def __init__(
        self,
        step: MTPStepFn,
        source: int,
        vocab_size: int,
        block_size: int,
        share_index: bool,
        device: torch.device,
        block: MTPBlockFn | None = None,
        hot: HotHead | None = None,
    ) -> None:
        """``step``: runs one MTP-only pass (the engine's, over its KV cache); ``source``: the
        MTP layer's KV source; ``block_size``: K_max, anchor included; ``block``: runs every
        greedy step of a round at once (the engine's, which a CUDA graph may hold; default:
        ``greedy_block`` over ``step``); ``hot``: the hot head ``step`` scores with, if any."""
        if block_size < 2:
            raise ValueError("a block needs an anchor and at least one proposal (K_max >= 2)")
        self.step = step
        self.source = source
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.share_index = share_index
        self.device = device
        self.block = block or (lambda a, bs, share: greedy_block(step, a, bs, share))
        self.hot = hot

    # ---- the runtime contract of every drafter: nothing of its own to keep -----------------
    def init_ring(self, max_slots: int, page_size: int = 16) -> None:
        """No draft ring: the MTP layer's KV is a source of the KV cache."""

    def begin(self, slot: int) -> None:
        """A request's MTP rows are its slot's: the KV cache seats and clears them."""

    def release(self, slot: int) -> None:
        pass

    def append_context(self, slots, positions, features, per_slot=None) -> None:
        """The target's passes write the MTP rows of committed positions themselves."""

    def choose_widths(self, widths: list[int], confidence: torch.Tensor | None) -> list[int]:
        return widths

    @torch.no_grad()
    def propose(
        self,
        slots: Sequence[int],
        anchors: torch.Tensor | Sequence[int],
        num_committed: Sequence[int],
        widths: Sequence[int] | None = None,
        temperatures: float | Sequence[float] = 0.0,
        generators: Sequence[torch.Generator | None] | None = None,
        run: object = None,
    ) -> Proposal:
        """Drafts ``widths[r] - 1`` tokens (at most K_max - 1) for each request r, whose
        ``num_committed[r]`` = n tokens are committed and whose anchor is at position n.
        Proposals are greedy where the temperature is 0, else drawn from the MTP layer's
        tempered distribution with the request's generator. ``run`` is not used (no graphs)."""
        del run
        r, kmax, dev = len(slots), self.block_size, self.device
        caps, temps, gens = per_request(r, kmax, widths, temperatures, generators)
        noise = None
        if any(t > 0.0 for t in temps):
            noise = exp_noise((kmax - 1, self.vocab_size), temps, gens, dev)
        temps_t = to_device(temps, dev, torch.float32)
        tokens = torch.full((r, kmax - 1), -1, dtype=torch.int64, device=dev)
        probs = None
        if noise is not None:
            probs = torch.zeros(r, kmax - 1, self.vocab_size, dtype=torch.float32, device=dev)
        current = (
            to_device(list(anchors), dev)
            if not isinstance(anchors, torch.Tensor)
            else (anchors.to(dev, torch.int64))
        )
        if noise is None and min(caps) == kmax:
            # every request greedy and drafting every step: the steps as one block
            src = (self.source,)
            starts = [[n + i for n in num_committed] for i in range(kmax - 1)]
            batches = [
                ForwardBatch.build(list(slots), s, [1] * r, dev, sources=src) for s in starts
            ]
            return finish(self.block(current, batches, self.share_index), None, caps)
        hidden: torch.Tensor | None = None  # [r, d] each request's last step's output
        first: torch.Tensor | None = None  # [r, k] each request's first step's selection
        for i in range(kmax - 1):
            active = [j for j in range(r) if caps[j] - 1 > i]  # requests still drafting
            if not active:
                break
            # every request drafting (the usual case): views of whole tensors, no gathers
            idx = slice(None) if len(active) == r else to_device(active, dev)
            batch = ForwardBatch.build(
                [slots[j] for j in active], [num_committed[j] + i for j in active],
                [1] * len(active), dev, sources=(self.source,),
            )  # fmt: skip
            given = first[idx] if self.share_index and first is not None else None
            out = self.step(current[idx], batch, None if hidden is None else hidden[idx], given)
            if noise is None:  # every request greedy: q is one-hot on the argmax
                drafted = out.tokens
            else:
                q = tempered(out.logits, temps_t[idx])
                if self.hot is not None:  # [r, N] over the hot ids -> [r, V]
                    q = self.hot.probs(q)
                drafted = draw(q, noise[idx, i])
                assert probs is not None
                probs[idx, i] = q
            tokens[idx, i] = drafted
            if hidden is None:
                hidden = out.hidden.new_zeros(r, out.hidden.shape[-1])
                first = out.selection.new_full((r, out.selection.shape[-1]), -1)
                first[idx] = out.selection
            hidden[idx] = out.hidden
            current[idx] = drafted
        return finish(tokens, probs, caps)
