"""Speculative decoding without the engine: one request, a resident KV cache, plain loops.

The reference the engine's verify pass is checked against. Each round the target runs one
chunk [anchor, x_1 .. x_{K_r-1}] at positions n .. n+K_r-1, verification accepts A of the
proposals, and only positions n .. n+A are committed (eq. 7): the KV cache stores rows by
position, so the rows of rejected proposals are simply overwritten by the next round's chunk,
which starts at n' = n+A+1 with the correction or bonus as its anchor. With greedy sampling
the output equals ``plain_generate``'s token for token, whatever the drafter proposes.
(``min_tokens``, logit biases, penalties and stop strings are not modelled here: the engine
applies them, ``Request.shape_logits``; EOS ends a sequence unless ignored.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import KVCacheConfig
from services.worker.model.decoder import SparseDecoder
from services.worker.request.request import SamplingParams
from services.worker.request.sampling import sample_token
from services.worker.serving.cache import KVCache
from services.worker.speculative.drafters.base import Drafter
from services.worker.speculative.verify import verify

SLOT = 0


@dataclass
class SpecStats:
    drafts: int = 0  # verification rounds
    draft_tokens: int = 0  # proposals verified
    accepted: int = 0  # proposals accepted
    per_position: list[int] = field(default_factory=list)  # accepted at proposal index i

    @property
    def acceptance_length(self) -> float:
        """1 + accepted/drafts: tokens emitted per round (vLLM's convention)."""
        return 1.0 + self.accepted / max(self.drafts, 1)


@dataclass(frozen=True)
class SpecOutput:
    tokens: list[int]
    stats: SpecStats


def _kv(target: SparseDecoder, max_len: int, block: int) -> KVCache:
    device = next(target.parameters()).device
    dtype = target.dtype
    cfg = KVCacheConfig(
        mode="resident",
        kv_pool_bytes=64 << 20,
        max_slots=1,
        max_model_len=max_len,
        ring_extra=max(8, block),  # token rings must keep a whole verify chunk
        dtype=dtype,
        device=str(device),
    )
    kv = KVCache(target.cfg, cfg)
    if not kv.admit(SLOT, "reference", 0, max_len):
        raise RuntimeError("the reference KV cache cannot hold the request")
    return kv


def _forward(
    target: SparseDecoder,
    kv: KVCache,
    ids: list[int],
    start: int,
    features: dict[int, torch.Tensor] | None = None,
) -> tuple[ForwardBatch, torch.Tensor]:
    """Runs ``ids`` at positions start.. -> (batch, logits [len(ids), V])."""
    device = next(target.parameters()).device
    if not kv.ensure(SLOT, start + len(ids)):
        raise RuntimeError("out of KV pages")
    batch = ForwardBatch.build([SLOT], [start], [len(ids)], device)
    tokens = torch.tensor(ids, dtype=torch.int64, device=device)
    hidden = target(tokens, batch, kv, features=features)
    return batch, target.logits(hidden)


def _ended(token: int, target: SparseDecoder, params: SamplingParams) -> bool:
    return token == target.cfg.eos_token_id and not params.ignore_eos


@torch.no_grad()
def plain_generate(
    target: SparseDecoder,
    prompt: list[int],
    max_tokens: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Ordinary decoding, one target pass per token."""
    kv = _kv(target, len(prompt) + max_tokens + 1, 1)
    batch, logits = _forward(target, kv, prompt, 0)
    kv.commit(batch, [len(prompt)])
    out = [sample_token(logits[-1], params, generator)]
    while len(out) < max_tokens and not _ended(out[-1], target, params):
        n = len(prompt) + len(out) - 1
        batch, logits = _forward(target, kv, out[-1:], n)
        kv.commit(batch, [n + 1])
        out.append(sample_token(logits[-1], params, generator))
    kv.close()
    return out


@torch.no_grad()
def speculative_generate(
    target: SparseDecoder,
    drafter: Drafter,
    prompt: list[int],
    max_tokens: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    width: int | None = None,
) -> SpecOutput:
    """Speculative decoding of one request with ``drafter`` proposing blocks of ``width``
    (default K_max) target queries. Output law equals ``plain_generate``'s; greedy output is
    identical to it."""
    kmax = drafter.block_size
    width = kmax if width is None else min(width, kmax)
    layers = drafter.cfg.target_layers
    kv = _kv(target, len(prompt) + max_tokens + kmax + 1, kmax)
    if drafter.ring is None:
        drafter.init_ring(max_slots=1)
    drafter.begin(SLOT)
    feats: dict[int, torch.Tensor] = dict.fromkeys(layers)  # type: ignore[arg-type]
    batch, logits = _forward(target, kv, prompt, 0, feats)
    kv.commit(batch, [len(prompt)])
    drafter.append_context(batch.token_slot, batch.positions, feats)
    out = [sample_token(logits[-1], params, generator)]
    n, stats = len(prompt), SpecStats(per_position=[0] * (kmax - 1))
    while len(out) < max_tokens and not _ended(out[-1], target, params):
        # A round emits at most K_r tokens: never verify more than are still wanted.
        cap = min(width, max_tokens - len(out))
        prop = drafter.propose([SLOT], [out[-1]], [n], [cap], params.temperature, [generator])
        k = prop.widths[0]
        drafts = prop.drafts(0)
        feats = dict.fromkeys(layers)  # type: ignore[arg-type]
        batch, logits = _forward(target, kv, [out[-1], *drafts.tolist()], n, feats)
        q = None if prop.probs is None else prop.probs[0, : k - 1]
        a, nxt = verify(logits, drafts, q, params, generator)
        # Positions n .. n+A (the anchor and the accepted prefix) are final; the rest of the
        # chunk is never committed and is overwritten from n+A+1 next round.
        kv.commit(batch, [n + a + 1])
        drafter.append_context(
            batch.token_slot[: a + 1],
            batch.positions[: a + 1],
            {i: f[: a + 1] for i, f in feats.items()},
        )
        stats.drafts += 1
        stats.draft_tokens += k - 1
        stats.accepted += a
        for i in range(a):
            stats.per_position[i] += 1
        n += a + 1
        for t in [*drafts[:a].tolist(), nxt]:
            if len(out) >= max_tokens or _ended(out[-1], target, params):
                break
            out.append(t)
    drafter.release(SLOT)
    kv.close()
    return SpecOutput(out, stats)
