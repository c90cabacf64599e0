"""values.yaml is documented key by key, and the chart configures the services only through
settings they have (DHISPARSE_<SERVICE>_<FIELD> of their pydantic settings)."""

from __future__ import annotations

import re

import pytest

from services.gateway.settings import GatewaySettings
from services.kv_host_store.settings import KVHostStoreSettings
from services.worker.settings import WorkerSettings
from tests.deploy.conftest import CHART, Helm, containers, objects

KEY = re.compile(r"^(?P<indent>\s*)(?P<item>- )?(?P<key>[A-Za-z_][\w.-]*):(?:\s|$)")


def undocumented_leaves(text: str) -> list[str]:
    """Dotted paths of leaf keys with no `# --` comment on themselves or on an ancestor.

    A key is documented by a `# -- ...` comment block directly above it; everything under a
    documented key (a probe, a resources block, a list of hosts) is covered by that comment."""
    stack: list[tuple[int, str, bool]] = []  # (indent, key, documented)
    lines = text.splitlines()
    out: list[str] = []
    parents: set[str] = set()
    leaves: list[tuple[str, bool]] = []
    for i, line in enumerate(lines):
        m = KEY.match(line)
        if not m or line.lstrip().startswith("#"):
            continue
        indent = len(m["indent"]) + (2 if m["item"] else 0)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        j = i - 1
        while (
            j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --")
        ):
            j -= 1
        documented = j >= 0 and lines[j].strip().startswith("# --")
        path = ".".join([k for _, k, _ in stack] + [m["key"]])
        inherited = any(doc for _, _, doc in stack)
        if stack:
            parents.add(".".join(k for _, k, _ in stack))
        leaves.append((path, documented or inherited))
        stack.append((indent, m["key"], documented or inherited))
    for path, documented in leaves:
        if path not in parents and not documented:
            out.append(path)
    return out


def test_every_value_is_documented() -> None:
    missing = undocumented_leaves((CHART / "values.yaml").read_text())
    assert not missing, f"values.yaml keys without a '# --' comment: {missing}"


def test_the_documentation_check_finds_a_bare_key() -> None:
    text = "a:\n  # -- documented\n  b: 1\n  c: 2\n# -- whole block\nd:\n  e: 1\n"
    assert undocumented_leaves(text) == ["a.c"]


SETTINGS = {
    "GATEWAY": GatewaySettings,
    "WORKER": WorkerSettings,
    "KV_STORE": KVHostStoreSettings,
}


@pytest.mark.parametrize(
    "values",
    [
        {},
        {
            "model.servedModelName": '"m"',
            "gateway.apiKeySecret": '"k"',
            "redis.enabled": "false",
            "redis.url": '"redis://r:6379/0"',
            "model.speculation.drafter": '"/opt/dhisparse/models/glm-dsa-mini/drafters/dflash2"',
        },
    ],
)
def test_chart_sets_only_existing_settings(helm: Helm, values: dict[str, str]) -> None:
    docs = helm.template(values)
    seen = set()
    for kind in ("Deployment", "StatefulSet", "DaemonSet"):
        for w in objects(docs, kind):
            for c in containers(w):
                for e in c.get("env", []):
                    m = re.fullmatch(r"DHISPARSE_(GATEWAY|WORKER|KV_STORE)_(\w+)", e["name"])
                    if not m:
                        continue
                    service, field = m[1], m[2].lower()
                    assert field in SETTINGS[service].model_fields, (
                        f"{w['metadata']['name']}: {e['name']} is no setting"
                    )
                    seen.add(service)
    assert seen == set(SETTINGS)
