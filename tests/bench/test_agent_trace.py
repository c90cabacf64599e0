"""``bench agent-trace``'s parts that need no stack: a trace's conversations (one system prompt
shared by every session, fresh per repeat) and the summary's arithmetic (throughput ratio of the
repeats' means, the noise as the largest relative spread of one variant's repeats, acceptance
with ÷ without pooled over enough rounds, equal texts)."""

from __future__ import annotations

import argparse

import pytest

from bench.agent_trace import WITH, WITHOUT, Trace, _summary
from bench.cpu_stream import MODEL
from bench.prefix_turns import add_stack_arguments, stack_config


def _args(**kw) -> argparse.Namespace:
    base = dict(sessions=3, turns=3, system=40, first=8, question=5)
    return argparse.Namespace(**(base | kw))


def test_a_trace_shares_its_system_prompt_and_each_repeat_draws_a_fresh_one() -> None:
    a = Trace.draw(MODEL, _args(), seed=1)
    assert len(a.system) == 40 and len(a.firsts) == 3 and all(len(f) == 8 for f in a.firsts)
    assert [len(q) for q in a.questions] == [2, 2, 2]
    assert all(len(m) == 5 for q in a.questions for m in q)
    assert len({tuple(f) for f in a.firsts}) == 3  # each session its own first message
    assert Trace.draw(MODEL, _args(), seed=1) == a  # seeded
    b = Trace.draw(MODEL, _args(), seed=11)
    assert b.system != a.system  # nothing a repeat left is a hit for the next
    one = Trace.draw(MODEL, _args(turns=1), seed=1)
    assert one.questions == [[], [], []]


def _run(tput: float, acceptance: float | None, texts: list[str], drafts: int = 100) -> dict:
    return {"output_tok_per_s": tput, "computed_share": 0.1, "later_ttft_p50_s": 0.5,
            "tpot_p50_s": 0.05, "acceptance_length": acceptance, "texts": texts,
            "drafts": drafts if acceptance is not None else 0}  # fmt: skip


def test_the_summary_compares_the_means_of_the_repeats() -> None:
    runs = {
        WITH: [_run(30.0, 2.5, ["a", "b"]), _run(34.0, 2.7, ["c", "d"])],
        WITHOUT: [_run(10.0, 2.6, ["a", "x"]), _run(6.0, 2.6, ["c", "d"])],
    }
    s = _summary(runs)
    assert s["throughput_with_over_without"] == pytest.approx(32.0 / 8.0)
    assert s["per_repeat"] == pytest.approx([3.0, 34.0 / 6.0])
    assert s["noise"] == pytest.approx(4.0 / 8.0)  # WITHOUT's spread: 4 around a mean of 8
    assert s["acceptance_with_over_without"] == pytest.approx(2.6 / 2.6)
    assert s["verify_rounds"] == {WITH: 200, WITHOUT: 200}
    assert s["same_text"] == pytest.approx(3 / 4)
    # pooled over rounds: 300 rounds at 2.5 and 100 at 2.7 give 2.55
    runs[WITH][0]["drafts"] = 300
    assert _summary(runs)["acceptance_with_over_without"] == pytest.approx(2.55 / 2.6)
    runs[WITH][0]["drafts"] = runs[WITH][1]["drafts"] = 40  # too few rounds to compare
    assert _summary(runs)["acceptance_with_over_without"] is None
    runs[WITH][0]["acceptance_length"] = None  # no drafter ran
    runs[WITH][0]["drafts"] = 0
    assert _summary(runs)["acceptance_with_over_without"] is None
    one = {v: rs[:1] for v, rs in runs.items()}
    assert _summary(one)["noise"] is None  # one repeat: no spread to state


def test_the_stack_takes_make_runs_width_policy_unless_told() -> None:
    """The stacks are ``make run``'s (its drafter under the online policy); ``--width-policy
    fixed`` verifies every step at the width, so acceptance is measured over every round."""
    ap = argparse.ArgumentParser()
    add_stack_arguments(ap)
    assert stack_config(ap.parse_args([])).speculation.width_policy == "online"
    fixed = stack_config(ap.parse_args(["--width-policy", "fixed"]))
    assert fixed.speculation.width_policy == "fixed" and fixed.speculation.drafter
    plain = stack_config(ap.parse_args(["--drafter", "none", "--width-policy", "fixed"]))
    assert not plain.speculation.on
