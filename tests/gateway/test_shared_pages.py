"""Admission counts a page that several live requests share on their worker once: the leading
pages a worker itself left (the prefix-affinity index's own pages) are offered to the ledger as
shared blocks sized by the capacity model, and the worker's report of what it shared settles
each lease (in-process ledger; the Redis ledger's scripts are held to the same contract in
``test_ledger``)."""

from __future__ import annotations

import json
import random

import pytest

from dhisparse.capacity import profile_from_model_config, required_bytes
from dhisparse.capacity.model import shared_prefix_bytes
from dhisparse.family.presets import preset_topology
from services.gateway.admission import AdmissionConfig, MemoryAdmission
from services.gateway.affinity import AffinityConfig, PrefixAffinity, PrefixAffinityRouter
from services.gateway.ledger import LocalLedger
from services.gateway.routing import AdmissionJob, WorkerStatus
from services.gateway.shared_pages import SharedPages
from services.gateway.sizing import SessionSizer, capacity_mode

MODEL = "tiny-glm"
CONFIG = preset_topology(MODEL)
PAGE = 16
PROMPT = [random.Random(7).randrange(1, 200) for _ in range(203)]  # 12 whole pages and 11
MAX_TOKENS = 50
PROFILE = profile_from_model_config(CONFIG, page_size=PAGE)


def need(mode: str) -> int:
    context = len(PROMPT) + MAX_TOKENS + (1 if mode != "resident" else 0)  # + a verify block
    return required_bytes(PROFILE, context, capacity_mode(mode))


def status(address: str, mode: str, capacity: int, store: str = "node-1") -> WorkerStatus:
    return WorkerStatus(
        address, True, max_num_seqs=32, kv_capacity_bytes=capacity, model_name=MODEL,
        mode=mode, config_json=json.dumps(CONFIG.to_dict()), page_size=PAGE,
        prefix_cache=True, kv_store_id=store,
    )  # fmt: skip


def admission_with(affinity: PrefixAffinity, sizer: SessionSizer) -> MemoryAdmission:
    return MemoryAdmission(
        LocalLedger(), AdmissionConfig(max_queue=0), sizer=sizer,
        router=PrefixAffinityRouter(affinity), shared_pages=SharedPages(affinity, sizer),
    )  # fmt: skip


def job(affinity: PrefixAffinity, name: str) -> AdmissionJob:
    return AdmissionJob(name, len(PROMPT), MAX_TOKENS, MODEL, affinity.prefix(PROMPT))


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
async def test_leases_of_a_prefix_its_worker_left_count_its_pages_once(mode: str) -> None:
    """Three requests of one prompt whose 12 whole pages the worker left: the second and third
    leases add their need less the shared pages, so three fit where two would without sharing;
    a lease settled on fewer shared tokens holds the rest itself; the bytes all return."""
    affinity = PrefixAffinity(AffinityConfig(default_page_size=PAGE))
    shared = shared_prefix_bytes(PROFILE, 12 * PAGE, capacity_mode(mode))
    assert 0 < shared < need(mode)
    capacity = 3 * need(mode) - 2 * shared
    a = status("a", mode, capacity)
    workers = [a]
    admission = admission_with(affinity, SessionSizer(page_size=PAGE))
    await admission.observe(workers)
    affinity.record(affinity.prefix(PROMPT).keys(PAGE), a)  # a left the prompt's pages
    leases = [await admission.acquire(job(affinity, f"r{i}"), lambda: workers) for i in range(3)]
    usage = (await admission.ledger.usage(["a"]))["a"]
    assert usage.admitted_bytes == capacity and usage.sessions == 3
    assert await admission.try_acquire(job(affinity, "r3"), lambda: workers) is None
    # the third shared only its first 5 pages: the other 7 pages are its own
    leases[2].settle(5 * PAGE + 3)
    await admission.close()  # waits for the ledger writes, releases the rest
    usage = (await admission.ledger.usage(["a"]))["a"]
    assert usage.admitted_bytes == 0 and usage.sessions == 0


async def test_a_settled_lease_holds_what_its_worker_did_not_share() -> None:
    affinity = PrefixAffinity(AffinityConfig(default_page_size=PAGE))
    shared = shared_prefix_bytes(PROFILE, 12 * PAGE, "resident")
    five = shared_prefix_bytes(PROFILE, 5 * PAGE, "resident")
    a = status("a", "resident", 10 * need("resident"))
    workers = [a]
    admission = admission_with(affinity, SessionSizer(page_size=PAGE))
    await admission.observe(workers)
    affinity.record(affinity.prefix(PROMPT).keys(PAGE), a)
    first = await admission.acquire(job(affinity, "1"), lambda: workers)
    second = await admission.acquire(job(affinity, "2"), lambda: workers)
    held = (await admission.ledger.usage(["a"]))["a"].admitted_bytes
    assert held == 2 * need("resident") - shared
    second.settle(5 * PAGE)
    await admission.leases.flush()
    held = (await admission.ledger.usage(["a"]))["a"].admitted_bytes
    assert held == 2 * need("resident") - five
    first.settle(12 * PAGE)  # it shared all it named: nothing changes
    second.settle(12 * PAGE)  # settled once already
    await admission.leases.flush()
    assert (await admission.ledger.usage(["a"]))["a"].admitted_bytes == held
    first.release()
    await admission.leases.flush()
    assert (await admission.ledger.usage(["a"]))["a"].admitted_bytes == need("resident")
    await admission.close()


async def test_only_the_pages_a_worker_left_itself_are_shared() -> None:
    """Pages another worker of the node left are imported from the store, not shared; a
    session moved to a peer (``try_acquire``) resumes from the store and shares nothing."""
    affinity = PrefixAffinity(AffinityConfig(default_page_size=PAGE))
    a = status("a", "resident", 10 * need("resident"))
    b = status("b", "resident", 10 * need("resident"))
    admission = admission_with(affinity, SessionSizer(page_size=PAGE))
    await admission.observe([a, b])
    affinity.record(affinity.prefix(PROMPT).keys(PAGE), b)
    for i in range(2):
        lease = await admission.acquire(job(affinity, f"on-a-{i}"), lambda: [a])
        assert lease.worker == "a"
    assert (await admission.ledger.usage(["a"]))["a"].admitted_bytes == 2 * need("resident")
    for i in range(2):
        lease = await admission.try_acquire(job(affinity, f"moved-{i}"), lambda: [b])
        assert lease is not None and lease.worker == "b"
    assert (await admission.ledger.usage(["b"]))["b"].admitted_bytes == 2 * need("resident")
    await admission.close()


def test_a_model_that_shares_no_page_names_no_block() -> None:
    """DeepSeek-V4's compressed sources: its pages are not shared on the device, so a request
    names no block however much of its prompt the worker left."""
    v4 = preset_topology("tiny-dsv4")
    affinity = PrefixAffinity(AffinityConfig(default_page_size=PAGE))
    w = WorkerStatus(
        "v4", True, max_num_seqs=8, kv_capacity_bytes=1 << 30, mode="resident",
        config_json=json.dumps(v4.to_dict()), page_size=PAGE, prefix_cache=True, kv_store_id="n",
    )  # fmt: skip
    affinity.record(affinity.prefix(PROMPT).keys(PAGE), w)
    got = SharedPages(affinity, SessionSizer(page_size=PAGE)).blocks(job(affinity, "x"), [w])
    assert got == {}
