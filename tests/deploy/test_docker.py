"""The Dockerfiles, checked without a Docker engine: hadolint, and a parse of each file for what
the chart and the services rely on (non-root numeric USER, HEALTHCHECK, `dhisparse <command>`
entrypoint, ports and bind addresses that match the services' settings)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from fnmatch import fnmatch

import pytest

from dhisparse.cli import COMMANDS
from services.gateway.settings import GatewaySettings
from services.kv_host_store.settings import KVHostStoreSettings
from services.worker.settings import WorkerSettings
from tests.deploy.conftest import ROOT, find_tool

DOCKER = ROOT / "docker"


@dataclass(frozen=True)
class Image:
    command: str  # the `dhisparse` subcommand, also the Dockerfile's and health check's name
    env_prefix: str
    ports: tuple[int, ...]


IMAGES = {
    "gateway": Image("gateway", "DHISPARSE_GATEWAY_", (GatewaySettings().port,)),
    "worker": Image(
        "worker", "DHISPARSE_WORKER_", (WorkerSettings().port, WorkerSettings().metrics_port)
    ),
    "kv-host-store": Image(
        "kv-host-store",
        "DHISPARSE_KV_STORE_",
        (KVHostStoreSettings().port, KVHostStoreSettings().metrics_port),
    ),
}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        op, _, args = line.partition(" ")
        out.append((op.upper(), args.strip()))
    assert not pending, "a continuation line runs off the end of the file"
    return out


def final_stage(name: str) -> list[tuple[str, str]]:
    ins = instructions((DOCKER / f"{name}.Dockerfile").read_text())
    last_from = max(i for i, (op, _) in enumerate(ins) if op == "FROM")
    return ins[last_from:]


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for op, args in stage:
        if op == "ENV":
            for item in args.split():
                k, _, v = item.partition("=")
                env[k] = v
    return env


def one_arg(stage: list[tuple[str, str]], op: str) -> str:
    found = [args for o, args in stage if o == op]
    assert len(found) == 1, f"expected one {op} in the final stage, found {len(found)}"
    return found[0]


def test_every_dockerfile_is_known() -> None:
    assert {p.name.removesuffix(".Dockerfile") for p in DOCKER.glob("*.Dockerfile")} == set(IMAGES)


def test_hadolint() -> None:
    hadolint = find_tool("hadolint")
    files = sorted(str(p) for p in DOCKER.glob("*.Dockerfile"))
    r = subprocess.run(
        [hadolint, "--no-color", "--config", str(DOCKER / "hadolint.yaml"), *files],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", IMAGES)
def test_runs_as_a_numeric_non_root_user(name: str) -> None:
    user = one_arg(final_stage(name), "USER")
    uid, _, gid = user.partition(":")
    # Numeric, so that Kubernetes' runAsNonRoot can verify it; the chart runs as 10001.
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0, user
    assert int(uid) == 10001 and int(gid) == 10001


@pytest.mark.parametrize("name", IMAGES)
def test_entrypoint_is_the_dhisparse_command(name: str) -> None:
    entrypoint = json.loads(one_arg(final_stage(name), "ENTRYPOINT"))
    assert entrypoint == ["dhisparse", IMAGES[name].command]
    assert IMAGES[name].command in COMMANDS


@pytest.mark.parametrize("name", IMAGES)
def test_healthcheck_runs_the_service_check(name: str) -> None:
    hc = one_arg(final_stage(name), "HEALTHCHECK")
    assert "--interval=" in hc and "--timeout=" in hc and "--start-period=" in hc
    cmd = json.loads(hc[hc.index("CMD") + 3 :].strip())
    assert cmd == ["python", "/opt/dhisparse/healthcheck.py", IMAGES[name].command]
    copies = [args.split() for op, args in final_stage(name) if op == "COPY"]
    assert ["docker/healthcheck.py", "/opt/dhisparse/healthcheck.py"] in copies


@pytest.mark.parametrize("name", IMAGES)
def test_ports_and_bind_address_match_the_settings(name: str) -> None:
    stage = final_stage(name)
    image = IMAGES[name]
    exposed = tuple(int(p) for p in one_arg(stage, "EXPOSE").split())
    assert exposed == image.ports
    env = env_of(stage)
    # Inside a container the service must listen beyond loopback.
    assert env[image.env_prefix + "HOST"] == "0.0.0.0"
    assert env["PATH"].startswith("/opt/venv/bin:")
    # No `*_created` series: nothing reads them, and they double the series count.
    assert env["PROMETHEUS_DISABLE_CREATED_SERIES"] == "True"
    ports = {k: int(v) for k, v in env.items() if k.startswith(image.env_prefix) and "PORT" in k}
    assert sorted(ports.values()) == sorted(image.ports), ports


def test_worker_image_can_compile_triton_launchers() -> None:
    stage = final_stage("worker")
    run = " ".join(args for op, args in stage if op == "RUN")
    # Triton builds a C launcher per kernel at run time.
    for pkg in ("gcc", "python3.12-dev", "libc6-dev"):
        assert pkg in run.split(), pkg
    assert env_of(stage)["TRITON_CACHE_DIR"].startswith("/var/cache/dhisparse/")


def test_copied_sources_pass_the_dockerignore() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def sent(path: str) -> bool:
        keep = True
        for pat in patterns:
            negate = pat.startswith("!")
            pat = pat.lstrip("!").rstrip("/")
            if fnmatch(path, pat) or path.startswith(pat + "/"):
                keep = negate
        return keep

    for name in IMAGES:
        for op, args in instructions((DOCKER / f"{name}.Dockerfile").read_text()):
            if op != "COPY" or args.startswith("--from"):
                continue
            *sources, _dest = args.split()
            for src in sources:
                assert (ROOT / src).exists(), f"{name}: COPY {src}: no such path"
                assert sent(src), f"{name}: COPY {src} is excluded by .dockerignore"
    assert not sent("tests/conftest.py") and not sent(".venv/bin/python")


@pytest.mark.parametrize("package", ["services.gateway", "services.kv_host_store"])
def test_slim_images_need_no_torch(package: str) -> None:
    """The gateway and store images leave torch, triton and xgrammar out: importing every module
    of the service (as the image's `dhisparse` does) must not pull them in."""
    code = f"""
import importlib, pkgutil, sys
import dhisparse.cli, {package} as pkg
for m in pkgutil.iter_modules(pkg.__path__):
    importlib.import_module(pkg.__name__ + "." + m.name)
bad = sorted({{"torch", "triton", "xgrammar"}} & set(sys.modules))
assert not bad, bad
"""
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr


def test_make_images_builds_every_dockerfile() -> None:
    r = subprocess.run(
        ["make", "-n", "images"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    for name in IMAGES:
        assert "docker/$i.Dockerfile" in r.stdout and name in r.stdout
