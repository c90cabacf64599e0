"""The engine: model + KV cache + scheduler + sampling, stepped by its owner (the worker's
engine thread, or ``dhisparse generate``)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from dhisparse.paths import resolve_path
from dhisparse.tokenizer import Tokenizer, load_tokenizer
from services.kv_host_store.records import Region
from services.worker.engine.config import EngineConfig, device_free_bytes, with_sized_pool
from services.worker.engine.cuda_graph import DecodeGraphs, DraftGraphs
from services.worker.engine.request import (
    FinishReason,
    Request,
    RequestError,
    RequestOutput,
    SamplingParams,
    Status,
    TokenLogprob,
)
from services.worker.engine.sampling import sample_token, token_logprob
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.stats import EngineStats
from services.worker.engine.stop import TextStream
from services.worker.kv.batch import ForwardBatch
from services.worker.kv.cache import KVCache
from services.worker.kv.transfers import readback, to_device
from services.worker.model import DSAModel, load_model
from services.worker.model.generation import eos_token_ids, token_ids
from services.worker.model.io import DTYPES
from services.worker.model.mtp import MTPStep
from services.worker.model.presets import PRESETS
from services.worker.parallel.comm import LOCAL, Comm
from services.worker.parallel.lockstep import Lockstep, StopFollowing
from services.worker.parallel.mirror import Resumed, mirror, mirror_resumed
from services.worker.parallel.placement import Placement, RankLoad
from services.worker.parallel.region_group import GroupRegionStore
from services.worker.speculative.drafters.mtp import MTPDrafter
from services.worker.speculative.speculator import Speculator, make_drafter

if TYPE_CHECKING:
    from services.worker.durable.journal import Journal
    from services.worker.durable.manifest import SessionRecord

__all__ = ["Engine", "StoreLink"]


class StoreLink(Protocol):
    """What the engine reads of its registration with the node's host store
    (``durable.host_link.HostLink``)."""

    @property
    def healthy(self) -> bool: ...

    def status(self) -> str: ...


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        model: DSAModel | None = None,
        tokenizer: Tokenizer | None = None,
        host: tuple | None = None,
        comm: Comm = LOCAL,
    ) -> None:
        """``host``: (region store, arena mapping) of the node's kv_host_store for the hierarchy
        modes; without it they use a private arena. ``comm``: the group of ranks this engine
        is one of (``cfg.parallel``): every rank builds an engine over its part of the model,
        rank 0 is driven from outside and the others ``follow`` it (``parallel.lockstep``).
        Under data-parallel attention each rank serves the requests rank 0 places on it
        (``parallel.placement``); rank 0 mirrors the others' requests from their outputs
        (``parallel.mirror``). Over the node's store a tensor-parallel group holds one set of
        regions that rank 0 writes (``parallel.region_group``), while each data-parallel rank
        is an owner of its own (``cfg.owner``) that writes, journals and resumes its own
        requests' regions."""
        self.cfg = cfg
        serving = cfg.serving_dtype()
        dtype = DTYPES[serving] if serving else None
        sc = cfg.speculation
        if comm.size != cfg.parallel.world_size:
            raise ValueError(
                f"{cfg.parallel.name} over {cfg.parallel.world_size} ranks, given a group of "
                f"{comm.size}"
            )
        self.lockstep = Lockstep(comm) if comm.size > 1 else None
        self.data_parallel = comm.size > 1 and cfg.parallel.data_parallel_attention
        # tensor parallel over the node's store: one set of regions, rank 0 writes them
        shared_host = host is not None and comm.size > 1 and not self.data_parallel
        if shared_host:
            assert host is not None
            host = (GroupRegionStore(host[0], comm), *host[1:])
        self.placement = Placement(comm.size) if self.data_parallel and comm.is_leader else None
        # rank 0 under data-parallel attention: the requests other ranks serve, by id
        self._remote: dict[str, Request] = {}
        # this rank's registration with the node's store (``durable.host_link``), set by whoever
        # registers it; a data-parallel rank reports its state to rank 0 with its load
        self.host_link: StoreLink | None = None
        if model is None:
            model = load_model(
                cfg.model, device=cfg.device, dtype=dtype, seed=cfg.seed,
                mtp=sc.drafter == MTPDrafter.kind, weight_dtype=cfg.served_weights(),
                fp8_mode=cfg.fp8_mode, parallel=cfg.parallel, comm=comm,
            )  # fmt: skip
        if cfg.top_k_rows is not None:
            model.cfg = replace(model.cfg, index_topk=cfg.top_k_rows)
        if cfg.backend(cfg.attention_backend) == "triton":
            model.use_triton_attention()
        self.model = model
        self.model_cfg = model.cfg
        self.exchange = model.expert_exchange
        if self.data_parallel and self.exchange is None:
            raise ValueError("data-parallel attention needs a model with routed experts")
        model_dir = None if cfg.model in PRESETS else resolve_path(cfg.model)
        self.tokenizer = tokenizer or load_tokenizer(model_dir)
        # Any of these ends a request: the model's, the tokenizer's, and those the checkpoint's
        # config.json and generation_config.json list (GLM-5 names three).
        self.eos_token_ids = frozenset(
            {*token_ids(self.model_cfg.eos_token_id), self.tokenizer.eos_token_id}
            | set(eos_token_ids(model_dir))
        )
        self.device = torch.device(cfg.device)
        cfg = self.cfg = with_sized_pool(cfg, comm, device_free_bytes(cfg.device))
        kv_cfg = cfg.kv_config(next(model.parameters()).dtype)
        if shared_host and not comm.is_leader:
            kv_cfg = replace(kv_cfg, host_writer=False)
        self.kv = KVCache(self.model_cfg, kv_cfg, host)
        self.journal: Journal | None = None
        # a TP follower's manifests would be rank 0's (the same sessions): rank 0 writes them;
        # every data-parallel rank writes its own requests'
        self._writes_manifests = comm.is_leader or self.data_parallel
        if self.kv.sessions is not None:
            from services.worker.durable.journal import Journal

            self.journal = Journal(self.kv, self.device)
        self.scheduler = Scheduler(
            self.kv, cfg.max_num_seqs, cfg.max_prefill_tokens, cfg.max_model_len,
            manifest_bytes=self.journal.manifest_bytes if self.journal else None,
            chunked=cfg.chunked_prefill,
        )  # fmt: skip
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._default_gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self._check_invariants = bool(os.environ.get("DHISPARSE_CHECK_INVARIANTS"))
        self._maintained = False  # the last decode pass ran kv.maintain() while the device ran
        self.speculator: Speculator | None = None
        if sc.drafter:
            drafter = make_drafter(sc.drafter, model, sc.width, cfg.seed, self.mtp_step)
            self.speculator = Speculator(self, drafter, sc, cfg.max_num_seqs, cfg.page_size)
            if self.lockstep is not None and not self.data_parallel:
                self.speculator.agree = self.lockstep.agree
        spec = self.speculator
        self.graphs: DecodeGraphs | None = None
        # Why decode passes run eagerly (None: they are captured as CUDA graphs); the worker
        # logs it at start-up and exports it (``dhisparse:worker_config_info``).
        self.graphs_off_reason = self._graphs_off(cfg, model)
        if self.graphs_off_reason is None:
            self.graphs = DecodeGraphs(
                model, self.kv, cfg.max_num_seqs, consecutive=cfg.graphs.capture == "consecutive",
                max_width=spec.k_max if spec is not None else 1,
            )  # fmt: skip
            if spec is not None:
                spec.graphs = DraftGraphs(spec.drafter, cfg.max_num_seqs)

    def _graphs_off(self, cfg: EngineConfig, model: DSAModel) -> str | None:
        """Why decode and verify passes are not replayed as CUDA graphs, or None when they are."""
        if not cfg.graphs.enabled:
            return "turned off (--no-cuda-graphs)"
        if self.device.type != "cuda":
            return f"device {self.device} is not a GPU"
        if not DecodeGraphs.supports(model):
            return "the model has compressed or windowed KV sources, or the MTP layer's lagged one"
        if self._check_invariants:  # the checks read counters back: not capturable
            return "DHISPARSE_CHECK_INVARIANTS is set"
        if self.data_parallel:
            return "data-parallel attention: each MoE layer exchanges a varying number of tokens"
        return None

    def close(self) -> None:
        """Releases host-side resources (a private host arena) and the captured graphs."""
        self.graphs = None
        if self.speculator is not None:
            self.speculator.graphs = None
        self.kv.close()

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        rank: int | None = None,
    ) -> Request:
        """Queues a request; raises ValueError (a client error) for bad input. Under
        data-parallel attention rank 0 places it on a rank (``rank``, where the caller's
        admission holds room for it; else the least loaded); one another rank serves is
        mirrored here (its outputs fill in the returned request)."""
        if request_id in self.requests or request_id in self._remote:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.validate_request(prompt_ids, params)
        if rank is not None and not 0 <= rank < self.serving_ranks:
            raise ValueError(
                f"dp_rank {rank} is not a rank of this worker, which serves "
                f"{self.serving_ranks} data-parallel rank(s)"
            )
        if self.placement is not None:
            rank = self.placement.place(request_id, rank)
            if rank != 0:
                assert self.lockstep is not None
                self.lockstep.record_for(rank, "add_request", request_id, list(prompt_ids), params)
                req = mirror(self.tokenizer, request_id, prompt_ids, params)
                self._remote[request_id] = req
                return req
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        text = TextStream(
            self.tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output
        )
        req = Request(request_id, list(prompt_ids), params, text, generator=gen)
        self.requests[request_id] = req
        self.scheduler.add(req)
        if self.lockstep is not None and not self.data_parallel:
            self.lockstep.record("add_request", request_id, list(prompt_ids), params)
        return req

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Checks that need no engine state (safe from any thread); raises ValueError."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_cfg.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.cfg.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room in the context of "
                f"{self.cfg.max_model_len} tokens"
            )
        if len(prompt_ids) >= self.kv.tokens_capacity:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens exceeds this worker's KV capacity of "
                f"{self.kv.tokens_capacity} tokens"
            )
        params.validate(vocab)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self._remote

    def request(self, request_id: str) -> Request | None:
        """The request of that id: served here, or (rank 0 under data-parallel attention)
        mirrored from the rank that serves it; None when there is none."""
        return self.requests.get(request_id) or self._remote.get(request_id)

    def request_ids(self) -> list[str]:
        """Every request this engine serves or (rank 0) mirrors."""
        return [*self.requests, *self._remote]

    def restore(self, record: SessionRecord, version: int, regions: list[Region]) -> Request | None:
        """Resumes the durable session ``record`` (its manifest's ``version``, its host
        ``regions``; ``durable.restore``); None when no slot or device room is free now. In a
        tensor-parallel group every rank seats it: rank 0 records it for the others, which
        hold the same regions and so must find room as rank 0 did. A data-parallel rank
        resumes its own sessions alone (rank 0 learns of them: ``share_resumed``)."""
        from services.worker.durable.restore import restore

        req = restore(self, record, version, regions)
        if self.lockstep is not None and not self.data_parallel:
            if self.lockstep.leader:
                if req is not None:
                    self.lockstep.record("restore", record, version, regions)
            elif req is None:
                raise RuntimeError(f"rank {self.lockstep.comm.rank} found no room for "
                                   f"{record.request_id!r}, which rank 0 seated")  # fmt: skip
        return req

    def resume(
        self, req: Request, regions: list[Region], rings: dict[int, bytes], version: int
    ) -> bool:
        """Seats a resumed durable session ``req`` (its tokens up to ``req.num_computed`` are
        committed in its host ``regions``; ``rings``: its token-ring snapshots; ``version``: its
        manifest's) in a free slot, running; False (nothing changed) when no slot or device
        room is free."""

        def seat(slot: int) -> bool:
            return self.kv.adopt(slot, req.request_id, regions, req.num_computed, rings)

        if not self.scheduler.seat_running(req, seat):
            return False
        assert req.slot is not None
        self.requests[req.request_id] = req
        # a windowed drafter restarts from an empty ring (outputs do not change); the MTP
        # drafter's context is the KV cache's, restored with the rest
        if self.speculator is not None:
            self.speculator.drafter.begin(req.slot)
        if self.journal is not None:
            self.journal.resumed(req.request_id, version)
        self.stats.sessions_resumed += 1
        return True

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request; its last output, or None when it is not here. Rank 0 under
        data-parallel attention ends the mirror of a request another rank serves at once, and
        that rank ends the request itself before its next step runs (its output of the abort
        stays there: rank 0 gave this one)."""
        if request_id in self._remote:
            assert self.lockstep is not None and self.placement is not None
            owner = self.placement.owner(request_id)
            assert owner is not None
            self.lockstep.record_for(owner, "abort", request_id)
            req = self._remote[request_id]
            req.status, req.finish_reason = Status.FINISHED, FinishReason.ABORT
            self._end_mirror(req)
            return req.output()
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT, None)
        if self.lockstep is not None and not self.data_parallel:
            self.lockstep.record("abort", request_id)
        return req.output()

    def has_work(self) -> bool:
        """Whether a step has something to do (rank 0: on any rank of the group)."""
        if self.placement is not None:
            assert self.lockstep is not None
            if self.placement.others_busy or self.lockstep.pending:
                return True
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        others = self.placement.others_running if self.placement is not None else 0
        return len(self.scheduler.running) + others

    @property
    def num_waiting(self) -> int:
        others = self.placement.others_waiting if self.placement is not None else 0
        return len(self.scheduler.waiting) + others

    @property
    def serving_ranks(self) -> int:
        """The ranks that each serve their own requests: the group under data-parallel
        attention (each with this rank's seats and KV capacity), else one."""
        return len(self.placement.loads) if self.placement is not None else 1

    def rank_loads(self) -> list[RankLoad]:
        """Each serving rank's load as it last reported it (data-parallel attention, rank 0;
        else none: the group serves one batch)."""
        return list(self.placement.loads) if self.placement is not None else []

    def others_free_bytes(self) -> int:
        """The other serving ranks' free KV bytes (data-parallel attention; else 0)."""
        return self.placement.others_free_bytes if self.placement is not None else 0

    @property
    def prefill_tokens_computed(self) -> int:
        """Prompt tokens the worker has computed: this rank's, and under data-parallel
        attention (rank 0) the other ranks' as they last reported."""
        others = self.placement.others_prefill_tokens if self.placement is not None else 0
        return self.stats.prefill_tokens_computed + others

    @property
    def sessions_resumed(self) -> int:
        """Durable sessions the worker has resumed (as ``prefill_tokens_computed``)."""
        others = self.placement.others_sessions_resumed if self.placement is not None else 0
        return self.stats.sessions_resumed + others

    def store_problems(self) -> list[str]:
        """Rank 0 under data-parallel attention: each other rank whose link to the node's
        host store was not ok at its last report (a rank reports after every step, and at
        start-up); else none: the other ranks of a TP group hold no link of their own."""
        return self.placement.store_problems() if self.placement is not None else []

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduling round: one pass over the step's prefill chunks (at most
        ``max_prefill_tokens`` tokens), then one decode token (or verify round) for each
        running request that has sampled. Returns the outputs of requests that emitted
        tokens or finished; a chunk that does not end its prefill emits nothing. In a group,
        every rank's step begins with rank 0's mutations since the last (``parallel.lockstep``);
        under data-parallel attention every rank's outputs come back from rank 0's."""
        if self.lockstep is not None:
            for op in self.lockstep.exchange():
                if not self.lockstep.leader:
                    getattr(self, op.name)(*op.args)
        if not self._maintained:  # else the last decode pass did it (``run_pass``)
            self.kv.maintain()
        self._maintained = False
        sched = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        for req, message in sched.failed:
            outputs.append(self._fail(req, RequestError("unavailable", message)))
        if (
            not (sched.prefill or sched.decode)
            and self.scheduler.waiting
            and not self.kv.settling()
        ):
            # Nothing runs and the head still cannot be admitted into an empty cache: it can
            # never fit, so end it rather than wait forever.
            head = self.scheduler.waiting[0]
            refusal = self.kv.admission_refusal()
            if refusal is not None:  # the host store is full, not the device
                outputs.append(self._fail(head, RequestError("resource_exhausted", refusal)))
            else:
                self._finish(head, FinishReason.LENGTH, None)
                outputs.append(head.output(text=head.text.finish()))
        if sched.prefill:
            self.stats.prefill_tokens_computed += sched.prefill_tokens
            t0 = time.perf_counter()
            reqs, chunks = zip(*sched.prefill, strict=True)
            outputs.extend(self.run_pass(list(reqs), list(chunks)))
            self.stats.prefill_s += time.perf_counter() - t0
        if sched.decode:
            self.stats.decode_steps += 1
            t0 = time.perf_counter()
            if self.speculator is not None:
                outs = self.speculator.round(sched.decode)
            else:
                outs = self.run_pass(sched.decode)
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.decode_tokens += sum(len(o.new_token_ids) for o in outs)
            outputs.extend(outs)
        if self.journal is not None and self._writes_manifests:
            # before the outputs leave: no token without its manifest
            self.journal.record(self.scheduler.running)
        if self._check_invariants:
            self.kv.check()
        if self.data_parallel:
            return self._gather_outputs(outputs)
        return outputs

    def _gather_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Data-parallel attention, at the end of every rank's step: serves the other ranks'
        MoE rounds until all are done, then hands this rank's outputs and load to rank 0,
        which returns every rank's outputs (others: none)."""
        assert self.exchange is not None and self.lockstep is not None
        self.exchange.idle()
        got = self.lockstep.gather((outputs, self._load()))
        if got is None:
            return []
        assert self.placement is not None
        self.placement.report([load for _, load in got])
        merged = list(outputs)
        for outs, _ in got[1:]:
            for out in outs:
                self._mirror(out)
            merged.extend(outs)
        return merged

    def _load(self) -> RankLoad:
        """This rank's state, for rank 0 (data-parallel attention)."""
        link = self.host_link
        return RankLoad(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            busy=self.scheduler.has_work(),
            kv_free_bytes=self.kv.memory().free,
            prefill_tokens=self.stats.prefill_tokens_computed,
            sessions_resumed=self.stats.sessions_resumed,
            store_problem="" if link is None or link.healthy else link.status(),
        )

    def share_resumed(self) -> None:
        """Data-parallel attention, once at start-up on every rank, after each has adopted its
        own durable sessions from the node's store (``durable.adoption``): every rank's load
        and resumed sessions go to rank 0, which places each session on its rank and mirrors
        it (a client re-attaches through rank 0, ``Resume``)."""
        assert self.lockstep is not None and self.data_parallel
        mine = [Resumed.of(req) for req in self.requests.values()]
        got = self.lockstep.gather((mine, self._load()))
        if got is None:
            return
        assert self.placement is not None
        self.placement.report([load for _, load in got])
        for rank, (sessions, _) in enumerate(got[1:], start=1):
            for session in sessions:
                self._remote[session.request_id] = mirror_resumed(self.tokenizer, session)
                self.placement.assign(session.request_id, rank)

    def _mirror(self, out: RequestOutput) -> None:
        """Rank 0: another rank's output, into the request mirrored here."""
        req = self._remote.get(out.request_id)
        if req is None:
            return
        if out.new_token_ids and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        for token in out.new_token_ids:  # the owner's stop checks, replayed: the same text
            req.output_ids.append(token)
            req.check_stop(token, self.eos_token_ids, self.cfg.max_model_len)
        if out.finished:
            req.status, req.finish_reason, req.stop_reason = (
                Status.FINISHED, out.finish_reason, out.stop_reason,
            )  # fmt: skip
            req.error = out.error
            self._end_mirror(req)

    def _end_mirror(self, req: Request) -> None:
        """Rank 0: a mirrored request has finished (its status set)."""
        del self._remote[req.request_id]
        assert self.placement is not None
        self.placement.forget(req.request_id)
        self.stats.finished.append(
            (req.arrival, req.first_token_time, time.monotonic(), len(req.output_ids))
        )

    def follow(self) -> None:
        """On a rank other than 0: steps with rank 0, step for step, until it stops the group
        (``stop``). Outputs go to rank 0, whose clients' requests these are."""
        assert self.lockstep is not None and not self.lockstep.leader
        try:
            while True:
                self.step()
                self.stats.drain_finished()  # nobody reads a follower's
        except StopFollowing:
            return

    def stop(self) -> None:
        """On rank 0 of a group: ends the other ranks' ``follow``."""
        if self.lockstep is not None:
            self.lockstep.stop()

    # ---- the target interface the speculator uses (``speculative.target.Target``) ----------
    @property
    def max_model_len(self) -> int:
        return self.cfg.max_model_len

    def ensure_room(self, slot: int, num_tokens: int) -> bool:
        return self.kv.ensure(slot, num_tokens)

    def commit(self, batch: ForwardBatch, num_tokens: list[int]) -> None:
        self.kv.commit(batch, num_tokens)

    def generator(self, req: Request) -> torch.Generator:
        return req.generator or self._default_gen

    @torch.no_grad()
    def run_pass(self, reqs: list[Request], chunks: list[int] | None = None) -> list[RequestOutput]:
        """One forward over each request's uncomputed tokens (one decode token each), or with
        ``chunks`` a prefill pass over the next ``chunks[i]`` tokens of each; every token it
        computes is committed. Each request whose pass reaches its newest token samples one
        token; a prefill chunk that ends short of it samples nothing (its generator does not
        advance) and has no output."""
        starts = [r.num_computed for r in reqs]
        lens = chunks or [r.num_tokens - r.num_computed for r in reqs]
        ends = [a + n for a, n in zip(starts, lens, strict=True)]
        ids: list[int] = []
        for r, a, e in zip(reqs, starts, ends, strict=True):
            ids.extend(r.ids_from(a, e))
        batch = ForwardBatch.build(
            [r.slot for r in reqs],  # type: ignore[misc]
            starts, lens, self.device, prefill=chunks is not None,
        )  # fmt: skip
        done = [i for i, (r, e) in enumerate(zip(reqs, ends, strict=True)) if e == r.num_tokens]
        tokens = to_device(ids, self.device)
        spec = self.speculator
        feats = spec.features() if spec is not None else None
        decode = batch.is_decode and not batch.prefill
        if self.graphs is not None and decode:  # every request of a decode pass samples
            logits = self.graphs.logits(tokens, batch, feats)
        else:
            hidden = self.model(tokens, batch, self.kv, features=feats)
            last = batch.last_token_index
            if len(done) < len(reqs):
                last = last[to_device(done, self.device)]
            logits = self.model.logits(hidden[last])  # [len(done), V]
        self.kv.commit(batch, ends)
        for r, e in zip(reqs, ends, strict=True):
            r.num_computed = e
        if spec is not None:  # the drafter's context follows every committed position
            spec.follow(reqs, batch, starts, feats)
        sampled = [reqs[i] for i in done]  # row j of logits is sampled[j]'s
        for j, r in enumerate(sampled):
            r.ban_early_stops(logits[j : j + 1], self.eos_token_ids)
        # every greedy request's token in one argmax, read back in one copy
        greedy_ids = (
            readback(logits.argmax(-1)) if any(r.params.greedy for r in sampled) else (lambda: [])
        )
        if decode and spec is None:
            # Between this pass and the next, while the device runs this one: copy
            # completions, reclaims and refills (adaptive mode). Their device work queues
            # after the tokens' copy, so it does not delay them.
            self.kv.maintain()
            self._maintained = True
        greedy = greedy_ids()
        outs = []
        for j, r in enumerate(sampled):
            row = logits[j : j + 1]
            if r.params.greedy:
                token = greedy[j]
            else:
                token = sample_token(row[0], r.params, self.generator(r))
            outs.append(self.emit(r, [token], row))
        return outs

    def forward_logits(
        self, tokens: torch.Tensor, batch: ForwardBatch, features: dict | None = None
    ) -> torch.Tensor:
        """[N, V] fp32 logits of every new token of a decode or verify ``batch`` (tokens [N]),
        replayed from a CUDA graph where one covers the pass; writes the pass's rows into the
        KV cache (the caller commits). ``features``: as ``DSAModel.forward`` takes them."""
        if self.graphs is not None and self.graphs.covers(batch):
            return self.graphs.logits(tokens, batch, features)
        return self.model.logits(self.model(tokens, batch, self.kv, features=features))

    def mtp_step(
        self,
        tokens: torch.Tensor,
        batch: ForwardBatch,
        hidden: torch.Tensor | None,
        selection: torch.Tensor | None,
    ) -> MTPStep:
        """One MTP-only draft pass over this engine's KV cache (``MLADecoder.mtp_step``)."""
        return self.model.mtp_step(tokens, batch, self.kv, hidden, selection)

    def emit(self, req: Request, tokens: list[int], logits: torch.Tensor) -> RequestOutput:
        """Emits ``tokens`` (logits [len(tokens), V] they were chosen from) one by one, stopping
        at the first stop condition; returns one output for them."""
        p = req.params
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        emitted: list[int] = []
        lps: list[TokenLogprob] = []
        text = ""
        for i, token in enumerate(tokens):
            if p.logprobs is not None:
                lps.append(token_logprob(logits[i], token, p.logprobs))
            req.output_ids.append(token)
            emitted.append(token)
            finish, stop_reason, delta = req.check_stop(
                token, self.eos_token_ids, self.cfg.max_model_len
            )
            text += delta
            if finish is not None:
                self._finish(req, finish, stop_reason)
                break
        return req.output(tuple(emitted), text, tuple(lps))

    def fail_running(self, error: RequestError) -> list[RequestOutput]:
        """After ``step`` raised: ends every admitted request with ``error`` (a pass that failed
        midway may have left any of their KV rows half written), freeing their slots and KV;
        waiting requests stay queued. Their last outputs carry the error."""
        return [self._fail(req, error) for req in list(self.scheduler.running)]

    def _fail(self, req: Request, error: RequestError) -> RequestOutput:
        """Ends a request the engine cannot serve (its output carries ``error``)."""
        req.error = error
        self._finish(req, FinishReason.ABORT, None)
        return req.output()

    def _finish(self, req: Request, reason: FinishReason, stop_reason: str | int | None) -> None:
        req.status, req.finish_reason, req.stop_reason = Status.FINISHED, reason, stop_reason
        if self.journal is not None:
            self.journal.forget(req.request_id)
        if self.speculator is not None and req.slot is not None:
            self.speculator.release(req.slot)
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        if self.placement is not None:
            self.placement.forget(req.request_id)
        self.stats.finished.append(
            (req.arrival, req.first_token_time, time.monotonic(), len(req.output_ids))
        )

    # ---- offline ----------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Request]:
        """Runs prompts as one continuous batch to completion; returns the finished requests
        in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [
            self.add_request(f"offline-{i}-{id(self)}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, plist, strict=True))
        ]
        while self.has_work():
            self.step()
        return reqs
