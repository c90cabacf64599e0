"""Writes each running request's manifest after every engine step, before the step's tokens
are delivered: a client never sees a token its manifest does not hold, and a manifest never
names rows that are not in the host arena.

Ordering: a step's rows and index keys were copied to the host at commit, in stream order; the
journal waits for the stream before it writes (on the CPU copies are synchronous; on a GPU the
step's sampling has already synchronised past them, so the wait costs nothing), then writes
each manifest into the half its new version owns (``manifest.write``).
"""

from __future__ import annotations

import time

import torch

from services.worker.durable import manifest
from services.worker.durable.manifest import SessionRecord
from services.worker.request.request import Request
from services.worker.serving.cache import KVCache

_SLACK = 256  # JSON digits that grow as a request does (counts, times)


class Journal:
    def __init__(self, kv: KVCache, device: torch.device) -> None:
        if kv.sessions is None:
            raise ValueError("a journal needs durable sessions in a hierarchy mode")
        self.kv = kv
        self.sessions = kv.sessions
        self.device = device
        self.versions: dict[str, int] = {}  # request id -> last manifest version written
        self._gen_state_bytes = torch.Generator(device=device).get_state().numel()

    def record_of(self, req: Request, rings: dict[int, bytes]) -> SessionRecord:
        """The request as it stands: ``num_computed`` tokens committed, outputs sampled;
        ``rings``: its token-ring snapshots."""
        cfg = self.kv.model_cfg
        gen = req.generator
        return SessionRecord(
            request_id=req.request_id,
            prompt_ids=req.prompt_ids,
            output_ids=req.output_ids,
            num_computed=req.num_computed,
            params=manifest.params_dict(req.params),
            committed_rows=[cfg.rows_for_tokens(s, req.num_computed) for s in cfg.stored_sources],
            generator_state=None if gen is None else gen.get_state().numpy().tobytes(),
            rings=rings,
            ring_dtype=str(self.kv.cfg.dtype),
            kv_cache_dtype=self.kv.cfg.kv_cache_dtype,
            arrival_s=time.time() - (time.monotonic() - req.arrival),
        )

    def manifest_bytes(self, req: Request) -> int:
        """One manifest half for ``req`` at its largest (every output token sampled)."""
        cfg = self.kv.model_cfg
        total = len(req.prompt_ids) + req.params.max_tokens
        ring = {
            s: bytes(r.data[0].numel() * r.data.element_size())
            for s, r in self.kv.snapshot_rings.items()
        }
        largest = SessionRecord(
            request_id=req.request_id,
            prompt_ids=req.prompt_ids,
            output_ids=[0] * req.params.max_tokens,
            num_computed=total,
            params=manifest.params_dict(req.params),
            committed_rows=[cfg.rows_for_tokens(s, total) for s in cfg.stored_sources],
            generator_state=bytes(self._gen_state_bytes) if req.params.seed is not None else None,
            rings=ring,
            ring_dtype=str(self.kv.cfg.dtype),
            kv_cache_dtype=self.kv.cfg.kv_cache_dtype,
            arrival_s=time.time(),
        )
        return manifest.required_bytes(len(manifest.encode(largest)) + _SLACK)

    def record(self, reqs: list[Request]) -> None:
        """Writes the manifest of every request that has committed tokens."""
        live = [r for r in reqs if r.slot is not None and r.num_computed > 0]
        if not live:
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        slots: list[int] = [r.slot for r in live]  # type: ignore[misc]
        for req, slot, rings in zip(live, slots, self.sessions.ring_snapshots(slots), strict=True):
            version = self.versions.get(req.request_id, 0) + 1
            buf = self.sessions.manifest_buffer(slot).numpy()
            manifest.write(buf, version, manifest.encode(self.record_of(req, rings)))
            self.versions[req.request_id] = version

    def resumed(self, request_id: str, version: int) -> None:
        """A resumed session's manifest was last written at ``version``: the next is newer."""
        self.versions[request_id] = version

    def forget(self, request_id: str) -> None:
        self.versions.pop(request_id, None)
