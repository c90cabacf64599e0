"""A live peer takes a request over from a dead, unreachable or draining owner: the store fences
the previous holder off for good (even once its process comes back), refuses a peer computing
rows another way, and lets exactly one of two racing adopters win — checked on the store's
logic with a fake clock, then with real processes against a real store process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from dhisparse import metrics as names
from services.kv_host_store import FailedPrecondition, KVHostStoreClient, PermissionDenied
from services.kv_host_store.store import HostStore
from tests.kv_host_store.conftest import ROOT, Clock, StoreProcess


def test_a_peer_fences_an_unreachable_owner_and_takes_its_request(store: HostStore) -> None:
    a = store.register_owner("wA", 60.0, salt="s").generation
    b = store.register_owner("wB", 60.0, salt="s").generation
    r = store.allocate("req", "wA", 0, 4, 64, generation=a)
    store.allocate("other", "wA", 0, 4, 64, generation=a)
    with pytest.raises(FailedPrecondition, match="live owner 'wA' generation 1"):
        store.adopt("req", "wB", b, from_owner="wA")  # alive as far as the store knows
    (got,) = store.adopt("req", "wB", b, from_owner="wA", fence=True)
    assert (got.region_id, got.offset, got.owner, got.generation) == (
        r.region_id,
        r.offset,
        "wB",
        b,
    )
    # Fencing ended the whole generation: its other request is adoptable, its calls refused.
    assert [i.request_id for i in store.list_requests("wA", adoptable_only=True)] == ["other"]
    with pytest.raises(FailedPrecondition, match="released"):
        store.renew_owner("wA", a)
    with pytest.raises(FailedPrecondition, match="released"):
        store.mark_durable(r.region_id, "wA", 0, 1, generation=a)
    # wA restarts (a new generation): the request is wB's, not its own any more.
    a2 = store.register_owner("wA", 60.0, salt="s").generation
    with pytest.raises(PermissionDenied, match="owned by 'wB'"):
        store.lookup("req", "wA", generation=a2)
    assert store.mark_durable(r.region_id, "wB", 0, 2, generation=b) == 2
    s = store.stats()
    assert (s.adoptions, s.owners_fenced) == (1, 1)


def test_the_previous_holder_is_refused_even_when_its_lease_was_only_late(
    store: HostStore, clock: Clock
) -> None:
    a = store.register_owner("wA", 5.0).generation
    b = store.register_owner("wB", 60.0).generation
    r = store.allocate("req", "wA", 0, 4, 64, generation=a)
    clock.t += 6.0  # wA stalled past its lease, then comes back
    store.adopt("req", "wB", b, from_owner="wA")
    store.renew_owner("wA", a)  # its registration lives on...
    with pytest.raises(PermissionDenied):  # ...but the adopted request is not its own
        store.mark_durable(r.region_id, "wA", 0, 1, generation=a)
    with pytest.raises(PermissionDenied):
        store.allocate("req", "wA", 1, 4, 64, generation=a)


def test_a_draining_owner_hands_a_request_over(store: HostStore) -> None:
    a = store.register_owner("wA", 60.0).generation
    b = store.register_owner("wB", 60.0).generation
    r = store.allocate("req", "wA", 0, 4, 64, generation=a)
    store.allocate("kept", "wA", 0, 4, 64, generation=a)
    store.hand_over("req", "wA", a)
    store.hand_over("req", "wA", a)  # twice changes nothing
    (info,) = store.list_requests(adoptable_only=True)
    assert (info.request_id, info.owner, info.adoptable) == ("req", "wA", True)
    assert store.mark_durable(r.region_id, "wA", 0, 1, generation=a) == 1  # still its own
    store.adopt("req", "wB", b, from_owner="wA")
    with pytest.raises(PermissionDenied):
        store.mark_durable(r.region_id, "wA", 1, 2, generation=a)
    with pytest.raises(FailedPrecondition, match="not adoptable"):
        store.adopt("kept", "wB", b, from_owner="wA")  # a live owner keeps what it did not offer
    with pytest.raises(PermissionDenied):
        store.hand_over("req", "wA", a)  # only its owner offers a request
    assert store.stats().handovers == 1
    assert store.list_requests(adoptable_only=True) == []  # adopted: wB's, and wB lives


def test_a_peer_computing_rows_another_way_is_refused(store: HostStore) -> None:
    a = store.register_owner("wA", 60.0, salt="model-1|bf16|64").generation
    b = store.register_owner("wB", 60.0, salt="model-2|bf16|64").generation
    store.allocate("req", "wA", 0, 4, 64, generation=a)
    store.release_owner("wA", a)
    with pytest.raises(FailedPrecondition, match="another model or KV layout"):
        store.adopt("req", "wB", b)
    c = store.register_owner("wC", 60.0, salt="model-1|bf16|64").generation
    assert store.adopt("req", "wC", c)[0].owner == "wC"


def test_of_two_racing_adopters_the_first_wins(store: HostStore) -> None:
    a = store.register_owner("wA", 60.0).generation
    b = store.register_owner("wB", 60.0).generation
    c = store.register_owner("wC", 60.0).generation
    store.allocate("req", "wA", 0, 4, 64, generation=a)
    store.adopt("req", "wB", b, from_owner="wA", fence=True)
    with pytest.raises(FailedPrecondition, match="belongs to 'wB' generation 1 now"):
        store.adopt("req", "wC", c, from_owner="wA", fence=True)
    # and the winner lives: without from_owner the loser is refused as well
    with pytest.raises(FailedPrecondition, match="live owner 'wB'"):
        store.adopt("req", "wC", c)


def test_an_adopter_that_dies_mid_adoption_leaves_it_adoptable(store: HostStore) -> None:
    a = store.register_owner("wA", 60.0).generation
    b = store.register_owner("wB", 60.0).generation
    c = store.register_owner("wC", 60.0).generation
    store.allocate("req", "wA", 0, 4, 64, generation=a)
    store.adopt("req", "wB", b, from_owner="wA", fence=True)
    # wB dies before it streams anything; whoever notices fences wB and adopts from it
    (got,) = store.adopt("req", "wC", c, from_owner="wB", fence=True)
    assert got.owner == "wC"
    with pytest.raises(FailedPrecondition):
        store.renew_owner("wB", b)


_RACER = textwrap.dedent(
    """
    import sys
    from services.kv_host_store import FailedPrecondition, KVHostStoreClient

    target, owner, go = sys.argv[1], sys.argv[2], sys.argv[3]
    with KVHostStoreClient(target, timeout=10) as c:
        gen = c.register_owner(owner, 60.0, salt="s").generation
        print("ready", flush=True)
        sys.stdin.readline()  # both racers start together
        try:
            (region,) = c.adopt("req", owner, gen, from_owner="wA", fence=True)
            print("won", region.offset, flush=True)
        except FailedPrecondition as e:
            print("lost", e, flush=True)
    """
)


@pytest.mark.parametrize("round_", range(3))
def test_two_adopter_processes_race_and_exactly_one_wins(
    store_process: StoreProcess, tmp_path: Path, round_: int
) -> None:
    target = store_process.target
    with KVHostStoreClient(target, timeout=10) as c:
        a = c.register_owner("wA", 60.0, salt="s").generation
        r = c.allocate("req", "wA", 0, 8, 64, generation=a)
        script = tmp_path / "racer.py"
        script.write_text(_RACER)
        racers = [
            subprocess.Popen(
                [sys.executable, str(script), target, owner, "go"],
                cwd=ROOT,
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={"PYTHONPATH": str(ROOT)},
            )
            for owner in ("wB", "wC")
        ]
        try:
            for p in racers:
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            for p in racers:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            outs = [p.communicate(timeout=30)[0].strip() for p in racers]
        finally:
            for p in racers:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        won = [o for o in outs if o.startswith("won")]
        assert len(won) == 1, outs
        assert won[0] == f"won {r.offset}"
        (lost,) = [o for o in outs if o.startswith("lost")]
        assert "another adopter took it" in lost
        (info,) = c.list_requests()
        winner = "wB" if outs[0].startswith("won") else "wC"
        assert info.owner == winner
        with pytest.raises(FailedPrecondition):  # wA was fenced off by the winner
            c.mark_durable(r.region_id, "wA", 0, 1, generation=a)
        stats = c.stats()
        assert (stats.adoptions, stats.owners_fenced) == (1, 1)
    text = httpx.get(store_process.metrics_url, timeout=5).text
    assert f"{names.HOST_STORE_OWNERS_FENCED}_total 1.0" in text
    assert f"{names.HOST_STORE_HANDOVERS}_total 0.0" in text


def test_a_peer_never_fences_the_successor_that_resumed_the_request(store: HostStore) -> None:
    a1 = store.register_owner("wA", 60.0).generation
    b = store.register_owner("wB", 60.0).generation
    store.allocate("req", "wA", 0, 4, 64, generation=a1)
    a2 = store.register_owner("wA", 60.0).generation  # wA restarted first and resumed it
    store.adopt("req", "wA", a2)
    with pytest.raises(FailedPrecondition, match="not 'wA' generation 1: another adopter"):
        store.adopt("req", "wB", b, from_owner="wA", from_generation=a1, fence=True)
    store.renew_owner("wA", a2)  # generation 2 lives on, unfenced
    assert store.stats().owners_fenced == 0
