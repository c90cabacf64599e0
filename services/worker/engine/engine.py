"""The engine: model + KV cache + scheduler + sampling, stepped by its owner (the worker's
engine thread, or ``dhisparse generate``)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from dhisparse.tokenizer import Tokenizer
from services.kv_host_store.records import Region
from services.worker.engine.config import EngineConfig, device_free_bytes, with_sized_pool
from services.worker.engine.loading import serving_model, tokenizer_and_ends
from services.worker.engine.passes import ModelPasses, graphs_off
from services.worker.engine.prefix_setup import prefix_reuse
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.stats import EngineStats
from services.worker.graphs.cuda_graph import DecodeGraphs
from services.worker.kv.batch import ForwardBatch
from services.worker.model.decoder import SparseDecoder
from services.worker.parallel.comm import LOCAL, Comm
from services.worker.rank_group.placement import RankLoad
from services.worker.rank_group.role import RankGroup
from services.worker.request import prompt_logprobs
from services.worker.request.emission import append_tokens, decoded_tokens
from services.worker.request.grammar import GrammarCompiler
from services.worker.request.grammar_masks import GrammarMasks
from services.worker.request.prompt_check import check_prompt
from services.worker.request.request import (
    FinishReason,
    Request,
    RequestError,
    RequestOutput,
    SamplingParams,
    Status,
)
from services.worker.serving.cache import KVCache
from services.worker.serving.pool_size import pool_bounds
from services.worker.speculative.speculator import Speculator, make_drafter
from services.worker.transfers import readback, to_device

if TYPE_CHECKING:
    from services.worker.durable.host_link import HostLink
    from services.worker.durable.journal import Journal
    from services.worker.durable.manifest import SessionRecord

__all__ = ["Engine"]


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        model: SparseDecoder | None = None,
        tokenizer: Tokenizer | None = None,
        host: tuple | None = None,
        comm: Comm = LOCAL,
    ) -> None:
        """``host``: (region store, arena mapping) of the node's kv_host_store for the hierarchy
        modes; without it they use a private arena. ``comm``: the group of ranks this engine
        is one of (``cfg.parallel``); its part in the group is ``group`` (``rank_group.role``)."""
        self.cfg = cfg
        sc = cfg.speculation
        if comm.size != cfg.parallel.world_size:
            n = cfg.parallel.world_size
            raise ValueError(f"{cfg.parallel.name} over {n} ranks, given a group of {comm.size}")
        # this rank's part in its group (alone: a group of one)
        self.group = RankGroup(comm, cfg.parallel.data_parallel_attention, cfg.max_model_len)
        host = self.group.host(host)
        # this rank's store registration (``durable.host_link``), set by whoever registers it
        self.host_link: HostLink | None = None
        model, hot_head = serving_model(cfg, model, comm)
        self.model = model
        self.model_cfg = model.cfg
        self.exchange = model.expert_exchange
        if self.group.data_parallel and self.exchange is None:
            raise ValueError("data-parallel attention needs a model with routed experts")
        self.tokenizer, self.eos_token_ids = tokenizer_and_ends(cfg, model, tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, model.cfg.vocab_size, self.eos_token_ids)
        self.device = torch.device(cfg.device)
        rows = cfg.max_num_seqs * max(1, sc.width)  # the most rows a pass samples
        self.grammar_masks = GrammarMasks(model.cfg.vocab_size, self.device, rows, cfg.max_num_seqs)
        dtype = model.dtype
        bounds = pool_bounds(model.cfg, replace(cfg, kv_pool_mib=0).kv_config(dtype))
        cfg = self.cfg = with_sized_pool(cfg, comm, device_free_bytes(cfg.device), *bounds)
        kv_cfg = cfg.kv_config(dtype)
        if host is not None and not self.group.writes_host:
            kv_cfg = replace(kv_cfg, host_writer=False)
        self.kv = KVCache(self.model_cfg, kv_cfg, host)
        self.journal: Journal | None = None
        if self.kv.sessions is not None:
            from services.worker.durable.journal import Journal

            self.journal = Journal(self.kv, self.device)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._default_gen = torch.Generator(self.device)
        self._default_gen.manual_seed(self.group.sampling_seed(cfg.sampling_seed()))
        self._check_invariants = bool(os.environ.get("DHISPARSE_CHECK_INVARIANTS"))
        self._maintained = False  # the last decode pass ran the payload's maintain()
        self.passes = ModelPasses(model, self.kv, self.device, cfg.fused_kernels, hot_head)
        self.speculator: Speculator | None = None
        if sc.drafter:
            drafter = make_drafter(sc.drafter, model, sc.width, cfg.seed, self.passes)
            self.speculator = Speculator(
                self, self.kv, self.passes.forward_logits, drafter, sc, cfg.max_num_seqs,
                cfg.page_size, cfg.max_model_len, self.passes.cold_passes,
            )  # fmt: skip
            if self.group.replicated:
                assert self.group.lockstep is not None
                self.speculator.agree = self.group.lockstep.agree
        # a drafter's own context is rebuilt by the prefill of an imported prefix's last tokens
        context = self.speculator.drafter.context_window if self.speculator is not None else 0
        self.scheduler = Scheduler(
            self.kv, cfg.max_num_seqs, cfg.max_prefill_tokens, cfg.max_model_len,
            manifest_bytes=self.journal.manifest_bytes if self.journal else None,
            chunked=cfg.chunked_prefill, prefix=prefix_reuse(cfg, self.kv, context, self.group),
        )  # fmt: skip
        spec = self.speculator
        # Why decode passes run eagerly (None: they are captured as CUDA graphs); the worker
        # logs it at start-up and exports it (``dhisparse:worker_config_info``).
        self.graphs_off_reason = graphs_off(
            cfg.graphs, model, self.device, self._check_invariants,
            self.group.data_parallel,
        )  # fmt: skip
        if self.graphs_off_reason is None:
            self.passes.graphs = DecodeGraphs(
                model, self.kv, cfg.max_num_seqs, consecutive=cfg.graphs.capture == "consecutive",
                max_width=spec.k_max if spec is not None else 1, mtp_blocks=cfg.graphs.mtp_block,
            )  # fmt: skip
            if spec is not None:
                spec.capture(cfg.max_num_seqs)

    def close(self) -> None:
        """Releases host-side resources (a private host arena) and the captured graphs."""
        self.passes.graphs = None
        if self.speculator is not None:
            self.speculator.graphs = None
        self.grammar_masks.close()
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
        data-parallel attention it may go to another rank (``rank``: where the caller's
        admission holds room; ``RankGroup.place``), and the request returned is its mirror."""
        if self.request(request_id) is not None:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.validate_request(prompt_ids, params)
        self.group.check_rank(rank)
        remote = self.group.place(self.tokenizer, request_id, prompt_ids, params, rank)
        if remote is not None:
            return remote
        seeded = params.seed is not None
        gen = torch.Generator(device=self.device).manual_seed(params.seed) if seeded else None
        text = params.text_stream(self.tokenizer, prompt_ids)
        req = Request(request_id, list(prompt_ids), params, text, generator=gen)
        if params.grammar is not None:
            req.grammar = self.grammars.state(params.grammar)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.group.record("add_request", request_id, list(prompt_ids), params)
        return req

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Checks that need no engine state (safe from any thread); raises ValueError."""
        vocab = self.model_cfg.vocab_size
        check_prompt(prompt_ids, vocab, self.cfg.max_model_len, self.kv.tokens_capacity)
        params.validate(vocab)
        self.grammars.check(params)

    def has_request(self, request_id: str) -> bool:
        return self.request(request_id) is not None

    def request(self, request_id: str) -> Request | None:
        """The request of that id: served here, or (rank 0 under data-parallel attention)
        mirrored from the rank that serves it; None when there is none."""
        return self.requests.get(request_id) or self.group.mirrored(request_id)

    def request_ids(self) -> list[str]:
        """Every request this engine serves or (rank 0) mirrors."""
        return [*self.requests, *self.group.mirrored_ids()]

    def restore(self, record: SessionRecord, version: int, regions: list[Region]) -> Request | None:
        """Resumes the durable session ``record`` (its manifest's ``version``, its host
        ``regions``; ``durable.restore``); None when no slot or device room is free now. In a
        group, the ranks that hold the same regions seat it too (``RankGroup.restored``)."""
        from services.worker.durable.restore import restore

        req = restore(self, record, version, regions)
        self.group.restored(record.request_id, req is not None, record, version, regions)
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

        if req.params.grammar is not None:  # past the tokens the client has been sent
            req.grammar = self.grammars.state(req.params.grammar, req.output_ids)
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
        """Ends a request; its last output, or None when it is not here (a mirrored one:
        ``RankGroup.abort_mirrored``)."""
        mirrored = self.group.abort_mirrored(request_id, self)
        if mirrored is not None:
            return mirrored
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT, None)
        self.group.record("abort", request_id)
        return req.output()

    def has_work(self) -> bool:
        """Whether a step has something to do (rank 0: on any rank of the group)."""
        return self.group.loads.others_busy() or self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running) + self.group.loads.others_running

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + self.group.loads.others_waiting

    @property
    def prefill_tokens_computed(self) -> int:
        """Prompt tokens the worker has computed: this rank's, and under data-parallel
        attention (rank 0) the other ranks' as they last reported."""
        return self.stats.prefill_tokens_computed + self.group.loads.others_prefill_tokens

    @property
    def sessions_resumed(self) -> int:
        """Durable sessions the worker has resumed (as ``prefill_tokens_computed``)."""
        return self.stats.sessions_resumed + self.group.loads.others_sessions_resumed

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduling round: one pass over the step's prefill chunks (at most
        ``max_prefill_tokens`` tokens), then one decode token (or verify round) for each
        running request that has sampled. Returns the outputs of requests that emitted
        tokens or finished; a chunk that does not end its prefill emits nothing. In a group,
        every rank's step begins with rank 0's mutations since the last (``rank_group``);
        under data-parallel attention every rank's outputs come back from rank 0's."""
        self.group.begin_step(self)
        if not self._maintained:  # else the last decode pass did it (``run_pass``)
            self.kv.payload.residency.maintain()
        self._maintained = False
        sched = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        for req, message in sched.failed:
            outputs.append(self._fail(req, RequestError("unavailable", message)))
        if (
            not (sched.prefill or sched.decode)
            and self.scheduler.waiting
            and not self.kv.payload.residency.settling()
        ):
            # nothing runs and the head cannot enter an empty cache: it never will, so end it
            head = self.scheduler.waiting[0]
            refusal = self.kv.payload.refusal
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
                outs = self.speculator.round(sched.decode, sched.memory_waits)
            else:
                outs = self.run_pass(sched.decode)
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.decode_tokens += sum(len(o.new_token_ids) for o in outs)
            outputs.extend(outs)
        if self.journal is not None and self.group.writes_manifests:
            # before the outputs leave: no token without its manifest
            self.journal.record(self.scheduler.running)
        if self._check_invariants:
            self.kv.payload.residency.check()
        self.grammar_masks.prefetch(self.scheduler.running, ahead=self.speculator is None)
        return self.group.end_step(self, outputs, self.exchange)

    def load(self) -> RankLoad:
        """This rank's state, as rank 0 reads it (``rank_group.role.Member``)."""
        link = self.host_link
        return RankLoad(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            busy=self.scheduler.has_work(),
            kv_free_bytes=self.kv.memory().free,
            prefill_tokens=self.stats.prefill_tokens_computed,
            sessions_resumed=self.stats.sessions_resumed,
            prefix=self.scheduler.prefix.stats if self.scheduler.prefix is not None else None,
            store_problem="" if link is None or link.healthy else link.status(),
        )

    # ---- the target interface the speculator uses (``speculative.target.Target``) ----------
    def generator(self, req: Request) -> torch.Generator:
        return req.generator or self._default_gen

    @torch.no_grad()
    def run_pass(self, reqs: list[Request], chunks: list[int] | None = None) -> list[RequestOutput]:
        """One forward over each request's uncomputed tokens (one decode token each), or with
        ``chunks`` a prefill pass over the next ``chunks[i]`` tokens of each; every token it
        computes is committed. Each request whose pass reaches its newest token samples one
        token (one that asks for none, ``max_tokens`` 0, ends there); a prefill chunk that ends
        short of it samples nothing (its generator does not advance) and has no output. A
        prefill pass scores the prompt positions of the requests that ask for prompt logprobs
        (``request.prompt_logprobs``); their first output carries them."""
        starts = [r.num_computed for r in reqs]
        lens = chunks or [r.num_tokens - r.num_computed for r in reqs]
        ends = [a + n for a, n in zip(starts, lens, strict=True)]
        ids = [t for r, a, e in zip(reqs, starts, ends, strict=True) for t in r.ids_from(a, e)]
        batch = ForwardBatch.build(
            [r.slot for r in reqs],  # type: ignore[misc]
            starts, lens, self.device, prefill=chunks is not None,
        )  # fmt: skip
        done = [i for i, (r, e) in enumerate(zip(reqs, ends, strict=True)) if e == r.num_tokens]
        # a request that asks for no tokens ends once its prompt is computed
        prefilled = [reqs[i] for i in done if reqs[i].params.max_tokens == 0]
        done = [i for i in done if reqs[i].params.max_tokens > 0]
        scoring, rows = (
            prompt_logprobs.plan(reqs, starts, ends, batch.cu[:-1]) if chunks else ([], [])
        )
        spec = self.speculator
        feats = spec.features() if spec is not None else None
        logits, scored = self.passes.sampled_logits(
            to_device(ids, self.device), batch, done, feats, rows
        )
        sampled = [reqs[i] for i in done]  # row j of logits is sampled[j]'s
        self.grammar_masks.fill_decode(sampled)  # while the device runs the forward
        if scored is not None:
            prompt_logprobs.score_pass(scoring, scored, self.model.logits)
        self.kv.commit(batch, ends)
        for r, e in zip(reqs, ends, strict=True):
            r.num_computed = e
        if spec is not None:  # the drafter's context follows every committed position
            spec.follow(reqs, batch, starts, feats)
        for j, r in enumerate(sampled):
            r.shape_logits(logits[j : j + 1], (), self.eos_token_ids)
        self.grammar_masks.apply(logits)
        # every greedy request's token in one argmax, read back in one copy
        greedy_ids = (
            readback(logits.argmax(-1)) if any(r.params.greedy for r in sampled) else (lambda: [])
        )
        if batch.is_decode and not batch.prefill and spec is None:
            # Between this pass and the next, while the device runs this one: copy
            # completions, reclaims and refills (adaptive mode). Their device work queues
            # after the tokens' copy, so it does not delay them.
            self.kv.payload.residency.maintain()
            self._maintained = True
        tokens, taken = decoded_tokens(sampled, logits, greedy_ids(), self.generator)
        outs = [
            self.emit(r, [t], logits[j : j + 1], ok)
            for j, (r, t, ok) in enumerate(zip(sampled, tokens, taken, strict=True))
        ]
        for r in prefilled:
            self._finish(r, FinishReason.LENGTH, None)
            outs.append(r.output(text=r.text.finish(), prompt_logprobs=prompt_logprobs.take(r)))
        return outs

    def emit(
        self, req: Request, tokens: list[int], logits: torch.Tensor, taken: bool = False
    ) -> RequestOutput:
        """Appends ``tokens`` (chosen from ``logits`` [len(tokens), V]) to ``req`` up to its
        first stop (``emission.append_tokens``, ``taken`` as there); one output for them."""
        cfg = self.cfg
        got = append_tokens(req, tokens, logits, self.eos_token_ids, cfg.max_model_len, taken)
        if got.finish is not None:
            self._finish(req, got.finish, got.stop_reason)
        return req.output(got.tokens, got.text, got.logprobs, prompt_logprobs.take(req))

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
        self.group.forget(req.request_id)
        self.finished(req)

    def finished(self, req: Request) -> None:
        """Records an ended request's latencies (``EngineStats.finished``)."""
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
