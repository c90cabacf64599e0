"""Puts an adopted session back into an engine: reads its manifest, seats its host regions in
a free slot (rows stay in the arena; index keys and token rings are rebuilt, the hot cache
refills on misses), and rebuilds the request — prompt, outputs, sampling parameters, generator
state, text stream — as RUNNING with the tokens its manifest names computed: every token but
the last, and the next step decodes; or, for a session that died part-way through a chunked
prefill (or a preempted request's recompute), a prefix, and its prefill continues from there.
Nothing computed is recomputed."""

from __future__ import annotations

import time
from typing import Protocol

import torch

from dhisparse.tokenizer import Tokenizer
from services.kv_host_store.arena import ArenaMapping
from services.kv_host_store.records import Region
from services.worker.durable import manifest
from services.worker.durable.manifest import ManifestError, SessionRecord
from services.worker.hierarchy.session import SessionBackup
from services.worker.request.request import Grammar, Request, SamplingParams
from services.worker.serving.cache import KVCache


class Seats(Protocol):
    """What ``restore`` needs of an engine (``Engine``, which calls it)."""

    kv: KVCache
    device: torch.device
    tokenizer: Tokenizer

    def has_request(self, request_id: str) -> bool: ...

    def resume(
        self, req: Request, regions: list[Region], rings: dict[int, bytes], version: int
    ) -> bool: ...


def read_manifest(
    mapping: ArenaMapping, regions: list[Region], request_id: str
) -> tuple[int, SessionRecord]:
    """(version, record) of the newest valid manifest of ``request_id`` among its regions;
    raises ``ManifestError`` when it has none: no half written for it yet (a session handed
    over before its first manifest), or both invalid."""
    region = SessionBackup.manifest_of(regions)
    if region is None:
        raise ManifestError("the request has no manifest region (not a durable session)")
    buf = mapping.rows(region.offset, 2, region.row_bytes).numpy()
    version, payload = manifest.read(buf, request_id)
    return version, manifest.decode(payload)


def sampling_params(fields: dict) -> SamplingParams:
    """``SamplingParams`` from the manifest's JSON of them (``manifest.params_dict``)."""
    out = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    out["logit_bias"] = tuple((int(t), float(b)) for t, b in fields.get("logit_bias", ()))
    if fields.get("grammar") is not None:
        out["grammar"] = Grammar(**fields["grammar"])
    return SamplingParams(**out)


def restore(
    engine: Seats, rec: SessionRecord, version: int, regions: list[Region]
) -> Request | None:
    """Resumes ``rec`` in ``engine``; None when no slot or device room is free
    now. Raises ``ValueError`` for a record that does not fit this engine."""
    if engine.has_request(rec.request_id):
        raise ValueError(f"request {rec.request_id!r} is already running here")
    total = len(rec.prompt_ids) + len(rec.output_ids)
    if not 0 < rec.num_computed < total:
        raise ValueError("manifest counts disagree: computed tokens must be some but not all")
    if rec.ring_dtype and rec.ring_dtype != str(engine.kv.cfg.dtype):
        raise ValueError(f"session was served in {rec.ring_dtype}, this worker uses another")
    if rec.kv_cache_dtype != engine.kv.cfg.kv_cache_dtype:
        raise ValueError(
            f"session's KV is stored with kv_cache_dtype={rec.kv_cache_dtype!r}, this worker "
            f"uses {engine.kv.cfg.kv_cache_dtype!r}"
        )
    params = sampling_params(rec.params)
    gen = None
    if params.seed is not None:
        gen = torch.Generator(device=engine.device).manual_seed(params.seed)
        if rec.generator_state is not None:
            gen.set_state(torch.frombuffer(bytearray(rec.generator_state), dtype=torch.uint8))
    text = params.text_stream(engine.tokenizer, rec.prompt_ids)
    for token in rec.output_ids:  # the text the client has been sent so far, and what is held
        text.push(token)
    now = time.monotonic()
    req = Request(rec.request_id, list(rec.prompt_ids), params, text, generator=gen)
    req.output_ids = list(rec.output_ids)
    req.arrival = now - max(0.0, time.time() - rec.arrival_s) if rec.arrival_s else now
    req.num_computed = rec.num_computed
    req.admitted_time = now
    req.first_token_time = now if rec.output_ids else None
    req.resumed_tokens = rec.num_computed
    if not engine.resume(req, regions, rec.rings, version):
        return None
    return req
