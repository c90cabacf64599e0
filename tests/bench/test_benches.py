"""``python -m bench capacity``, ``spec`` and ``graph-keys`` on the CPU, as processes, at toy
sizes: every side runs in lockstep and each gets its rows, rates and the summary the docs
quote, and every result names the code it measured."""

from __future__ import annotations

import json
import subprocess

from tests.bench.helpers import ROOT, bench


def _run(name: str, *args: str) -> subprocess.CompletedProcess:
    return bench(name, "--device", "cpu", *args)


def _measured(doc: dict) -> dict[str, str]:
    """The result's per-file hashes, checked against the files as they are."""
    from bench.core.provenance import measured_hash

    prov = doc["provenance"]
    assert prov["source"] == "git" and len(prov["commit"]) == 40
    assert prov["command"].startswith("python -m bench ")
    for path, h in prov["files"].items():
        assert measured_hash(ROOT / path) == h, path
    return prov["files"]


def test_capacity_runs_every_mode_at_every_concurrency(tmp_path) -> None:
    out = tmp_path / "cap.json"
    proc = _run(
        "capacity", "--context", "256", "--layers", "2", "--k", "16", "--hot-cache-rows",
        "32", "--concurrency", "1,3", "--resident-sessions", "1", "--probe-sessions", "4",
        "--decode-tokens", "3", "--host-gib", "0.05", "--page", "16", "--out", str(out),
        "--trace",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    by = {m["mode"]: m for m in data["modes"]}
    assert set(by) == {"resident", "hisparse", "adaptive"}
    for mode in by.values():
        rows = {r["concurrency"]: r for r in mode["rows"]}
        assert set(rows) == {1, 3}
        for r in rows.values():
            assert r["decode_tokens_per_s"] > 0 and r["wall_s"] > 0
            assert 0 <= r["alloc_wait_mean_s"] <= r["alloc_wait_max_s"] <= r["wall_s"]
            # --trace: one row per step of this mode; decode ms and kinds add up to the split
            trace = r["trace"]
            assert len(trace) == sum(r["steps_by_kind"].values())
            for kind, n in r["steps_by_kind"].items():
                assert sum(t[2] == kind for t in trace) == n
            assert abs(sum(t[1] for t in trace) / 1e3 - sum(r["decode_s_by_step"].values())) < 0.01
            assert max(t[0] for t in trace) == r["sessions_admitted"]
            assert r["gc_pause_s"] >= 0  # rounded to 0.1 ms; the trace's per step to 1 us
            assert abs(sum(t[4] for t in trace) - 1e3 * r["gc_pause_s"]) < 0.1
    assert by["resident"]["rows"][1]["sessions_admitted"] == 1  # the budget holds one
    cap = data["summary"]["capacity_sessions"]
    assert cap["hisparse"] > cap["resident"] and cap["adaptive"] > cap["resident"]
    assert set(data["summary"]["adaptive_vs_hisparse"]) == {"1", "3"}
    files = _measured(data)
    assert {"bench/capacity/sweep.py", "bench/core/lockstep.py",
            "services/worker/engine/engine.py"} <= files.keys()  # fmt: skip
    assert "bench/cli.py" not in files  # the dispatcher measures nothing


def test_spec_runs_every_configuration_and_rejects_an_empty_window(tmp_path) -> None:
    out = tmp_path / "spec.json"
    common = ["--model", "tiny-indexshare", "--drafter-dir", "bench/drafters/tiny-indexshare",
              "--concurrency", "2", "--widths", "", "--decode-tokens", "8", "--prompt-len",
              "48", "--pool-mib", "64", "--host-mib", "64", "--drafters", "dflash,dspark,dflash2",
              "--out", str(out)]  # fmt: skip
    bad = _run("spec", *common, "--requests-per-client", "1")
    assert bad.returncode == 2 and "at least 2" in bad.stderr
    proc = _run("spec", *common, "--requests-per-client", "2", "--warmup-per-client", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    configs = {r["config"] for r in data["results"]}
    assert configs == {"none"} | {f"{d}/{p}" for d in ("dflash", "dspark", "dflash2")
                                  for p in ("paper", "online")}  # fmt: skip
    assert len(data["results"]) == len(configs)
    for r in data["results"]:
        assert r["decode_tokens_per_s"] > 0 and r["acceptance_length"] >= 1.0
        if r["config"].endswith("/paper"):  # every measured round timed, drafting apart
            split = r["round_split"]
            assert split["rounds"] > 0 and 0 < split["draft_ms"] < split["round_ms"]
    assert set(data["summary"]) == {f"{d}@C2" for d in ("dflash", "dspark", "dflash2")}
    # the drafters it loaded, weights included (opened outside Python's open)
    files = _measured(data)
    for d in ("dflash", "dspark", "dflash2"):
        assert {f"bench/drafters/tiny-indexshare/{d}/drafter.json",
                f"bench/drafters/tiny-indexshare/{d}/drafter.safetensors"} <= files.keys()  # fmt: skip


def test_graph_keys_counts_every_pass_of_the_measured_window(tmp_path) -> None:
    out = tmp_path / "keys.json"
    proc = _run(
        "graph-keys", "--model", "tiny-indexshare", "--drafter-dir", "bench/drafters/tiny-indexshare",
        "--concurrency", "3", "--decode-tokens", "12", "--prompt-len", "48", "--pool-mib", "64",
        "--host-mib", "64", "--requests-per-client", "2", "--configs", "none,dflash/paper",
        "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert "bench/graph_keys.py" in _measured(doc)
    rows = {r["config"]: r for r in doc["rows"]}
    for name, row in rows.items():
        passes = sum(row[f"pass_graph_{w}"] for w in ("replay", "capture", "eager"))
        drafts = sum(row[f"draft_graph_{w}"] for w in ("replay", "capture", "eager"))
        assert passes > 0, name
        # a verify round drafts once; without a drafter nothing is drafted
        assert drafts == (0 if name == "none" else passes), name


def test_profile_step_records_the_top_operators_and_rows_of_replayed_steps(tmp_path) -> None:
    """``profile-step --selections replay`` as a result: per run the step's time, its top
    operators by host time (no device on the CPU) and the rows each step resolved by where
    from (none in resident mode), over the shipped model's recorded selections; naming the
    code it measured."""
    out = tmp_path / "profile.json"
    proc = _run(
        "profile-step", "--modes", "resident,hisparse", "--concurrency", "2", "--context", "160",
        "--steps", "2", "--graphs", "off", "--pool-gib", "0.1", "--host-gib", "0.25", "--rows", "5",
        "--selections", "replay", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert "bench/profile_step.py" in _measured(doc)
    assert doc["selections"] == "replay"
    assert [(r["mode"], r["concurrency"]) for r in doc["runs"]] == [
        ("resident", 2),
        ("hisparse", 2),
    ]
    for r in doc["runs"]:
        assert r["ms_per_step"] > 0 and r["what"] == "decode eager" and r["top_device"] == []
        top = r["top_host"]
        assert len(top) == 5 and all(op["us"] > 0 and op["calls"] > 0 for op in top)
        assert [op["us"] for op in top] == sorted((op["us"] for op in top), reverse=True)
    resident, hisparse = doc["runs"]
    assert resident["rows_per_step"] == {}
    rows = hisparse["rows_per_step"]
    assert set(rows) == {"direct", "hot", "host"} and sum(rows.values()) > 0
