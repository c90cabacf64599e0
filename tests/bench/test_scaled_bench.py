"""``python -m bench scaled`` on the CPU at tiny scale: its argument checks, and one context's
lockstep run of the three modes over an FP8-held real-family model (``tiny-glm``), which is what
the GPU run does at real dimensions, and over ``v4flash-scaled`` shrunk; and speculating with a
scaled preset's MTP layer (shrunk) under the acceptance control."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench import scaled
from bench.core import UsageError
from dhisparse.family.presets import preset
from services.worker.engine.passes import graphs_off
from services.worker.graphs.cuda_graph import GraphConfig
from services.worker.model.weight_format import WeightFormat
from services.worker.weights.model_io import build_model
from tests.worker.scaled_shrunk import shrunk, shrunk_v4


def _args(**over) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    scaled.add_arguments(ap)
    return ap.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in over.items()])


def test_arguments_are_checked() -> None:
    assert scaled.parse(_args()) == (
        ["v32-scaled", "glm5-scaled"],
        [8192, 32768],
        [1, 4],
        ["resident", "hisparse", "adaptive"],
    )
    assert scaled.parse(_args(modes="hisparse,hisparse:inline"))[3] == [
        "hisparse",
        "hisparse:inline",
    ]
    for bad in ({"family": "v4"}, {"modes": "paged"}, {"modes": "resident:inline"},
                {"contexts": "8k"}, {"concurrency": "0"}):  # fmt: skip
        with pytest.raises(UsageError):
            scaled.parse(_args(**bad))


def test_one_context_in_lockstep_on_the_cpu() -> None:
    model = build_model(preset("tiny-glm"), weights=WeightFormat(fp8=True))
    assert "float8_e4m3fn" in scaled.weight_bytes(model)
    args = _args(decode_tokens=4, hot_cache_rows=32, page=16, host_gib=0.05,
                 max_prefill_tokens=32)  # fmt: skip
    for r in _three_modes("tiny-glm", model, args):
        assert r["steady_steps"] > 0 and r["steady_tokens_per_s"] > 0


def _three_modes(name: str, model, args: argparse.Namespace) -> list[dict]:
    """``run_context`` of the three modes at C = 1 and 2 on the CPU, its rows checked: each
    admitted its sessions and decoded, eagerly (no GPU)."""
    modes = ["resident", "hisparse", "adaptive"]
    rows = scaled.run_context(name, {False: model}, 80, [1, 2], modes,
                              scaled.spec_variants(args), args)  # fmt: skip
    assert [(r["mode"], r["concurrency"]) for r in rows] == [(m, c) for c in (1, 2) for m in modes]
    for r in rows:
        assert r["decode_tokens_per_s"] > 0 and r["sessions_admitted"] == r["concurrency"]
        assert r["graphs"] == {"replays": 0, "captures": 0, "eager": 0}
        assert "not a GPU" in r["graphs_off_reason"]
    return rows


def test_v4_in_lockstep_on_the_cpu() -> None:
    """``--family v4flash-scaled`` (shrunk): the three modes' engines over V4's model, in
    lockstep, each admitting its sessions; on a GPU its passes would be captured as the other
    families' are (no reason to turn graphs off); replayed selections and FP8 KV are refused
    before the build, FP8 and FP4 weights are not."""
    args = _args(family="v4flash-scaled", weights="bf16", decode_tokens=4, hot_cache_rows=8,
                 page=16, host_gib=0.05, max_prefill_tokens=32, warmup_runs=1)  # fmt: skip
    assert scaled.parse(args)[0] == ["v4flash-scaled"]
    assert scaled.v4_refused(args, "cpu") == []
    assert scaled.v4_refused(args, "cuda") == []
    assert scaled.v4_refused(_args(weights="fp4"), "cuda") == []
    assert scaled.v4_refused(_args(selections="replay", kv_cache_dtype="fp8"), "cpu") == [
        "--selections replay",
        "--kv-cache-dtype fp8",
    ]
    model = build_model(shrunk_v4("v4flash-scaled"), seed=2)
    reason = graphs_off(GraphConfig(), model, torch.device("cuda"), False, False)
    assert reason is None
    _three_modes("v4flash-scaled-shrunk", model, args)


def test_fp8_kv_in_lockstep_on_the_cpu() -> None:
    """``--kv-cache-dtype fp8``: FP8 weights and packed FP8 KV rows, every mode admits its
    sessions in a pool sized from the packed bytes."""
    model = build_model(preset("tiny-glm"), weights=WeightFormat(fp8=True))
    args = _args(decode_tokens=4, hot_cache_rows=32, page=16, host_gib=0.05,
                 max_prefill_tokens=32, kv_cache_dtype="fp8")  # fmt: skip
    rows = scaled.run_context("tiny-glm", {False: model}, 80, [2], ["resident", "hisparse:inline"],
                              scaled.spec_variants(args), args)  # fmt: skip
    assert [r["mode"] for r in rows] == ["resident", "hisparse:inline"]
    for r in rows:
        assert r["decode_tokens_per_s"] > 0 and r["sessions_admitted"] == 2


def test_speculation_arguments_are_checked() -> None:
    assert scaled.acceptance_rates(_args()) is None  # no drafter
    assert scaled.acceptance_rates(_args(drafter="mtp", acceptance="model")) is None
    shipped = scaled.acceptance_rates(_args(drafter="mtp", spec_width=8))
    assert shipped is not None and len(shipped) == 7
    assert scaled.acceptance_rates(_args(drafter="mtp", acceptance="0.9,0.5,0.5")) == (
        0.9, 0.5, 0.5,
    )  # fmt: skip
    for bad in ("0.9,0.5", "0.9,x,0.5", "0.9,1.5,0.5"):
        with pytest.raises(UsageError):
            scaled.acceptance_rates(_args(drafter="mtp", acceptance=bad))
    args = _args(spec="off,fixed:4,online:8")
    assert scaled.spec_variants(args) == [
        scaled.SpecVariant("off", None, 1, "fixed"),
        scaled.SpecVariant("fixed:4", "mtp", 4, "fixed"),
        scaled.SpecVariant("online:8", "mtp", 8, "online"),
    ]
    assert (args.drafter, args.spec_width) == ("mtp", 8)  # the control covers K = 8
    assert scaled.spec_variants(_args(spec="fixed:4,fixed:4+block"))[1] == scaled.SpecVariant(
        "fixed:4+block", "mtp", 4, "fixed", mtp_block=True
    )
    hot = scaled.spec_variants(_args(spec="fixed:4,fixed:4+vocab32768,fixed:4+block+vocab8"))
    assert hot[1] == scaled.SpecVariant("fixed:4+vocab32768", "mtp", 4, "fixed", draft_vocab=32768)
    assert hot[2] == scaled.SpecVariant(
        "fixed:4+block+vocab8", "mtp", 4, "fixed", mtp_block=True, draft_vocab=8
    )
    for bad in ("off,off", "fixed", "fixed:1", "greedy:4", "paper:x", "fixed:4+", "fixed:4+x",
                "fixed:4+vocab", "fixed:4+vocab0", "fixed:4+vocabx", "fixed:4+block+block",
                "fixed:4+vocab8+vocab16"):  # fmt: skip
        with pytest.raises(UsageError):
            scaled.spec_variants(_args(spec=bad))


def test_full_and_hot_heads_side_by_side_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--spec fixed:4,fixed:4+vocab64``: the MTP layer with its whole head beside one whose
    draft steps score a hot head of the ids 0..63, one engine each on one model, in lockstep,
    both under the acceptance control."""
    engines = []

    def engine(*a, **kw):
        engines.append(real(*a, **kw))
        return engines[-1]

    real = scaled._engine
    monkeypatch.setattr(scaled, "_engine", engine)
    d = shrunk("v32-scaled", num_hidden_layers=2)
    model = build_model(d, seed=2, mtp=True)
    args = _args(decode_tokens=16, hot_cache_rows=32, page=16, host_gib=0.05,
                 max_prefill_tokens=64, spec="fixed:4,fixed:4+vocab64",
                 acceptance="0.95,0.9,0.9")  # fmt: skip
    rows = scaled.run_context(d.name, {True: model}, 48, [2], ["hisparse"],
                              scaled.spec_variants(args), args)  # fmt: skip
    assert [r["mode"] for r in rows] == ["hisparse/fixed:4", "hisparse/fixed:4+vocab64"]
    full, hot = (e.passes.hot_head for e in engines)
    assert full is None and hot is not None and hot.ids.tolist() == list(range(64))
    for r in rows:
        assert r["acceptance_control"]["rounds"] > 0 and r["acceptance_length"] > 1.5
        assert r["decode_tokens_per_s"] > 0 and r["round_split"]["rounds"] > 0


@pytest.mark.parametrize("how", ["force", "reference"])
def test_one_context_speculating_under_the_acceptance_control_on_the_cpu(how: str) -> None:
    """``--drafter mtp``: a scaled preset (shrunk) built with its MTP layer, every mode's engine
    speculating under the acceptance control (``--control``): the verifier measures about the
    configured acceptance; with a reference, no round left it."""
    d = shrunk("v32-scaled", num_hidden_layers=2)
    model = build_model(d, seed=2, mtp=True)
    args = _args(decode_tokens=24, hot_cache_rows=32, page=16, host_gib=0.05,
                 max_prefill_tokens=64, drafter="mtp", spec_width=4,
                 acceptance="0.95,0.9,0.9", control=how)  # fmt: skip
    rows = scaled.run_context(d.name, {True: model}, 48, [2], ["resident", "hisparse"],
                              scaled.spec_variants(args), args)  # fmt: skip
    assert [r["mode"] for r in rows] == ["resident", "hisparse"]
    for r in rows:
        ctl = r["acceptance_control"]
        assert ctl["kind"] == how and ctl["rates"] == [0.95, 0.9, 0.9] and ctl["misses"] == 0
        assert ctl["rounds"] > 0 and ctl["planned"] > 1.5 * ctl["rounds"]
        assert r["acceptance_length"] > 2.5 and r["width_in_use"] == 4
        assert r["decode_tokens_per_s"] > 0


def test_plain_and_speculating_engines_side_by_side_on_the_cpu() -> None:
    """``--spec off,fixed:4,online:4``: plain decoding on a model without the MTP layer beside
    the MTP layer under two width policies, one engine each, in lockstep; the speculating rows
    carry their policy's estimates."""
    d = shrunk("v32-scaled", num_hidden_layers=2)
    models = {True: build_model(d, seed=2, mtp=True), False: build_model(d, seed=2)}
    args = _args(decode_tokens=24, hot_cache_rows=32, page=16, host_gib=0.05,
                 max_prefill_tokens=64, spec="off,fixed:4,online:4",
                 acceptance="0.95,0.9,0.9")  # fmt: skip
    variants = scaled.spec_variants(args)
    rows = scaled.run_context(d.name, models, 48, [2], ["adaptive"], variants, args)
    names = ["adaptive/off", "adaptive/fixed:4", "adaptive/online:4"]
    assert [r["mode"] for r in rows] == names
    assert "acceptance_length" not in rows[0] and rows[0]["decode_tokens_per_s"] > 0
    for r in rows[1:]:
        assert r["acceptance_control"]["rounds"] > 0
        assert r["widths"]["policy"] == r["mode"].split("/")[1].split(":")[0]
    assert rows[1]["acceptance_length"] > 1.5
    # the online policy drafts at the acceptance asked for, or has judged (from the rounds it
    # timed, on a busy CPU too) that plain decoding pays and drafts nothing in the window
    online = rows[2]
    assert online["acceptance_length"] > 1.5 or online["width_in_use"] == 0
    split = rows[1]["round_split"]  # every round of the fixed width is timed, drafts apart
    assert split["rounds"] > 0 and 0 < split["draft_ms"] < split["round_ms"]
    assert split["verify_and_host_ms"] == pytest.approx(split["round_ms"] - split["draft_ms"])
    assert set(rows[2]["widths"]["tokens_per_round"]) == {0, 4}


def test_replayed_selections_in_lockstep_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--selections replay``: every engine, plain and speculating, gets the shipped model's
    recorded selections mapped onto the family before its first pass (captured graphs hold
    them); rows name the trace and its mapping."""
    installed = []

    def install(eng, replay) -> None:
        installed.append(
            (eng.stats.decode_steps + eng.stats.prefill_tokens_computed, replay.context)
        )
        real_install(eng, replay)

    real_install = scaled.install
    monkeypatch.setattr(scaled, "install", install)
    d = shrunk("v32-scaled", num_hidden_layers=2)
    models = {True: build_model(d, seed=2, mtp=True), False: build_model(d, seed=2)}
    args = _args(decode_tokens=12, hot_cache_rows=32, page=16, host_gib=0.05,
                 max_prefill_tokens=64, spec="off,fixed:3", acceptance="0.9,0.8",
                 selections="replay")  # fmt: skip
    rows = scaled.run_context(d.name, models, 96, [2], ["resident", "adaptive"],
                              scaled.spec_variants(args), args)  # fmt: skip
    assert [r["mode"] for r in rows] == [
        "resident/off",
        "resident/fixed:3",
        "adaptive/off",
        "adaptive/fixed:3",
    ]
    assert installed == [(0, 96)] * 4
    for r in rows:
        sel = r["selections"]
        assert sel["trace_context"] > 0 and sel["expansion"] >= 1 and sel["spread"] > 0
        assert r["decode_tokens_per_s"] > 0
    assert scaled.parse(_args(selections="replay"))[0] == ["v32-scaled", "glm5-scaled"]
    with pytest.raises(SystemExit):
        _args(selections="recorded")
