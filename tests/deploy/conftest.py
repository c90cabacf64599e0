"""Shared helpers for the deployment tests: the repo-local tools (scripts/test-tools, the first
step of `make test`, installs helm and hadolint into .tools/bin, and prometheus and promtool from
apt) and chart rendering."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "dhisparse"
DASHBOARD_DIR = CHART / "dashboards"
TOOLS_BIN = ROOT / ".tools" / "bin"
NAMESPACE = "serving"
RELEASE = "dhs"


def find_tool(name: str) -> str:
    """The tool's path, or a test failure (never a skip: CI must run these tests) that says how
    to install it."""
    local = TOOLS_BIN / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found:
        return found
    pytest.fail(
        f"{name} not found on PATH or in {TOOLS_BIN}: run scripts/test-tools (make test runs it)",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("helm-home")
    env = dict(os.environ)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(home / var.lower())
    return env


class Helm:
    """Runs helm on the chart with --set style overrides; results are cached per value set."""

    def __init__(self, binary: str, env: dict[str, str]) -> None:
        self.binary = binary
        self.env = env
        self._cache: dict[tuple[str, ...], list[dict]] = {}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.binary, *args], env=self.env, capture_output=True, text=True, timeout=120
        )

    @staticmethod
    def set_args(values: dict[str, str]) -> list[str]:
        out: list[str] = []
        for k, v in values.items():
            out += ["--set-json", f"{k}={v}"]
        return out

    def template(self, values: dict[str, str] | None = None) -> list[dict]:
        """Rendered objects. ``values`` maps a dotted key to a JSON value, e.g.
        ``{"worker.replicas": "4", "redis.url": '"redis://r:6379"'}``."""
        key = tuple(sorted((values or {}).items()))
        if key not in self._cache:
            r = self.run(
                "template",
                RELEASE,
                str(CHART),
                "--namespace",
                NAMESPACE,
                *self.set_args(values or {}),
            )
            assert r.returncode == 0, f"helm template failed:\n{r.stderr}"
            self._cache[key] = [d for d in yaml.safe_load_all(r.stdout) if d]
        return self._cache[key]


@pytest.fixture(scope="session")
def helm(helm_env: dict[str, str]) -> Helm:
    return Helm(find_tool("helm"), helm_env)


def objects(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, component: str) -> dict:
    found = [
        d
        for d in objects(docs, kind)
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
    ]
    assert len(found) == 1, f"expected one {kind} of {component}, found {len(found)}"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict) -> Iterator[dict]:
    yield from pod_spec(workload)["containers"]
