"""The Helm chart: `helm lint --strict` and `helm template` over a matrix of values, every rendered
object validated against the Kubernetes 1.32 schemas (kubernetes-validate, offline), and the
properties the deployment depends on asserted on the rendered objects."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest

from tests.deploy.conftest import (
    CHART,
    DASHBOARD_DIR,
    NAMESPACE,
    Helm,
    containers,
    objects,
    one,
    pod_spec,
)

K8S_VERSION = "1.32.0"

CASES: dict[str, dict[str, str]] = {
    "defaults": {},
    "redis-external-url": {"redis.enabled": "false", "redis.url": '"redis://redis.example:6379/0"'},
    "redis-external-secret": {"redis.enabled": "false", "redis.urlSecret": '"redis-creds"'},
    "redis-none-single-gateway": {"redis.enabled": "false"},
    "edge-ingress-hpa-pdb": {
        "gateway.ingress.enabled": "true",
        "gateway.ingress.className": '"nginx"',
        "gateway.ingress.tls": '[{"secretName": "dhs-tls", "hosts": ["dhisparse.example.com"]}]',
        "gateway.autoscaling.enabled": "true",
        "gateway.pdb.enabled": "true",
        "worker.pdb.enabled": "true",
    },
    "service-monitor": {
        "serviceMonitor.enabled": "true",
        "serviceMonitor.additionalLabels": '{"release": "kube-prometheus-stack"}',
    },
    "eight-workers": {"worker.replicas": "8"},
    "two-gpus-per-pod-mig": {
        "worker.replicas": "2",
        "worker.gpusPerPod": "2",
        "worker.gpuResource": '"nvidia.com/mig-3g.71gb"',
    },
    "cpu-workers": {
        "worker.device": '"cpu"',
        "worker.gpusPerPod": "0",
        "worker.runtimeClassName": '""',
        "worker.tolerations": "[]",
    },
    "tensor-parallel-8": {
        "worker.parallel.tensorParallelSize": "8",
        "worker.parallel.expertParallel": "true",
    },
    "network-policy-off": {"networkPolicy.enabled": "false"},
    "network-policy-narrow": {
        "networkPolicy.metricsFrom": "[]",
        "networkPolicy.gatewayFrom": '[{"namespaceSelector": {"matchLabels":'
        ' {"kubernetes.io/metadata.name": "ingress-nginx"}}}]',
    },
    "no-host-store": {"kvHostStore.enabled": "false"},
    "model-volume-gpu-nodes": {
        "model.volume": '{"persistentVolumeClaim": {"claimName": "glm-5-weights"}}',
        "model.source": '"glm-5"',
        "model.servedModelName": '"glm-5"',
        "worker.nodeSelector": '{"nvidia.com/gpu.product": "NVIDIA-H200"}',
        "gateway.apiKeySecret": '"dhs-api-key"',
        "gateway.settings": '{"max_n": 4, "log_level": "debug"}',
        "worker.settings": '{"page_size": 64}',
    },
}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def env_value(container: dict, name: str) -> str:
    return env_of(container)[name]["value"]


@pytest.mark.parametrize("case", CASES)
def test_lint_strict(helm: Helm, case: str) -> None:
    r = helm.run("lint", "--strict", str(CHART), *Helm.set_args(CASES[case]))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("case", CASES)
def test_rendered_objects_validate(helm: Helm, case: str) -> None:
    docs = helm.template(CASES[case])
    assert docs
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            # A custom resource (ServiceMonitor): no bundled schema; checked below.
            assert doc["apiVersion"] == "monitoring.coreos.com/v1", name
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{case}: {name} is invalid: {e}")


@pytest.mark.parametrize("case", CASES)
def test_every_container_has_probes_and_runs_unprivileged(helm: Helm, case: str) -> None:
    for kind in WORKLOADS:
        for w in objects(helm.template(CASES[case]), kind):
            spec = pod_spec(w)
            assert spec["securityContext"]["runAsNonRoot"] is True, w["metadata"]["name"]
            for c in spec["containers"]:
                where = f"{w['metadata']['name']}/{c['name']}"
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert c.get(probe), f"{where} has no {probe}"
                assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
                assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], where
                assert c.get("resources", {}).get("requests"), f"{where} requests nothing"


def test_workers_request_gpus_with_runtime_class(helm: Helm) -> None:
    sts = one(helm.template(), "StatefulSet", "worker")
    spec = pod_spec(sts)
    assert spec["runtimeClassName"] == "nvidia"
    (worker,) = spec["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert env_value(worker, "DHISPARSE_WORKER_DEVICE") == "cuda"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]

    sts = one(helm.template(CASES["two-gpus-per-pod-mig"]), "StatefulSet", "worker")
    assert sts["spec"]["replicas"] == 2
    (worker,) = pod_spec(sts)["containers"]
    assert worker["resources"]["limits"]["nvidia.com/mig-3g.71gb"] == 2
    assert "nvidia.com/gpu" not in worker["resources"]["limits"]

    sts = one(helm.template(CASES["cpu-workers"]), "StatefulSet", "worker")
    spec = pod_spec(sts)
    assert "runtimeClassName" not in spec
    (worker,) = spec["containers"]
    assert not any("/" in r for r in worker["resources"].get("limits", {}))


def test_a_worker_of_eight_ranks_asks_for_eight_gpus_and_their_shared_memory(helm: Helm) -> None:
    sts = one(helm.template(CASES["tensor-parallel-8"]), "StatefulSet", "worker")
    spec = pod_spec(sts)
    (worker,) = spec["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert env_value(worker, "DHISPARSE_WORKER_TENSOR_PARALLEL_SIZE") == "8"
    assert env_value(worker, "DHISPARSE_WORKER_EXPERT_PARALLEL") == "true"
    assert env_value(worker, "DHISPARSE_WORKER_DATA_PARALLEL_ATTENTION") == "false"
    assert env_value(worker, "NCCL_NVLS_ENABLE") == "0"
    (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["sizeLimit"] == "16384Mi"
    # one rank: neither the group's variables nor its shared memory
    (worker,) = pod_spec(one(helm.template(), "StatefulSet", "worker"))["containers"]
    assert "DHISPARSE_WORKER_TENSOR_PARALLEL_SIZE" not in env_of(worker)


def test_worker_probes_target_grpc_and_metrics_ports(helm: Helm) -> None:
    (worker,) = containers(one(helm.template(), "StatefulSet", "worker"))
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9101}
    assert worker["startupProbe"]["tcpSocket"]["port"] == "grpc"
    assert worker["readinessProbe"]["tcpSocket"]["port"] == "grpc"
    assert worker["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}


def test_arena_host_path_is_shared_by_store_and_workers(helm: Helm) -> None:
    docs = helm.template(CASES["model-volume-gpu-nodes"])
    ds = one(docs, "DaemonSet", "kv-host-store")
    sts = one(docs, "StatefulSet", "worker")

    def arena(workload: dict) -> tuple[str, str]:
        (vol,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == "arena"]
        (c,) = pod_spec(workload)["containers"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "arena"]
        return vol["hostPath"]["path"], mount["mountPath"]

    assert arena(ds) == arena(sts) == ("/dev/shm/dhisparse", "/dhisparse/arena")
    (store,) = pod_spec(ds)["containers"]
    assert env_value(store, "DHISPARSE_KV_STORE_ARENA_PATH") == "/dhisparse/arena/arena"
    assert env_value(store, "DHISPARSE_KV_STORE_CAPACITY") == "16GiB"
    # The arena's tmpfs pages are charged to the store: its memory covers them.
    assert store["resources"]["requests"]["memory"] == "17Gi"
    assert store["resources"]["limits"]["memory"] == "17Gi"

    # Workers dial the node-local Service of the store ...
    (worker,) = pod_spec(sts)["containers"]
    svc_name, port = env_value(worker, "DHISPARSE_WORKER_KV_STORE").split(":")
    (svc,) = [s for s in objects(docs, "Service") if s["metadata"]["name"] == svc_name]
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert svc["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"]
    assert int(port) == next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    # ... and only run on a node whose store pod runs.
    (term,) = pod_spec(sts)["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == ds["spec"]["selector"]["matchLabels"]
    # The store runs on the workers' nodes.
    assert pod_spec(ds)["nodeSelector"] == pod_spec(sts)["nodeSelector"]
    assert pod_spec(ds)["tolerations"] == pod_spec(sts)["tolerations"]
    # The root init container only hands the directory to the services' user.
    (init,) = pod_spec(ds)["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}


def test_no_store_means_no_arena(helm: Helm) -> None:
    docs = helm.template(CASES["no-host-store"])
    assert not objects(docs, "DaemonSet")
    sts = one(docs, "StatefulSet", "worker")
    assert all(v["name"] != "arena" for v in pod_spec(sts)["volumes"])
    (worker,) = pod_spec(sts)["containers"]
    assert "DHISPARSE_WORKER_KV_STORE" not in env_of(worker)
    assert "affinity" not in pod_spec(sts)


@pytest.mark.parametrize("replicas", [1, 3, 8])
def test_gateway_lists_every_worker(helm: Helm, replicas: int) -> None:
    docs = helm.template({"worker.replicas": str(replicas)})
    sts = one(docs, "StatefulSet", "worker")
    (gw,) = containers(one(docs, "Deployment", "gateway"))
    workers = env_value(gw, "DHISPARSE_GATEWAY_WORKERS").split(",")
    name, svc = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert workers == [
        f"{name}-{i}.{svc}.{NAMESPACE}.svc.cluster.local:50051" for i in range(replicas)
    ]
    (headless,) = [s for s in objects(docs, "Service") if s["metadata"]["name"] == svc]
    assert headless["spec"]["clusterIP"] == "None"


def test_gateways_read_the_workers_model_directory(helm: Helm) -> None:
    """The gateway renders chats with the model's tokenizer and template: it mounts the model
    volume (read-only, where the workers mount it) and is given the same directory."""
    docs = helm.template(CASES["model-volume-gpu-nodes"])
    gateway, workers = one(docs, "Deployment", "gateway"), one(docs, "StatefulSet", "worker")

    def model(workload: dict, variable: str) -> tuple[str, dict, dict]:
        (c,) = pod_spec(workload)["containers"]
        (vol,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == "model"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "model"]
        return env_value(c, variable), vol, mount

    gw_dir, gw_vol, gw_mount = model(gateway, "DHISPARSE_GATEWAY_MODEL")
    assert (gw_dir, gw_vol, gw_mount) == model(workers, "DHISPARSE_WORKER_MODEL")
    assert gw_dir == "/models/glm-5"
    assert gw_vol["persistentVolumeClaim"] == {"claimName": "glm-5-weights"}
    assert gw_mount == {"name": "model", "mountPath": "/models", "readOnly": True}
    # Without a volume nothing is mounted: the source is a path in the worker image.
    gw = pod_spec(one(helm.template(), "Deployment", "gateway"))
    assert all(v["name"] != "model" for v in gw["volumes"])


def test_redis_url_follows_the_redis_values(helm: Helm) -> None:
    def redis_env(case: str) -> dict | None:
        (gw,) = containers(one(helm.template(CASES[case]), "Deployment", "gateway"))
        return env_of(gw).get("DHISPARSE_GATEWAY_REDIS_URL")

    docs = helm.template()
    redis_svc = one(docs, "Service", "redis")
    assert redis_env("defaults")["value"] == f"redis://{redis_svc['metadata']['name']}:6379/0"
    assert redis_env("redis-external-url")["value"] == "redis://redis.example:6379/0"
    assert redis_env("redis-external-secret")["valueFrom"]["secretKeyRef"] == {
        "name": "redis-creds",
        "key": "redis-url",
    }
    assert redis_env("redis-none-single-gateway") is None
    for case in ("redis-external-url", "redis-external-secret", "redis-none-single-gateway"):
        assert not [
            d
            for d in objects(helm.template(CASES[case]), "Deployment")
            if "redis" in d["metadata"]["name"]
        ]


def _policy_for(docs: list[dict], component: str) -> dict:
    found = [
        p
        for p in objects(docs, "NetworkPolicy")
        if p["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == component
    ]
    assert len(found) == 1, f"expected one NetworkPolicy selecting {component}"
    return found[0]


def _rules_for_port(policy: dict, port: str) -> list[dict]:
    return [r for r in policy["spec"]["ingress"] if any(p["port"] == port for p in r["ports"])]


def _peer_components(rule: dict) -> set[str]:
    """The release components a rule admits; fails on any peer that is not one of them."""
    assert rule.get("from"), "a rule without `from` admits everyone"
    out = set()
    for peer in rule["from"]:
        assert set(peer) == {"podSelector"}, f"peer outside the release: {peer}"
        labels = peer["podSelector"]["matchLabels"]
        assert labels["app.kubernetes.io/instance"] == "dhs"
        out.add(labels["app.kubernetes.io/component"])
    return out


def test_network_policy_keeps_grpc_and_redis_internal(helm: Helm) -> None:
    docs = helm.template()
    # Every pod of the release is selected by a policy (so unlisted ports are closed).
    for kind in WORKLOADS:
        for w in objects(docs, kind):
            _policy_for(docs, w["metadata"]["labels"]["app.kubernetes.io/component"])
    for p in objects(docs, "NetworkPolicy"):
        assert p["spec"]["policyTypes"] == ["Ingress"]

    worker, store, redis = (_policy_for(docs, c) for c in ("worker", "kv-host-store", "redis"))
    (rule,) = _rules_for_port(worker, "grpc")
    assert _peer_components(rule) == {"gateway"}
    (rule,) = _rules_for_port(store, "grpc")
    assert _peer_components(rule) == {"worker"}
    (rule,) = _rules_for_port(redis, "redis")
    assert _peer_components(rule) == {"gateway", "worker"}
    # Metrics ports admit the configured peers (default: pods of any namespace), not the world.
    for policy in (worker, store):
        (rule,) = _rules_for_port(policy, "metrics")
        assert rule["from"] == [{"namespaceSelector": {}}]
        ports = {p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]}
        assert ports == {"grpc", "metrics"}
    # The gateway's HTTP port is the one door open to everyone.
    gateway = _policy_for(docs, "gateway")
    (rule,) = gateway["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == ["http"]
    assert "from" not in rule

    # Narrowed: no metrics peers closes the metrics ports; the gateway admits only the listed.
    docs = helm.template(CASES["network-policy-narrow"])
    for component in ("worker", "kv-host-store"):
        assert not _rules_for_port(_policy_for(docs, component), "metrics")
    (rule,) = _policy_for(docs, "gateway")["spec"]["ingress"]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    ]

    assert not objects(helm.template(CASES["network-policy-off"]), "NetworkPolicy")


def test_service_monitors_only_when_enabled(helm: Helm) -> None:
    assert not objects(helm.template(), "ServiceMonitor")
    docs = helm.template(CASES["service-monitor"])
    monitors = objects(docs, "ServiceMonitor")
    by_component = {m["metadata"]["labels"]["app.kubernetes.io/component"]: m for m in monitors}
    assert set(by_component) == {"gateway", "worker", "kv-host-store"}
    for component, m in by_component.items():
        assert m["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        # Text format: the OpenMetrics output of prometheus_client mangles `dhisparse:` names.
        assert m["spec"]["scrapeProtocols"] == ["PrometheusText0.0.4"]
        svc = one(docs, "Service", component)
        # The selector picks the component's Service, and the endpoint names one of its ports.
        assert m["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        (ep,) = m["spec"]["endpoints"]
        assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]}
        assert ep["path"] == "/metrics"
        assert {"targetLabel": "component", "replacement": component, "action": "replace"} in ep[
            "relabelings"
        ]


def test_dashboards_config_map_carries_every_dashboard(helm: Helm) -> None:
    (cm,) = [
        c
        for c in objects(helm.template(), "ConfigMap")
        if c["metadata"]["name"].endswith("-dashboards")
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {p.name: p for p in DASHBOARD_DIR.glob("*.json")}
    assert len(files) == 5
    assert set(cm["data"]) == set(files)
    for name, path in files.items():
        assert json.loads(cm["data"][name]) == json.loads(path.read_text())
    assert not [c for c in objects(helm.template({"dashboards.enabled": "false"}), "ConfigMap")]


def test_edge_objects_when_enabled(helm: Helm) -> None:
    docs = helm.template(CASES["edge-ingress-hpa-pdb"])
    (hpa,) = objects(docs, "HorizontalPodAutoscaler")
    gw = one(docs, "Deployment", "gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == gw["metadata"]["name"]
    assert "replicas" not in gw["spec"]  # the HPA owns it
    assert {
        p["metadata"]["labels"]["app.kubernetes.io/component"]
        for p in objects(docs, "PodDisruptionBudget")
    } == {"gateway", "worker"}
    (ing,) = objects(docs, "Ingress")
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {
        "name": one(docs, "Service", "gateway")["metadata"]["name"],
        "port": {"name": "http"},
    }
    for kind in ("HorizontalPodAutoscaler", "PodDisruptionBudget", "Ingress"):
        assert not objects(helm.template(), kind)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"worker.replicas": '"two"'}, "worker.replicas"),
        ({"gateway.replicas": "-1"}, "gateway.replicas"),
        ({"kvHostStore.arena.capacityGiB": "0"}, "capacityGiB"),
        ({"worker.device": '"tpu"'}, "worker.device"),
        ({"gateway.bogus": "1"}, "bogus"),
        ({"redis.url": '"http://not-redis"'}, "redis.url"),
    ],
)
def test_schema_rejects_bad_values(helm: Helm, values: dict[str, str], message: str) -> None:
    r = helm.run("template", "x", str(CHART), *Helm.set_args(values))
    assert r.returncode != 0
    assert "schema" in r.stderr and message in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"redis.enabled": "false", "gateway.replicas": "2"}, "shared admission ledger"),
        ({"redis.url": '"redis://r:6379"'}, "redis.enabled=false"),
        ({"worker.gpusPerPod": "0"}, "gpusPerPod"),
    ],
)
def test_inconsistent_values_fail_with_a_message(
    helm: Helm, values: dict[str, str], message: str
) -> None:
    r = helm.run("template", "x", str(CHART), *Helm.set_args(values))
    assert r.returncode != 0 and message in r.stderr, r.stderr
