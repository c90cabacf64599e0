"""``python -m bench serving`` on the CPU: the engine-level closed loop on tiny-glm (resident and
adaptive, with and without a random-weight drafter) keeps its contract — every request
completes with exactly the asked tokens, each client runs its requests one at a time, TTFT
covers the allocation wait, no more sessions run than clients — greedy outputs do not depend
on the mode, the load or speculation, and the JSON has its documented fields. One run goes
through the real stack over HTTP."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator

import pytest
import torch

from bench.core.clock import OwnClock
from bench.core.lockstep import lockstep
from bench.serving.cli import RUN_FIELDS, TOP_FIELDS
from bench.serving.config import EngineKey, Load, build_matrix
from bench.serving.engines import build_engine
from bench.serving.loop import ClosedLoop, LoopResult, closed_loop
from bench.serving.setup import Sizing, Target, load_target, prepare_prefixes, size_kv
from bench.serving.summary import summarize
from services.worker.hierarchy.local_store import LocalHostStore
from tests.bench.helpers import bench

INPUT, OUTPUT, PER_CLIENT, RESIDENT = 256, 6, 2, 2
KEYS = [
    EngineKey("resident"),
    EngineKey("adaptive"),
    EngineKey("resident", "dflash", "fixed"),
    EngineKey("adaptive", "dspark", "fixed"),
]
SMALL = ["--device", "cpu", "--model", "tiny-glm", "--drafter-dir", "random", "--page-size",
         "16", "--resident-sessions", str(RESIDENT), "--input-lens", str(INPUT), "--output-len",
         str(OUTPUT), "--spec-width", "4", "--prefixes", "8", "--quiet"]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls on two threads of a shared two-core machine crawl (20x measured here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup(one_thread) -> Iterator[tuple[Target, dict, Sizing, LocalHostStore]]:
    target = load_target("tiny-glm", "cpu", "float32")
    prefixes = prepare_prefixes(target, [INPUT], 8)
    sizing = size_kv(target, [INPUT], OUTPUT, 4, RESIDENT, 16, None, 3)
    store = LocalHostStore(sizing.host_arena_bytes)
    yield target, prefixes, sizing, store
    store.close()


WALL: dict[int, float] = {}  # C -> wall seconds of the lockstep group


@pytest.fixture(scope="module", params=["one after the other", "lockstep"])
def results(setup, request) -> dict[tuple[EngineKey, int], tuple[LoopResult, dict]]:
    """Every key at C = 1 and 3, two requests per client (one engine per key): each engine's
    runs alone, or every key's run at one C in lockstep, each on its own clock."""
    target, prefixes, sizing, store = setup
    load = Load(output_len=OUTPUT, requests_per_client=PER_CLIENT, duration_s=None)
    engines = {
        key: build_engine(target, key, sizing, "cpu", "random", 4, prefixes[INPUT][:1], store)[0]
        for key in KEYS
    }
    out = {}
    try:
        for c in (1, 3):
            if request.param == "lockstep":
                loops = {
                    key: ClosedLoop(eng, prefixes[INPUT], c, load, f"{key.name}-{c}", OwnClock())
                    for key, eng in engines.items()
                }
                t0 = time.perf_counter()
                lockstep(list(loops.values()))
                WALL[c] = time.perf_counter() - t0
                runs = {key: loop.result() for key, loop in loops.items()}
            else:
                runs = {
                    key: closed_loop(eng, prefixes[INPUT], c, load, f"{key.name}-{c}")
                    for key, eng in engines.items()
                }
            for key, res in runs.items():
                out[key, c] = res, summarize(res, engines[key].kv.row_bytes, 16, OUTPUT)
    finally:
        for eng in engines.values():
            eng.close()
    return out


def test_every_request_completes_with_exactly_the_output_length(results) -> None:
    for (key, c), (res, m) in results.items():
        assert len(res.records) == c * PER_CLIENT, key
        assert m["requests"]["completed"] == c * PER_CLIENT
        assert m["requests"]["exact_length"] and m["requests"]["errors"] == 0
        for r in res.records:
            assert r.finish_reason == "length" and r.tokens == len(r.output_ids) == OUTPUT
        for client in range(c):  # closed loop: a client's next request follows its last
            mine = sorted((r for r in res.records if r.client == client), key=lambda r: r.index)
            assert [r.index for r in mine] == list(range(PER_CLIENT))
            assert all(b.arrival >= a.finish for a, b in itertools.pairwise(mine))


def test_ttft_covers_allocation_wait_and_sessions_stay_within_clients(results, setup) -> None:
    sizing = setup[2]
    for (key, c), (res, m) in results.items():
        for r in res.records:
            assert r.arrival <= r.admitted <= r.first <= r.finish  # type: ignore[operator]
        assert m["ttft_s"]["mean"] >= m["alloc_wait_s"]["mean"] >= 0
        assert m["ttft_s"]["n"] == c * PER_CLIENT
        # The budget holds ``resident_sessions`` resident sessions, the hierarchy all C clients
        # in the same budget; the closed loop keeps every client's request offered.
        assert sizing.resident_sessions < 3
        cap = sizing.resident_sessions if key.mode == "resident" else c
        assert m["sessions_admitted"] == min(c, cap)
        assert m["tpot_s"]["mean"] > 0 and m["output_tokens_per_s"] > 0


def test_greedy_outputs_are_the_same_in_every_mode_load_and_with_speculation(results) -> None:
    by_prefix: dict[int, list[int]] = {}
    for (key, c), (res, _) in results.items():
        for r in res.records:
            want = by_prefix.setdefault(r.prefix, r.output_ids)
            assert r.output_ids == want, (key.name, c, r.prefix)
    assert len(by_prefix) >= 6


def test_engine_counters_per_mode(results) -> None:
    for (key, _), (_, m) in results.items():
        if key.mode == "resident":
            assert m["census"] is None and m["reclaim"] is None
        else:
            shares = m["census"]["direct"] + m["census"]["hot"] + m["census"]["host"]
            assert shares == pytest.approx(1.0) and m["census"]["rows"] > 0
            assert m["reclaim"] is not None and m["host_read_bytes_per_token"] >= 0
        if key.drafter == "off":
            assert m["acceptance_length"] is None and m["spec"] is None
        else:
            assert m["spec"]["drafts"] > 0 and 1.0 <= m["acceptance_length"] <= 4.0


def test_in_lockstep_a_run_counts_only_its_own_steps(results, request) -> None:
    """Each run's clock covers its engine's prefill and decode time, and all of them together
    fit in the wall time of the group: the others' steps did not count against any run."""
    if request.node.callspec.params["results"] != "lockstep":
        pytest.skip("the runs went one after the other")
    for c, wall in WALL.items():
        clocks = []
        for key in KEYS:
            res, _ = results[key, c]
            busy = sum(s.decode_s + s.prefill_s for s in res.steps)
            assert busy <= res.window[1] - res.window[0] + 1e-6, key
            clocks.append(res.window[1] - res.window[0])
        assert sum(clocks) <= wall


def test_default_matrix_is_the_documented_subset() -> None:
    runs = build_matrix(["resident", "hisparse", "adaptive"], ["off", "dflash", "dspark",
                        "dflash2"], ["fixed", "paper", "online"], [1, 4, 16, 32, 64, 128, 256],
                        [16384])  # fmt: skip
    base = [r for r in runs if r.key.drafter == "off"]
    spec = [r for r in runs if r.key.drafter != "off"]
    assert len(base) == 21 and len(spec) == 18
    assert {r.key.mode for r in spec} == {"adaptive"}
    assert {r.concurrency for r in spec} == {4, 64}
    assert runs[: len(base)] == base  # baselines first: a time limit cuts speculation first
    full = build_matrix(["resident", "adaptive"], ["off", "dflash"], ["fixed", "online"],
                        [1, 2], [64], full=True)  # fmt: skip
    assert len(full) == 2 * (1 + 2) * 2


def test_cli_writes_json_table_and_plots(tmp_path) -> None:
    out, md, png = tmp_path / "s.json", tmp_path / "s.md", tmp_path / "s"
    args = [*SMALL, "--modes", "resident,adaptive", "--drafters", "off,dflash2", "--schedules",
            "paper", "--concurrency", "2", "--spec-concurrency", "2", "--requests-per-client",
            "1", "--out", str(out), "--table", str(md), "--plot", str(png)]  # fmt: skip
    proc = bench("serving", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(TOP_FIELDS) <= data.keys()
    assert "bench/serving/loop.py" in data["provenance"]["files"]
    assert data["level"] == "engine" and data["skipped"] == []
    names = ["resident@C2/in256", "adaptive@C2/in256", "adaptive/dflash2/paper@C2/in256"]
    assert [r["name"] for r in data["runs"]] == names
    for r in data["runs"]:
        assert set(RUN_FIELDS) <= r["metrics"].keys(), r["name"]
        assert r["metrics"]["requests"]["completed"] == r["run"]["concurrency"]
    sizing = data["sizing"]
    assert sizing["budget_bytes"] > 0 and sizing["slots"] >= 1
    assert {e["engine"] for e in data["engines"]} == {"resident", "adaptive",
                                                       "adaptive/dflash2/paper"}  # fmt: skip
    assert data["runs"][-1]["metrics"]["acceptance_length"] is not None
    rows = [line for line in md.read_text().splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(names)  # the header and one row per run
    for name in ("throughput", "tpot", "ttft", "acceptance"):
        assert (tmp_path / f"s_{name}.png").stat().st_size > 1000


@pytest.mark.slow
def test_http_level_over_the_real_stack(tmp_path) -> None:
    """kv-host-store, worker and gateway as processes; two streaming clients."""
    out = tmp_path / "h.json"
    args = [*SMALL, "--http", "--modes", "adaptive", "--drafters", "off", "--concurrency",
            "2", "--requests-per-client", "2", "--out", str(out), "--log-dir",
            str(tmp_path)]  # fmt: skip
    proc = bench("serving", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    # the stack's processes ran the gateway and the worker's server: the result names them
    assert {"services/gateway/app.py", "services/worker/server.py"} <= data["provenance"][
        "files"
    ].keys()
    (run,) = data["runs"]
    m = run["metrics"]
    assert data["level"] == "http" and set(RUN_FIELDS) <= m.keys()
    assert m["requests"]["completed"] == 4 and m["requests"]["exact_length"]
    assert m["requests"]["errors"] == 0
    assert m["sessions_admitted"] == 2  # both clients' streams ran at once
    assert m["ttft_s"]["n"] == 4 and m["ttft_s"]["mean"] >= m["alloc_wait_s"]["mean"] >= 0
    assert m["tpot_s"]["mean"] > 0 and m["output_tokens_per_s"] > 0
    assert m["census"]["rows"] > 0  # the worker's resolver counters, read over /metrics
    assert data["engines"][0]["durable_sessions"] is True  # the worker's default
