"""Grafana dashboard JSON from a small model (Dashboard > Row > Panel > Target), for
``dashboards.py``. Panels are laid out left to right in rows of 24 grid units."""

from __future__ import annotations

from dataclasses import dataclass, field

RI = "[$__rate_interval]"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: list[Target]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    width: int = 12
    height: int = 8
    stack: bool = False
    requires: str | None = None  # a FEATURES key: the metrics do not exist yet


@dataclass(frozen=True)
class Row:
    title: str
    panels: list[Panel]


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: list[Row]
    model_var: bool = True
    instance_var: str | None = None  # a metric to list instances from
    tags: list[str] = field(default_factory=list)


def quantiles(metric: str, sel: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[Target]:
    """p50/p90/p99 and the mean of one histogram."""
    out = [
        Target(
            f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{sel}}}{RI})))",
            f"p{round(q * 100)}",
        )
        for q in qs
    ]
    out.append(
        Target(
            f"sum(rate({metric}_sum{{{sel}}}{RI})) / sum(rate({metric}_count{{{sel}}}{RI}))",
            "mean",
        )
    )
    return out


DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _panel_json(p: Panel, pid: int, x: int, y: int, features: dict[str, str]) -> dict:
    description = p.description
    if p.requires:
        description += f" Needs {features[p.requires]}: no service exports these metrics yet."
    targets = [
        {
            "datasource": DATASOURCE,
            "expr": t.expr,
            "legendFormat": t.legend or "__auto",
            "range": True,
            "refId": chr(ord("A") + i),
        }
        for i, t in enumerate(p.targets)
    ]
    out: dict = {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "targets": targets,
    }
    if p.kind == "stat":
        out["fieldConfig"] = {"defaults": {"unit": p.unit, "decimals": 2}, "overrides": []}
        out["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        }
    else:
        custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
        if p.stack:
            custom["stacking"] = {"mode": "normal", "group": "A"}
        out["fieldConfig"] = {"defaults": {"unit": p.unit, "custom": custom}, "overrides": []}
        out["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    if p.requires:
        out["dhisparse_requires"] = p.requires
    return out


def _templating(d: Dashboard) -> dict:
    variables: list[dict] = [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
        }
    ]

    def query_var(name: str, label: str, query: str) -> dict:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DATASOURCE,
            "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "definition": query,
            "includeAll": True,
            "allValue": ".*",
            "multi": True,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "refresh": 2,
            "sort": 1,
            "hide": 0,
        }

    if d.model_var:
        variables.append(
            query_var("model", "Model", "label_values(dhisparse:num_requests_running, model)")
        )
    if d.instance_var:
        variables.append(
            query_var("instance", "Instance", f"label_values({d.instance_var}, instance)")
        )
    return {"list": variables}


def render(d: Dashboard, features: dict[str, str]) -> dict:
    """The dashboard's JSON model; ``features`` explains the ``requires`` keys."""
    panels: list[dict] = []
    pid, y = 1, 0
    for row in d.rows:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y = pid + 1, y + 1
        x, row_h = 0, 0
        for p in row.panels:
            if x + p.width > 24:
                x, y, row_h = 0, y + row_h, 0
            panels.append(_panel_json(p, pid, x, y, features))
            pid, x, row_h = pid + 1, x + p.width, max(row_h, p.height)
        y += row_h
    return {
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": ["dhisparse", *d.tags],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "links": [
            {
                "type": "dashboards",
                "tags": ["dhisparse"],
                "asDropdown": True,
                "title": "dhisparse",
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "annotations": {"list": []},
        "templating": _templating(d),
        "panels": panels,
    }
