"""An engine's part in its worker's group of ranks (DESIGN §8); one rank alone is a group of one.

Every rank holds a whole engine over its part of the model. Rank 0 is driven from outside and
the others ``follow`` it (``lockstep``). Tensor parallel: every rank applies every mutation
rank 0 applied (``replicated``), and over the node's store the group holds one set of host
regions that rank 0 writes (``region_group``). Data-parallel attention: rank 0 places each new
request on one rank (``placement``) and keeps a mirror of those the others serve (``mirror``),
filled in from the outputs every rank hands to rank 0 after each step; each rank is an owner of
its own at the store and resumes its own sessions.

The role holds the group's state; what it needs of its engine is ``Member``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from dhisparse.tokenizer import Tokenizer
from services.worker.parallel.comm import Comm
from services.worker.parallel.exchange import ExpertExchange
from services.worker.rank_group.adoptions import ADOPT, AdoptionOutcome, RankAdoptions
from services.worker.rank_group.loads import RankLoads
from services.worker.rank_group.lockstep import Lockstep, StopFollowing
from services.worker.rank_group.mirror import Resumed, mirror, mirror_resumed
from services.worker.rank_group.placement import Placement, RankLoad
from services.worker.rank_group.region_group import GroupRegionStore, portable
from services.worker.request.request import (
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
    Status,
)


class Member(Protocol):
    """What the role needs of its rank's engine."""

    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    requests: dict[str, Request]  # the requests this rank serves, by id

    def step(self) -> list[RequestOutput]: ...

    def load(self) -> RankLoad:
        """This rank's load, as rank 0 reads it."""
        ...

    def finished(self, req: Request) -> None:
        """Counts a request that has ended (the engine's latency record)."""
        ...


class RankGroup:
    def __init__(self, comm: Comm, data_parallel_attention: bool, max_model_len: int) -> None:
        self.comm = comm
        self.lockstep = Lockstep(comm) if comm.size > 1 else None
        self.data_parallel = comm.size > 1 and data_parallel_attention
        self.placement = Placement(comm.size) if self.data_parallel and comm.is_leader else None
        # the serving ranks' loads (rank 0 under data-parallel attention: the others' too)
        self.loads = RankLoads(self.placement, self.lockstep)
        self._remote: dict[str, Request] = {}  # rank 0 under data-parallel attention: mirrors
        self._max_model_len = max_model_len
        self._store: Any = None  # the node's store as given to ``host``
        self.adoptions = RankAdoptions()  # peers' sessions adopted on this group's ranks

    # ---- how the group is laid out ------------------------------------------------------------
    @property
    def replicated(self) -> bool:
        """Tensor parallel: every rank serves every request and applies rank 0's mutations."""
        return self.lockstep is not None and not self.data_parallel

    def host(self, host: tuple | None) -> tuple | None:
        """The node's store as this rank uses it: a tensor-parallel group shares one set of
        regions (``GroupRegionStore``); a rank alone or a data-parallel rank uses its own."""
        self._store = host[0] if host is not None else None
        if host is None or not self.replicated:
            return host
        return (GroupRegionStore(host[0], self.comm), *host[1:])

    @property
    def own_store(self) -> Any:
        """The node's store for calls this rank makes alone (leaving a cached prefix): the
        store itself on a rank alone, a data-parallel rank and rank 0 of a tensor-parallel
        group; None on a tensor-parallel follower, which calls none."""
        return self._store if self.writes_host else None

    def host_written(self, error: BaseException | None) -> None:
        """After this rank wrote its part of the arena (``error``: what writing raised):
        under tensor parallelism every rank waits here until rank 0, the group's writer, has
        written, and raises what rank 0 raised; otherwise raises ``error``, if any."""
        if self.replicated:
            assert self.lockstep is not None
            told = self.lockstep.agree(None if error is None else portable(error))
            error = error if self.lockstep.leader else told
        if error is not None:
            raise error

    def sampling_seed(self, own: int) -> int:
        """The seed of the default sampling generator: rank 0's ``own`` on every rank of a
        tensor-parallel group (its ranks sample the same logits, and must draw alike); a rank
        alone or a data-parallel rank keeps its own."""
        return self.lockstep.agree(own) if self.replicated and self.lockstep is not None else own

    @property
    def writes_host(self) -> bool:
        """Whether this rank writes its host backups (a tensor-parallel follower reads rank 0's)."""
        return not self.replicated or self.comm.is_leader

    @property
    def writes_manifests(self) -> bool:
        """A tensor-parallel follower's manifests would be rank 0's (the same sessions)."""
        return self.comm.is_leader or self.data_parallel

    # ---- requests -----------------------------------------------------------------------------
    def check_rank(self, rank: int | None) -> None:
        """Raises ValueError for a ``dp_rank`` that is not a serving rank of this group."""
        serving = self.loads.serving_ranks
        if rank is not None and not 0 <= rank < serving:
            raise ValueError(
                f"dp_rank {rank} is not a rank of this worker, which serves "
                f"{serving} data-parallel rank(s)"
            )

    def place(
        self,
        tokenizer: Tokenizer,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        rank: int | None,
    ) -> Request | None:
        """Rank 0 under data-parallel attention: places a new request on a rank (``rank``,
        where the caller's admission holds room for it; else the least loaded). Returns its
        mirror when another rank serves it (that rank adds it before its next step), else
        None: this rank serves it."""
        if self.placement is None:
            return None
        rank = self.placement.place(request_id, rank)
        if rank == 0:
            return None
        assert self.lockstep is not None
        self.lockstep.record_for(rank, "add_request", request_id, list(prompt_ids), params)
        req = mirror(tokenizer, request_id, prompt_ids, params)
        self._remote[request_id] = req
        return req

    def record(self, name: str, *args: Any) -> None:
        """Tensor parallel, rank 0: a mutation just applied, for every rank to apply."""
        if self.replicated:
            assert self.lockstep is not None
            self.lockstep.record(name, *args)

    def restored(self, request_id: str, seated: bool, *args: Any) -> None:
        """Tensor parallel: rank 0 records a resumed session (``args``: what ``restore`` took)
        for the others, which hold the same regions and so must find room as rank 0 did."""
        if not self.replicated:
            return
        assert self.lockstep is not None
        if self.lockstep.leader:
            if seated:
                self.lockstep.record("restore", *args)
        elif not seated:
            raise RuntimeError(
                f"rank {self.comm.rank} found no room for {request_id!r}, which rank 0 seated"
            )

    def adopt_on(self, request_id: str, source: Any, rank: int | None) -> int:
        """Rank 0 under data-parallel attention: the rank that adopts a peer's session
        (``rank``, where the caller's admission holds room for it; else the least loaded).
        Another rank is asked to before the next step (``RankAdoptions.here``, ``source``), and
        what it did comes back after that step (``adoptions.take``); rank 0 adopts it itself
        (and ``forget``s it when that fails)."""
        assert self.placement is not None and self.lockstep is not None
        rank = self.placement.place(request_id, rank)
        if rank != 0:
            self.lockstep.record_for(rank, ADOPT, request_id, source)
        return rank

    def mirrored(self, request_id: str) -> Request | None:
        """Rank 0: the mirror of a request another rank serves, or None."""
        return self._remote.get(request_id)

    def mirrored_ids(self) -> list[str]:
        return list(self._remote)

    def abort_mirrored(self, request_id: str, member: Member) -> RequestOutput | None:
        """Rank 0: ends the mirror of a request another rank serves at once, and has that rank
        end the request before its next step; None when it is not mirrored here."""
        req = self._remote.get(request_id)
        if req is None:
            return None
        assert self.lockstep is not None and self.placement is not None
        owner = self.placement.owner(request_id)
        assert owner is not None
        self.lockstep.record_for(owner, "abort", request_id)
        req.status, req.finish_reason = Status.FINISHED, FinishReason.ABORT
        self._end_mirror(req, member)
        return req.output()

    def forget(self, request_id: str) -> None:
        """A request this rank served has ended."""
        if self.placement is not None:
            self.placement.forget(request_id)

    # ---- stepping -----------------------------------------------------------------------------
    def begin_step(self, member: Member) -> None:
        """Every rank's step begins with rank 0's mutations since the last (followers apply
        them). Raises ``StopFollowing`` on a follower once rank 0 has stopped."""
        if self.lockstep is None:
            return
        for op in self.lockstep.exchange():
            if self.lockstep.leader:
                continue
            if op.name == ADOPT:
                self.adoptions.here(*op.args)
            else:
                getattr(member, op.name)(*op.args)

    def end_step(
        self, member: Member, outputs: list[RequestOutput], exchange: ExpertExchange | None
    ) -> list[RequestOutput]:
        """Data-parallel attention, at the end of every rank's step: serves the other ranks'
        MoE rounds until all are done, then hands this rank's outputs and load to rank 0, which
        returns every rank's outputs (the others: none). Otherwise the outputs as they are."""
        if not self.data_parallel:
            return outputs
        assert exchange is not None and self.lockstep is not None
        exchange.idle()
        load = self.adoptions.with_registration(member.load())
        got = self.lockstep.gather((outputs, load, self.adoptions.reported()))
        if got is None:
            return []
        assert self.placement is not None
        self.placement.report([load for _, load, _ in got])
        merged = list(outputs)
        for rank, (outs, _, adopted) in enumerate(got[1:], start=1):
            for outcome in adopted:  # mirrored before the step's outputs fill them in
                self.adoptions.received(outcome, self._adopted_on(rank, outcome, member))
            for out in outs:
                self._mirror(out, member)
            merged.extend(outs)
        return merged

    def _adopted_on(self, rank: int, outcome: AdoptionOutcome, member: Member) -> Request | None:
        """Rank 0: the mirror of a session ``rank`` adopted, or None (it did not)."""
        if outcome.session is None:
            self.forget(outcome.request_id)
            return None
        req = mirror_resumed(member.tokenizer, outcome.session)
        self._remote[outcome.request_id] = req
        assert self.placement is not None
        self.placement.assign(outcome.request_id, rank)
        return req

    def share_resumed(self, member: Member) -> None:
        """Data-parallel attention, once at start-up on every rank, after each has adopted its
        own durable sessions from the node's store (``durable.adoption``): every rank's load
        and resumed sessions go to rank 0, which places each session on its rank and mirrors it
        (a client re-attaches through rank 0, ``Resume``)."""
        assert self.lockstep is not None and self.data_parallel
        mine = [Resumed.of(req) for req in member.requests.values()]
        got = self.lockstep.gather((mine, self.adoptions.with_registration(member.load())))
        if got is None:
            return
        assert self.placement is not None
        self.placement.report([load for _, load in got])
        for rank, (sessions, _) in enumerate(got[1:], start=1):
            for session in sessions:
                self._remote[session.request_id] = mirror_resumed(member.tokenizer, session)
                self.placement.assign(session.request_id, rank)

    def follow(
        self, member: Member, drain: Callable[[], None], release: Callable[[], None] = lambda: None
    ) -> None:
        """On a rank other than 0: steps with rank 0, step for step, until it stops the group
        (``stop``), then ``release()``s what it holds (its store registration) before rank 0's
        ``stop`` returns. Outputs go to rank 0, whose clients' requests these are; ``drain()``
        drops what the step recorded that nobody reads on a follower."""
        assert self.lockstep is not None and not self.lockstep.leader
        try:
            while True:
                member.step()
                drain()
        except StopFollowing:
            pass
        try:
            release()
        finally:
            self.lockstep.released()

    def stop(self) -> None:
        """On rank 0 of a group: ends the other ranks' ``follow`` and returns once each has
        released what it holds; later calls do nothing."""
        if self.lockstep is not None:
            self.lockstep.stop()

    def _mirror(self, out: RequestOutput, member: Member) -> None:
        """Rank 0: another rank's output, into the request mirrored here."""
        req = self._remote.get(out.request_id)
        if req is None:
            return
        if out.new_token_ids and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        for token in out.new_token_ids:  # the owner's stop checks, replayed: the same text
            req.output_ids.append(token)
            req.check_stop(token, member.eos_token_ids, self._max_model_len)
        if out.finished:
            req.status, req.finish_reason, req.stop_reason = (
                Status.FINISHED, out.finish_reason, out.stop_reason,
            )  # fmt: skip
            req.error = out.error
            self._end_mirror(req, member)

    def _end_mirror(self, req: Request, member: Member) -> None:
        """Rank 0: a mirrored request has finished (its status set)."""
        del self._remote[req.request_id]
        assert self.placement is not None
        self.placement.forget(req.request_id)
        member.finished(req)
