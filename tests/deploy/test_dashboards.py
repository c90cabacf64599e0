"""The Grafana dashboards, statically: generated from deploy/grafana/dashboards.py, valid JSON
with unique ids, every PromQL expression parsed (by promtool, Prometheus' own parser) and every
metric it names defined in dhisparse/metrics.py under the suffix rules."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections import Counter

import pytest
import yaml

from tests.deploy.conftest import ROOT, find_tool
from tests.deploy.dashboards import (
    SUFFIXES,
    TYPES,
    Query,
    all_panels,
    base_metric,
    instantiate,
    load_dashboards,
    metrics_py_names,
    queries,
)

GENERATOR = ROOT / "deploy" / "grafana" / "dashboards.py"
QUERIES = queries()
FEATURES = {"admission", "residency", "hierarchy", "speculation", "data-parallel"}


def _generator():
    sys.path.insert(0, str(GENERATOR.parent))
    try:
        spec = importlib.util.spec_from_file_location("dhisparse_dashboards", GENERATOR)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(GENERATOR.parent))


def test_committed_json_is_what_the_generator_writes() -> None:
    gen = _generator()
    assert gen.main(["--check"]) == 0, "run: python deploy/grafana/dashboards.py"
    assert set(gen.FEATURES) == FEATURES


def test_the_five_dashboards() -> None:
    dashboards = load_dashboards()
    assert set(dashboards) == {
        "dhisparse-overview.json",
        "dhisparse-admission.json",
        "dhisparse-kv-hierarchy.json",
        "dhisparse-speculation.json",
        "dhisparse-host-store.json",
    }
    uids = [d["uid"] for d in dashboards.values()]
    assert len(set(uids)) == len(uids)


@pytest.mark.parametrize("name", sorted(load_dashboards()))
def test_dashboard_structure(name: str) -> None:
    d = load_dashboards()[name]
    panels = list(all_panels(d))
    ids = Counter(p["id"] for p in panels)
    assert not [i for i, n in ids.items() if n > 1], f"duplicate panel ids in {name}"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    text = str(d)
    if "$model" in text:
        assert variables["model"]["query"]["query"].startswith("label_values(dhisparse:")
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        if "dhisparse_requires" in p:
            assert p["dhisparse_requires"] in FEATURES


def _balanced(expr: str) -> bool:
    pairs, stack, quoted = {")": "(", "]": "[", "}": "{"}, [], False
    for ch in expr:
        if ch == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack and not quoted


@pytest.mark.parametrize("q", QUERIES, ids=lambda q: q.id)
def test_expression_shape(q: Query) -> None:
    assert _balanced(q.expr), q.expr
    assert q.series(), f"{q.id} names no dhisparse metric"
    # Every range is Grafana's rate interval, so a dashboard follows the scrape interval.
    for window in re.findall(r"\[([^\]]+)\]", q.expr):
        assert window == "$__rate_interval", q.expr
    if "histogram_quantile" in q.expr:
        assert "sum by (le) (rate(" in q.expr and "_bucket{" in q.expr, q.expr


@pytest.mark.parametrize("q", QUERIES, ids=lambda q: q.id)
def test_metric_names_come_from_metrics_py(q: Query) -> None:
    for series in q.series():
        name = base_metric(series)
        assert name, (
            f"{q.id}: {series} is not a name in dhisparse/metrics.py with its type's suffix"
            f" (counter: _total; histogram: _bucket/_sum/_count; gauge: none)"
        )


def test_type_table_covers_metrics_py() -> None:
    assert set(TYPES) == metrics_py_names()
    assert set(SUFFIXES) == set(TYPES.values())


def test_every_metric_has_a_panel() -> None:
    used = {base_metric(s) for q in QUERIES for s in q.series()}
    assert metrics_py_names() - used == set()


def test_overview_quantiles() -> None:
    exprs = " ".join(q.expr for q in QUERIES if q.dashboard == "dhisparse-overview.json")
    for h in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        for quantile in ("0.5", "0.9", "0.99"):
            assert (
                f"histogram_quantile({quantile}, sum by (le) (rate(dhisparse:{h}_seconds_bucket"
                in exprs
            )


def test_acceptance_length_formula() -> None:
    (q,) = [q for q in QUERIES if q.panel == "Acceptance length"]
    assert q.expr.startswith("1 + sum(rate(dhisparse:spec_decode_num_accepted_tokens_total")
    assert "/ sum(rate(dhisparse:spec_decode_num_drafts_total" in q.expr


def test_promtool_parses_every_expression(tmp_path) -> None:
    promtool = find_tool("promtool")
    rules = {
        "groups": [
            {
                "name": "dhisparse-dashboards",
                "rules": [
                    {"record": f"dashboard:expr_{i}", "expr": instantiate(q.expr)}
                    for i, q in enumerate(QUERIES)
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    r = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(QUERIES)} rules found" in r.stdout
