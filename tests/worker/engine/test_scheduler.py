"""The scheduler's chunked-prefill policy, pure Python over a stand-in KV cache: each step's
prefill stays within its budget (and the KV's prefill room), a long prompt runs in chunks while
the other requests decode every step, prefills under way continue before admissions, and a
preempted partial prefill starts again from its first token."""

from __future__ import annotations

import pytest

from services.worker.engine.scheduler import ScheduleOutput, Scheduler
from services.worker.request.request import Request, SamplingParams, Status


class FakeKV:
    """Room for ``capacity`` tokens over all slots; ``prefill_room`` as the hierarchy's."""

    def __init__(self, capacity: int = 1 << 30, prefill_room: int | None = None) -> None:
        self.capacity = capacity
        self.prefill_room = prefill_room
        self.held: dict[int, int] = {}

    @property
    def payload(self) -> FakeKV:  # where the scheduler reads ``prefill_room``
        return self

    def ensure(self, slot: int, num_tokens: int) -> bool:
        more = num_tokens - self.held.get(slot, 0)
        if more > 0 and sum(self.held.values()) + more > self.capacity:
            return False
        self.held[slot] = max(num_tokens, self.held.get(slot, 0))
        return True

    def admit(self, slot: int, request_id: str, num_tokens: int, budget: int, manifest: int):
        return self.ensure(slot, num_tokens)

    def release(self, slot: int) -> None:
        self.held.pop(slot, None)

    def note_queue(self, budgets) -> None:
        list(budgets)

    def note_horizons(self, horizons) -> None:
        pass


def request(rid: str, prompt: int, max_tokens: int = 4) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, [1] * prompt, params, text=None)  # type: ignore[arg-type]


def step(sched: Scheduler) -> ScheduleOutput:
    """Schedules one step and does what the engine would: computes every chunk (the last one
    samples a token) and one token per decoding request; finished requests leave."""
    out = sched.schedule()
    for req, n in out.prefill:
        req.num_computed += n
        if req.num_computed == req.num_tokens:
            req.output_ids.append(7)
    for req in out.decode:
        req.num_computed = req.num_tokens
        req.output_ids.append(7)
    for req in list(sched.running):
        if len(req.output_ids) >= req.params.max_tokens:
            sched.remove(req)
    return out


def scheduler(kv: FakeKV, budget: int, chunked: bool = True, slots: int = 8) -> Scheduler:
    return Scheduler(kv, slots, budget, max_model_len=4096, chunked=chunked)  # type: ignore[arg-type]


def test_a_long_prompt_runs_in_chunks_while_the_others_decode_every_step() -> None:
    sched = scheduler(FakeKV(), budget=16)
    early = [request(f"d{i}", 10, max_tokens=40) for i in range(3)]
    for r in early:
        sched.add(r)
    step(sched)  # the three short prompts: 30 tokens over two steps
    step(sched)
    long = request("long", 200)
    sched.add(long)
    chunks = []
    while not long.output_ids:
        out = step(sched)
        assert out.prefill_tokens <= 16
        assert all(r in out.decode for r in early), "a decode step was skipped"
        chunks += [n for r, n in out.prefill if r is long]
    assert chunks == [16] * 12 + [8]
    assert long.num_computed == 200 and len(long.output_ids) == 1


def test_prefills_under_way_continue_first_and_admissions_fill_the_budget() -> None:
    sched = scheduler(FakeKV(), budget=16)
    a, b, c = request("a", 40), request("b", 30), request("c", 5)
    for r in (a, b, c):
        sched.add(r)
    seen = [[(r.request_id, n) for r, n in step(sched).prefill] for _ in range(5)]
    assert seen == [
        [("a", 16)],
        [("a", 16)],
        [("a", 8), ("b", 8)],  # b is admitted into what a leaves of the budget
        [("b", 16)],  # and continues before c is admitted
        [("b", 6), ("c", 5)],
    ]
    assert not a.prefilling and len(a.output_ids) >= 1
    assert [r.request_id for r in sched.running] == ["a", "b", "c"]


def test_prefill_room_bounds_a_pass_with_the_prefixes_it_continues() -> None:
    sched = scheduler(FakeKV(prefill_room=50), budget=32)
    a, b = request("a", 45), request("b", 40)
    sched.add(a)
    sched.add(b)
    assert [(r.request_id, n) for r, n in step(sched).prefill] == [("a", 32)]
    # a's 32 computed tokens stay in the room beside its last 13; b gets what is left
    assert [(r.request_id, n) for r, n in step(sched).prefill] == [("a", 13), ("b", 5)]
    assert [(r.request_id, n) for r, n in step(sched).prefill] == [("b", 32)]
    assert [(r.request_id, n) for r, n in step(sched).prefill] == [("b", 3)]


def test_preempting_a_partial_prefill_returns_it_to_the_head_of_the_queue() -> None:
    kv = FakeKV(capacity=51)  # d's 8 + 3 tokens beside p's 40, then one too many
    sched = scheduler(kv, budget=8)
    d, p = request("d", 8, max_tokens=40), request("p", 40)
    sched.add(d)
    step(sched)
    sched.add(p)
    for _ in range(3):
        assert not step(sched).preempted
    assert p.prefilling and p.num_computed == 24
    out = step(sched)  # d grows past its room: p, the newest, goes
    assert out.preempted == [p] and not out.prefill and out.decode == [d]
    assert p.status is Status.WAITING and p.num_computed == 0 and p.slot is None
    assert sched.waiting[0] is p


def test_unchunked_a_prompt_runs_whole_and_alone_past_the_budget() -> None:
    sched = scheduler(FakeKV(), budget=16, chunked=False)
    a, b, c = request("a", 100), request("b", 10), request("c", 10)
    for r in (a, b, c):
        sched.add(r)
    assert [(r.request_id, n) for r, n in step(sched).prefill] == [("a", 100)]
    assert [(r.request_id, n) for r, n in step(sched).prefill] == [("b", 10)]
    assert [(r.request_id, n) for r, n in step(sched).prefill] == [("c", 10)]


def test_a_budget_below_one_token_is_refused() -> None:
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        scheduler(FakeKV(), budget=0)


def test_admissions_left_waiting_for_memory_are_counted() -> None:
    """What the width policy reads: requests left waiting because the head's admission found
    no KV room; none when only the slots or the prefill budget hold them back."""
    sched = scheduler(FakeKV(capacity=100), budget=256)
    for i in range(3):
        sched.add(request(f"m{i}", 60, max_tokens=40))
    assert step(sched).memory_waits == 2  # the first fits; the second finds no room
    assert step(sched).memory_waits == 2
    slots = scheduler(FakeKV(), budget=256, slots=1)
    for i in range(3):
        slots.add(request(f"s{i}", 60))
    assert step(slots).memory_waits == 0 and len(slots.waiting) == 2
    budget = scheduler(FakeKV(), budget=16)
    for i in range(3):
        budget.add(request(f"b{i}", 60))
    assert step(budget).memory_waits == 0 and len(budget.waiting) == 2
