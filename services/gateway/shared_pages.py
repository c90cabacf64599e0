"""Which leading pages of a request its worker will hold once for every request sharing them,
and their bytes there: the ``ledger``'s shared blocks, so that admission counts a page that
several live requests share once.

A worker shares a prompt's leading pages on its device when it seats them from a record that
it left there itself: resident mode shares the pages of rows and index keys, the hierarchy the
index keys (``worker.serving.device_prefix``, ``worker.serving.key_records``). So a request's
blocks on a worker are the leading pages the prefix-affinity index says that worker itself
served (``Matched.own_pages``): a lease names them, the ledger counts each once among the live
leases naming it, and the worker's report of what it really shared settles the rest
(``Lease.settle``). A block's bytes are the capacity model's for that page of the prefix
(``SessionSizer.shared_bytes``); a worker whose model shares no page names none. Pure policy,
no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from services.gateway.affinity import PrefixAffinity
from services.gateway.leases import SharedLead
from services.gateway.ledger import SharedBlock
from services.gateway.routing import AdmissionJob, WorkerStatus
from services.gateway.sizing import SessionSizer


class SharedPages:
    def __init__(self, affinity: PrefixAffinity, sizer: SessionSizer) -> None:
        self.affinity = affinity
        self.sizer = sizer

    def blocks(self, job: AdmissionJob, workers: Sequence[WorkerStatus]) -> dict[str, SharedLead]:
        """Per address of ``workers``: ``job``'s blocks there (none where it has none)."""
        if job.prefix is None:
            return {}
        own = self.affinity.predict(job.prefix, workers)
        out: dict[str, SharedLead] = {}
        for w in workers:
            tokens = own[w.address].own_pages if w.address in own else 0
            page = self.affinity.page_size(w)
            blocks = self._sized(w, job.prefix.keys(page)[: tokens // page], page)
            if blocks:
                out[w.address] = SharedLead(blocks, page)
        return out

    def _sized(self, w: WorkerStatus, keys: Sequence[int], page: int) -> tuple[SharedBlock, ...]:
        """The blocks of ``keys``, in order, with their bytes on ``w`` (some may have none: an
        index-key page may span several token pages); none while ``w`` is not sized, or where
        its model shares no page."""
        total = self.sizer.shared_bytes(w, page, len(keys)) if keys else None
        if not total or not total[-1]:
            return ()
        return tuple(
            SharedBlock(f"{key:016x}", b - a)
            for key, (a, b) in zip(keys, pairwise(total), strict=True)
        )
