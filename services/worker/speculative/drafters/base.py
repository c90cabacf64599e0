"""The drafter common to DFlash, DSpark and DFlash2: a few draft layers conditioned on target
features, drafting a block ``[anchor, MASK × (K_max-1)]`` in one parallel pass.

Conditioning (DFlash): the outputs of ``cfg.target_layers`` at a committed position are
concatenated, projected (Linear) and normed into one *context feature*; every draft layer turns
it into context K/V (cached in the draft ring for the last W committed positions) that the
block's queries attend to together with the block's own K/V. The drafter borrows the target's
embeddings and lm_head. Subclasses differ in how they turn the block's hidden states into
proposals (``select``) and in their training loss (``loss``).

Runtime contract (what the engine calls, per request slot):
  ``begin(slot)``; after each target pass that commits positions, ``append_context`` with
  their target features (the prompt after prefill; the anchor and accepted prefix after each
  verification); ``propose`` with the anchor at position n = committed tokens; ``release``.
The drafter's state advances only with committed tokens.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from services.worker.model.decoder import SparseDecoder
from services.worker.model.layers import RMSNorm
from services.worker.speculative.draft_ring import DraftRing
from services.worker.speculative.drafters.config import DrafterConfig
from services.worker.speculative.drafters.layers import DraftLayer
from services.worker.speculative.proposal import Proposal, exp_noise, finish, per_request
from services.worker.transfers import to_device

# (layer) -> context k, v: [R, S, H*D], read from the ring or gathered for training
ContextFn = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
# (slots, committed, anchors, temperatures, noise) -> (tokens, q, confidence): ``Drafter.draft``
DraftFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
]


class _Borrowed:
    """The target, whose embeddings and lm_head the drafter uses but does not own: a plain
    attribute, not a submodule, so it is neither saved with nor trained by the drafter."""

    def __init__(self, target: SparseDecoder) -> None:
        self.target = target


class Drafter(nn.Module, abc.ABC):
    kind: ClassVar[str] = ""

    def __init__(self, cfg: DrafterConfig, target: SparseDecoder) -> None:
        super().__init__()
        cfg.validate()
        tc = target.cfg
        if (cfg.vocab_size, cfg.d_model) != (tc.vocab_size, tc.d_model):
            raise ValueError(f"drafter for {cfg.target!r} does not fit target {tc.name!r}")
        if not all(0 <= i < tc.n_layers for i in cfg.target_layers):
            raise ValueError(f"target layers {cfg.target_layers} outside 0..{tc.n_layers - 1}")
        self.cfg = cfg
        self.borrowed = _Borrowed(target)
        d = cfg.d_model
        self.fc = nn.Linear(len(cfg.target_layers) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.ring: DraftRing | None = None

    # ---- the shared forward pieces ----------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def context_window(self) -> int:
        """W: the committed positions its proposals read, kept in its draft ring."""
        return self.cfg.window

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.cfg.target_layers

    def fuse(self, features: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """Target features {layer: [..., d]} -> [..., d] context features."""
        x = torch.cat([features[i] for i in self.cfg.target_layers], dim=-1)
        return self.hidden_norm(self.fc(x.to(self.fc.weight.dtype)))

    def context_kv(
        self, fused: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fused: [N, d] at positions [N] -> k, v: [L, N, H*D], every draft layer's context."""
        kv = [layer.context_kv(fused, positions) for layer in self.layers]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    def block_hidden(
        self,
        anchors: torch.Tensor,
        starts: torch.Tensor,
        context: ContextFn,
        ctx_valid: torch.Tensor,
    ) -> torch.Tensor:
        """anchors: [R] tokens at positions ``starts`` [R]; context: each layer's context K/V
        with ctx_valid [R, S] -> [R, K_max, d] hidden states of [anchor, MASK × (K_max-1)]."""
        k = self.cfg.block_size
        ids = torch.full((len(anchors), k), self.cfg.mask_token_id, device=anchors.device)
        ids[:, 0] = anchors
        positions = starts.unsqueeze(1) + torch.arange(k, device=anchors.device)
        x = self.borrowed.target.embed(ids).to(self.fc.weight.dtype)
        for i, layer in enumerate(self.layers):
            ck, cv = context(i)
            x = layer(x, positions, ck, cv, ctx_valid)
        return x

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] draft hidden states -> [..., V] fp32 through the target's lm_head."""
        return self.borrowed.target.logits(self.norm(hidden))

    # ---- what a drafter does with the block -------------------------------------------------
    @abc.abstractmethod
    def select(
        self,
        hidden: torch.Tensor,
        anchors: torch.Tensor,
        temperatures: torch.Tensor,
        noise: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """hidden: [R, K_max-1, d] of the masked slots; temperatures: [R]; noise: [R, K_max-1,
        V] Exp(1) draws or None (all greedy) -> tokens [R, K_max-1], q [R, K_max-1, V] (each
        token drawn from its row; one-hot where T = 0), confidence [R, K_max-1] or None."""

    @abc.abstractmethod
    def loss(
        self,
        hidden: torch.Tensor,
        anchors: torch.Tensor,
        labels: torch.Tensor,
        target_logits: torch.Tensor,
        weights: torch.Tensor,
        distill: float = 0.0,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Training loss of B blocks. hidden: [B, K_max, d]; anchors: [B]; labels: [B, K_max-1]
        the target's greedy next tokens for slots 1..K_max-1; target_logits: [B, K_max-1, V]
        the target's logits there; weights: [K_max-1] positional decay; distill: weight of the
        soft (KL) term, see ``token_loss`` -> (loss, metrics)."""

    def choose_widths(self, widths: list[int], confidence: torch.Tensor | None) -> list[int]:
        """Per-request K_r within the caller's caps; fixed-block drafters keep the caps."""
        return widths

    # ---- runtime ----------------------------------------------------------------------------
    def init_ring(self, max_slots: int, page_size: int = 16) -> DraftRing:
        """Allocates the draft ring for ``max_slots`` request slots (eq. 9)."""
        w = self.fc.weight
        self.ring = DraftRing(
            self.cfg.n_layers,
            self.cfg.n_heads * self.cfg.head_dim,
            max_slots,
            self.cfg.window,
            self.cfg.block_size,
            page_size,
            w.dtype,
            w.device,
        )
        return self.ring

    def _ring(self) -> DraftRing:
        if self.ring is None:
            raise RuntimeError("call init_ring(max_slots, page_size) before drafting")
        return self.ring

    def begin(self, slot: int) -> None:
        """A new request in ``slot``: nothing of the previous one stays visible."""
        self._ring().clear(slot)

    def release(self, slot: int) -> None:
        self._ring().clear(slot)

    @torch.no_grad()
    def append_context(
        self,
        slots: torch.Tensor | Sequence[int],
        positions: torch.Tensor,
        features: Mapping[int, torch.Tensor],
        per_slot: int | None = None,
    ) -> None:
        """Records committed positions. slots, positions: [N]; features: {target layer: [N, d]}
        the target's outputs at those positions (from the pass that computed them).
        ``per_slot``: the most positions one slot adds, when the caller knows it; at most W
        (a decode step, a verify round) spares the filtering and its read-backs."""
        ring = self._ring()
        dev = self.fc.weight.device
        slots = torch.as_tensor(slots, dtype=torch.int64, device=dev)
        positions = positions.to(dev)
        feats = {i: features[i].to(dev) for i in self.cfg.target_layers}
        if per_slot is None or per_slot > self.cfg.window:
            # Only the newest W positions of a slot can ever be read again.
            newest = torch.full((ring.max_slots,), -1, dtype=torch.int64, device=dev)
            newest = newest.scatter_reduce(0, slots, positions, reduce="amax")
            keep = positions > newest[slots] - self.cfg.window
            slots, positions = slots[keep], positions[keep]
            feats = {i: f[keep] for i, f in feats.items()}
            per_slot = None
        k, v = self.context_kv(self.fuse(feats), positions)
        ring.write(slots, positions, k, v, per_slot)

    @torch.no_grad()
    def propose(
        self,
        slots: Sequence[int],
        anchors: torch.Tensor | Sequence[int],
        num_committed: Sequence[int],
        widths: Sequence[int] | None = None,
        temperatures: float | Sequence[float] = 0.0,
        generators: Sequence[torch.Generator | None] | None = None,
        run: DraftFn | None = None,
    ) -> Proposal:
        """Drafts one block per request. Request r has ``num_committed[r]`` = n committed tokens
        (context in the ring up to n-1) and its anchor at position n; ``widths[r]`` caps K_r
        (default K_max). Proposals are greedy where the temperature is 0, else drawn from the
        drafter's tempered distribution with the request's generator. ``run``: what runs the
        block pass (``draft``, or a CUDA graph of it)."""
        dev = self.fc.weight.device
        r = len(slots)
        kmax = self.cfg.block_size
        caps, temps, gens = per_request(r, kmax, widths, temperatures, generators)
        if isinstance(anchors, torch.Tensor):
            anchors = anchors.tolist()
        # one copy that does not wait for the device
        inputs = to_device([list(slots), list(num_committed), list(anchors)], dev)
        slots_t, n_t, anchors_t = inputs.unbind(0)
        noise = None
        if any(t > 0.0 for t in temps):
            noise = exp_noise((kmax - 1, self.cfg.vocab_size), temps, gens, dev)
        temps_t = to_device(temps, dev, torch.float32)
        tokens, q, conf = (run or self.draft)(slots_t, n_t, anchors_t, temps_t, noise)
        return finish(
            tokens, q if noise is not None else None, self.choose_widths(caps, conf), conf
        )

    @property
    def device(self) -> torch.device:
        """Where the drafter's weights (and its block passes) are."""
        return self.fc.weight.device

    def draft(
        self,
        slots: torch.Tensor,
        num_committed: torch.Tensor,
        anchors: torch.Tensor,
        temperatures: torch.Tensor,
        noise: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The block pass of ``propose``, on the device only (no host reads: a CUDA graph can
        hold it). slots, num_committed, anchors: [R] int64; temperatures: [R]; noise: [R,
        K_max-1, V] or None -> ``select``'s tokens, q and confidence."""
        ring = self._ring()
        win = ring.window_of(slots, num_committed)
        hidden = self.block_hidden(anchors, num_committed, lambda i: ring.read(i, win), win.valid)
        return self.select(hidden[:, 1:], anchors, temperatures, noise)


# ---- loss pieces shared by the drafters -----------------------------------------------------
def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """logits: [B, K-1, C]; labels: [B, K-1] (negative: ignored); weights: [K-1] -> the decayed
    mean cross-entropy."""
    mask = (labels >= 0).float()
    labels = labels.masked_fill(labels < 0, -100)
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
    w = weights.unsqueeze(0) * mask
    return (ce.view_as(mask) * w).sum() / w.sum().clamp(min=1e-9)


def token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    target_probs: torch.Tensor,
    weights: torch.Tensor,
    distill: float,
) -> torch.Tensor:
    """``(1-α)·CE(greedy labels) + α·KL(p_target ‖ softmax(logits))``, decayed, α = distill.

    Greedy labels alone make q sharp; under sampling a proposal is accepted with probability
    ``Σ min(p, q)``, which a q close to the target's p (α > 0) raises. target_probs: like
    logits, rows summing to 1 (zeros allowed)."""
    ce = weighted_ce(logits, labels, weights)
    if distill <= 0.0:
        return ce
    logq = torch.log_softmax(logits.float(), dim=-1)
    p = target_probs.float()
    kl = (p * (torch.log(p.clamp(min=1e-30)) - logq)).sum(-1)  # [B, K-1]
    kl = (kl * weights).sum() / (weights.sum() * kl.shape[0])
    return (1.0 - distill) * ce + distill * kl


def accept_length(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean greedy acceptance length (anchor's bonus included, as vLLM's 1 + accepted/drafts)
    of blocks whose proposals are ``predicted`` [B, K-1] against ``labels`` [B, K-1]."""
    prefix = torch.cumprod((predicted == labels).float(), dim=-1)
    return 1.0 + float(prefix.sum(-1).mean())
