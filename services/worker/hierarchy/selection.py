"""A pass's selections resolved to pool locations, source by source.

Rows in a request's chunk or tail ring resolve directly; older rows come from the hot cache or
are read from the host by the resolver, which also counts how each was served (the census).
The followers of an index producer share its selection, so their resolutions can start as
soon as it exists and overlap the layers computed in between (``prefetch``): on a GPU they run
on a side stream, and inside a captured CUDA graph that stream's work is a parallel branch of
the graph, joined where each follower's attention reads its locations."""

from __future__ import annotations

import torch

from services.worker.hierarchy.device_store import DeviceStore
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.config import FollowerPrefetch
from services.worker.kv.pass_state import PassState
from services.worker.kv.reports import Census


class Selections:
    def __init__(
        self, store: DeviceStore, state: PassState, prefetch: FollowerPrefetch = FollowerPrefetch()
    ) -> None:
        self.store = store
        self.state = state
        self.device = store.device
        self.counts = torch.zeros(4, dtype=torch.int64, device=self.device)  # the census
        # Follower resolutions started early, on a side stream on a GPU:
        # layer -> (locs, census, event)
        self._prefetched: dict[int, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = {}
        # Two side streams: one for eager passes, one that joins graph captures. The
        # resolver's workspace is cached per stream, and a capture's must keep its address
        # (reserved at its largest before the first capture) while an eager pass's may grow.
        gpu = self.device.type == "cuda" and prefetch.overlap
        self._side = torch.cuda.Stream(self.device) if gpu else None
        self._graph_side = torch.cuda.Stream(self.device) if gpu else None

    @property
    def side_stream(self) -> int | None:
        """The handle of the side stream captured graphs resolve followers on (its resolver
        workspace must be reserved before a capture), or None when followers resolve inline."""
        return None if self._graph_side is None else self._graph_side.cuda_stream

    @property
    def census(self) -> Census:
        """Selected rows resolved direct / hot / host, and rows copied (synchronises)."""
        return Census.of(self.counts)

    def begin(self) -> None:
        self._prefetched.clear()

    def prefetch(
        self, layers: list[tuple[int, int]], batch: ForwardBatch, selection: torch.Tensor
    ) -> None:
        """Starts resolving ``(layer, source)`` pairs that share ``selection`` (the followers of
        an index producer) so their host reads overlap the layers computed in between. On a
        GPU they run on a side stream that first waits for everything issued so far: earlier
        readers of those sources are done, and the selection is complete. Under a graph
        capture the side stream joins the capture (a fork) and each ``resolve`` of a follower
        joins it back; every prefetched layer is resolved in the same pass."""
        if self._side is None:
            for layer, source in layers:
                self._prefetched[layer] = (*self._resolve(source, batch, selection), None)
            return
        main = torch.cuda.current_stream(self.device)
        side = self._side
        if torch.cuda.is_current_stream_capturing():
            side = self._graph_side
        assert side is not None
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for layer, source in layers:
                locs, census = self._resolve(source, batch, selection)
                locs.record_stream(main)
                census.record_stream(main)
                event = torch.cuda.Event()
                event.record(side)
                self._prefetched[layer] = (locs, census, event)

    def resolve(
        self, layer: int, source: int, batch: ForwardBatch, selection: torch.Tensor
    ) -> torch.Tensor:
        done = self._prefetched.pop(layer, None)
        if done is not None:
            locs, census, event = done
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
        else:
            locs, census = self._resolve(source, batch, selection)
        self.counts += census  # on the main stream, after the resolution it counts
        return locs

    def _resolve(
        self, source: int, batch: ForwardBatch, selection: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(locations, census [4]) of one source's selection."""
        plan = self.state.plans[source]
        if plan.all_direct:
            # Nothing older than the ring (a prefill): no hot scan, no host reads, and not
            # counted in the census, which describes how decode selections are served.
            req = batch.token_req.unsqueeze(1).expand_as(selection)
            _, locs = self.store.geo[source].direct(selection, req, batch.slots, plan)
            return torch.where(selection >= 0, locs, -1), torch.zeros_like(self.counts)
        return self.store.resolve(source, selection, batch.cu_lens, batch.slots, plan)
