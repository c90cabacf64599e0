"""``python -m bench load`` on the CPU: the ``--tiny`` run end to end (every field), a history
imported without prefill decodes what the same history prefilled decodes, the KV pool from
``dhisparse plan``, and eq. 13's prediction against a hand computation."""

from __future__ import annotations

import json

import pytest

from bench.cli import main as bench_main
from bench.core import UsageError
from bench.load import cli
from bench.load.engines import EngineSizing, Variant, build, check_fits, group_bytes
from bench.load.history import KEY_TOKENS, HistoryImport, captured_history, history_tokens
from bench.load.pool import plan_pool
from bench.load.speculation import compare, predicted_gain
from dhisparse.cli import main as dhisparse_main
from services.worker.hierarchy.local_store import LocalHostStore
from services.worker.request.request import SamplingParams


def _argv(tmp_path) -> list[str]:
    return [
        "load", "--tiny", "--contexts", "100", "--concurrency", "1,3", "--output-len", "4",
        "--page", "16", "--hot-cache-rows", "32", "--max-prefill-tokens", "64",
        "--prefixes", "2", "--spec", "off,fixed,online", "--spec-width", "3",
        "--acceptance", "0.9,0.8", "--out", str(tmp_path / "load.json"),
        "--plot", str(tmp_path / "load"),
    ]  # fmt: skip


def test_tiny_run_end_to_end(tmp_path) -> None:
    """``python -m bench load --tiny``: every mode at each C, the noise point twice, the spec
    group, eq. 13 and the plots; every session seated from a prepared history."""
    assert bench_main(_argv(tmp_path)) == 0
    out = json.loads((tmp_path / "load.json").read_text())
    assert out["benchmark"] == "load" and out["provenance"]
    assert (tmp_path / "load_throughput.png").stat().st_size > 0
    assert (tmp_path / "load_sessions.png").stat().st_size > 0
    names = [(r["mode"], r["spec"], r["concurrency"], r["repeat"]) for r in out["runs"]]
    modes = [(m, "off", c, 0) for c in (1, 3) for m in ("resident", "hisparse", "adaptive")]
    noise = [(m, "off", 3, 1) for m in ("resident", "hisparse", "adaptive")]
    spec = [("adaptive", s, c, 0) for c in (1, 3) for s in ("off", "fixed", "online")]
    assert names == modes + noise + spec
    for r in out["runs"]:
        m = r["metrics"]
        for field in cli.RUN_FIELDS:
            assert field in m, field
        assert m["requests"]["errors"] == 0 and m["requests"]["exact_length"]
        assert m["imported"] == m["requests"]["issued"]  # every session seated without prefill
        assert m["output_tokens_per_s"] > 0 and m["tpot_s"]["n"] > 0
        hierarchy = r["mode"] != "resident"
        assert (m["census"] is not None) == hierarchy
        assert (m["reclaim"] is not None) == (r["mode"] == "adaptive")
        if r["spec"] == "fixed":  # every round at K_max, the control's acceptance
            assert m["width_steps"] == {"3": m["decode_steps"]}
            ctl = m["acceptance_control"]
            assert m["acceptance_length"] > 1 and ctl["kind"] == "force" and ctl["rounds"] > 0
        if r["spec"] == "online":  # the width chosen each step is reported
            assert sum(m["width_steps"].values()) == m["decode_steps"]
    # the budget holds 2 resident sessions: at C3 resident holds 2, the hierarchy all 3
    at3 = {r["mode"]: r["metrics"]["sessions_admitted"] for r in out["runs"]
           if r["concurrency"] == 3 and r["spec"] == "off" and not r["repeat"]}  # fmt: skip
    assert at3 == {"resident": 2, "hisparse": 3, "adaptive": 3}
    assert [(s["spec"], s["concurrency"]) for s in out["speculation"]] == [
        (s, c) for c in (1, 3) for s in ("fixed", "online")
    ]
    assert all(s["eq13"]["predicted_gain"] > 0 for s in out["speculation"])
    assert [n["variant"] for n in out["noise"]] == [
        f"{m}@C3/in100" for m in ("resident", "hisparse", "adaptive")
    ]
    assert out["sizing"][0]["pool_bytes"] > 0 and "formula" in out["sizing"][0]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("mode", ["resident", "hisparse", "adaptive"])
def test_imported_history_decodes_as_prefilled(mode: str, kv_dtype: str) -> None:
    """A prompt's first pages captured from a resident engine that prefilled them, imported
    into a fresh engine of ``mode`` without prefill: the same greedy tokens (rows and keys
    stored as computed, or packed in fp8: the hierarchy's key pages pad them)."""
    model = cli.tiny_model(seed=3, mtp=False)
    sizing = EngineSizing(pool_bytes=4 << 20, slots=2, max_model_len=160,
                          max_prefill_tokens=128, page_size=16, hot_cache_rows=32,
                          kv_cache_dtype=kv_dtype, spec_width=2, graphs=False,
                          fused_kernels=False, host_bytes=64 << 20)  # fmt: skip
    prompt = [(7 * i + 3) % 250 for i in range(100)]
    tokens = history_tokens(len(prompt), 16)
    assert tokens == 96
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref, _ = build(model, cli.TINY, Variant("resident"), sizing)
    req = ref.add_request("ref", prompt, params)
    while req.num_computed < len(prompt):
        ref.step()
    history = captured_history(ref, req, tokens)
    while len(req.output_ids) < params.max_tokens:
        ref.step()
    expected = list(req.output_ids)
    ref.close()
    store = LocalHostStore(sizing.host_bytes)
    try:
        eng, _ = build(model, cli.TINY, Variant(mode), sizing, store)
        imp = HistoryImport(eng, {tuple(prompt[:KEY_TOKENS]): history})
        got = eng.generate([prompt], params)[0].output_ids
        assert imp.imported == 1 and imp.imported_tokens == tokens
        assert eng.stats.prefill_tokens_computed == len(prompt) - tokens
        eng.close()
    finally:
        store.close()
    assert got == expected


def test_a_group_is_sized_before_its_engines_are_built(monkeypatch) -> None:
    """Each engine's pool is the KV budget and its fixed bytes (the hierarchy's more than
    resident's), counted before any engine exists; a group that cannot fit beside the weights
    stops at once with the figures, before minutes of building and prefilling."""
    model = cli.tiny_model(seed=3, mtp=False)
    sizing = EngineSizing(pool_bytes=4 << 20, slots=2, max_model_len=160,
                          max_prefill_tokens=128, page_size=16, hot_cache_rows=32,
                          kv_cache_dtype="auto", spec_width=2, graphs=False,
                          fused_kernels=False, host_bytes=64 << 20)  # fmt: skip
    one = {m: group_bytes(model, cli.TINY, [Variant(m)], sizing) for m in ("resident", "adaptive")}
    assert sizing.pool_bytes <= one["resident"] < one["adaptive"]
    both = group_bytes(model, cli.TINY, [Variant("resident"), Variant("adaptive")], sizing)
    assert both == one["resident"] + one["adaptive"]
    eng, info = build(model, cli.TINY, Variant("adaptive"), sizing)
    assert info["pool_bytes"] == one["adaptive"]  # what the check counts is what is built
    eng.close()
    check_fits(model, cli.TINY, [Variant("adaptive")] * 64, sizing)  # a CPU model: no check
    # a model on a GPU with room for the group's pools once and a half
    param = type("P", (), {"device": type("D", (), {"type": "cuda"})()})()
    shim = type("M", (), {"parameters": lambda self: iter([param])})()
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda device: (3 * both // 2, 8 * both))
    monkeypatch.setattr("bench.load.engines.group_bytes", lambda *a: 2 * both)
    with pytest.raises(UsageError, match=r"need [0-9.]+ GiB of KV pools together"):
        check_fits(shim, cli.TINY, [Variant("resident"), Variant("adaptive")], sizing)


def test_pool_from_the_plan(capsys) -> None:
    """The budget is the plan's best layout's pool for the full model on 8 H200, times the
    layer ratio; the host share is the node's per GPU, times the same ratio."""
    assert dhisparse_main([
        "plan", "--model", "tests/fixtures/configs/deepseek-v3.2", "--context", "100000",
        "--gpu-gib", "141", "--tensor-parallel-size", "8", "--layouts", "all",
        "--kv-cache-dtype", "fp8", "--weight-dtype", "fp8", "--json",
    ]) == 0  # fmt: skip
    layouts = json.loads(capsys.readouterr().out)["layouts"]

    def hierarchy_per_node(lp: dict) -> int:
        return next(a["per_node"] for a in lp["admissions"] if a["mode"] == "hierarchy")

    best = max(layouts, key=lambda lp: (hierarchy_per_node(lp), lp["pool_bytes"]))
    p = plan_pool("v32-scaled", 100_000)
    assert p.layout == "dp-attention" and p.full_pool_bytes == best["pool_bytes"]
    assert (p.full_layers, p.scaled_layers, p.layer_ratio) == (61, 16, 16 / 61)
    assert p.pool_bytes == int(best["pool_bytes"] * 16 / 61)
    assert p.host_share_bytes == int(round(4.3e12) / 8 * 16 / 61)
    assert p.sessions_per_gpu == {"resident": 10, "hierarchy": 50}
    # with the MTP layer's weights and KV (``dhisparse plan --drafter mtp``), the same layout
    assert p.mtp_sessions_per_gpu == {"base": 47, "mtp": 46}
    with pytest.raises(ValueError):
        plan_pool("tiny-glm", 1000)


def test_eq13_prediction_by_hand() -> None:
    # 40 sessions at 30 ms per token against 50 at 20 ms: (40/50) / (30/20) = 0.8 / 1.5
    assert predicted_gain(40, 50, 0.030, 0.020) == pytest.approx(0.8 / 1.5)
    spec = {"tpot_s": {"mean": 0.010}, "mean_running": 8.0, "output_tokens_per_s": 700.0}
    base = {"tpot_s": {"mean": 0.015}, "mean_running": 8.0, "output_tokens_per_s": 500.0}
    got = compare(spec, base)
    assert got is not None
    assert got["predicted_gain"] == pytest.approx(1.5)  # same sessions, 2/3 the TPOT
    assert got["measured_gain"] == pytest.approx(1.4)
    assert got["predicted_over_measured"] == pytest.approx(1.5 / 1.4)
    assert got["predicted_gain_plan"] is None
    # the plan's 46 sessions with the MTP layer against 47 without, at a load of 64: (46/47)/(2/3)
    planned = compare(spec, base, {"base": 47, "mtp": 46}, load=64)
    assert planned is not None and planned["predicted_gain_plan"] == pytest.approx(46 / 47 * 1.5)
    # at a load both hold, the share is 1
    assert compare(spec, base, {"base": 47, "mtp": 46}, load=8)["predicted_gain_plan"] == (
        pytest.approx(1.5)
    )
    assert compare({**spec, "tpot_s": None}, base) is None
    with pytest.raises(ValueError):
        predicted_gain(0, 1, 1, 1)
