"""Speculative decoding (DESIGN §5):

- ``drafters``: DFlash, DSpark and DFlash2 over one interface (``Drafter``);
- ``draft_ring``: the drafter's KV for the last W committed positions per slot (eq. 9/10);
- ``verify``: lossless verification (Leviathan et al.), greedy and sampled;
- ``width_policy``: which block width to verify by load (the paper's schedule, the online
  policy of eq. 13), ``acceptance_rates``: the acceptance it measures by draft position,
  ``width_controller``: the width of each round and the measuring it takes; ``confidence``:
  DSpark's per-request widths;
- ``speculator``: the engine's speculative round over the narrow ``target`` interface;
- ``reference``: an engine-free loop the engine is checked against; ``config``: settings.

Training drafters is ``training.drafter``, outside the worker.

What the engine uses:
  drafter = load_drafter(path, target); drafter.init_ring(max_slots, page_size)
  drafter.begin(slot) / append_context(slots, positions, features) / propose(...) / release
  verify_batch(target_logits, widths, tokens, probs, params, generators) -> [Verdict]
  WidthController: the width to speculate with under the current load.
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
