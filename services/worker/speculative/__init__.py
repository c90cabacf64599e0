"""Speculative decoding (DESIGN §5): drafters (DFlash, DSpark, DFlash2), their draft KV ring,
lossless verification, DSpark's confidence scheduler, width-by-load policies, a training loop
and an engine-free reference loop.

What the engine uses:
  drafter = load_drafter(path, target); drafter.init_ring(max_slots, page_size)
  drafter.begin(slot) / append_context(slots, positions, features) / propose(...) / release
  verify_batch(target_logits, widths, tokens, probs, params, generators) -> [Verdict]
  OnlinePolicy / WidthSchedule: the width to speculate with under the current load.
"""

from __future__ import annotations

from services.worker.speculative.confidence import ConfidenceScheduler, CostCurve
from services.worker.speculative.draft_ring import DraftRing, RingWindow
from services.worker.speculative.drafters import (
    DRAFTERS,
    DFlash2Drafter,
    DFlashDrafter,
    Drafter,
    DrafterConfig,
    DSparkDrafter,
    build_drafter,
    load_drafter,
    save_drafter,
)
from services.worker.speculative.proposal import Proposal
from services.worker.speculative.verify import Verdict, target_probs, verify, verify_batch
from services.worker.speculative.width_policy import OnlinePolicy, WidthSchedule

__all__ = [
    "DRAFTERS",
    "ConfidenceScheduler",
    "CostCurve",
    "DFlash2Drafter",
    "DFlashDrafter",
    "DSparkDrafter",
    "DraftRing",
    "Drafter",
    "DrafterConfig",
    "OnlinePolicy",
    "Proposal",
    "RingWindow",
    "Verdict",
    "WidthSchedule",
    "build_drafter",
    "load_drafter",
    "save_drafter",
    "target_probs",
    "verify",
    "verify_batch",
]
