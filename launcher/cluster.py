"""Place the services on Ray and remember where they serve.

``specdec up`` starts a small supervisor process (:mod:`launcher.daemon`) that owns the Ray driver:
without ``--address`` it starts a local Ray instance, otherwise it joins the given cluster. There it
places the verifiers (each in a placement group of ``verifier_gpus`` GPU bundles packed on one node:
its tensor-parallel ranks; on a cluster also asking for the custom ``verifier`` resource once), the
drafters (asking for the custom ``drafter`` resource on a cluster) and the router (asking for the custom
``router`` resource on a cluster: on Kubernetes the pods its Service selects), then records their
addresses (gRPC, and the URL of each one's Prometheus metrics) in a state file and waits. ``specdec down``
signals the supervisor, which stops the services and Ray. Services bind loopback on a local instance and
their node's address on a cluster.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from launcher.actors import ServiceActor

NAMESPACE = "specdec"
# Custom Ray resources each kind of service asks for on a cluster (a KubeRay worker group offers one of them).
VERIFIER_RESOURCE = "verifier"
DRAFTER_RESOURCE = "drafter"
ROUTER_RESOURCE = "router"
DEFAULT_STATE_FILE = Path.home() / ".specdec" / "cluster.json"


@dataclass(frozen=True)
class Deployment:
    """What to place: counts, models and per-service extra arguments."""

    target: str = "smollm2-135m"
    drafter_kinds: tuple[str, ...] = ("ngram",)
    draft_model: str | None = None
    eagle_head: str | None = None  # head directory of eagle drafters (None: the one cached for the target)
    num_drafters: int = 1  # per kind
    num_verifiers: int = 1
    verifier_gpus: int = 0
    verifier_args: tuple[str, ...] = ()
    drafter_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()


@dataclass
class ClusterState:
    """What ``up`` started, persisted for ``status`` and ``down``."""

    supervisor_pid: int
    ray_address: str = ""
    status: str = "starting"  # starting, ready or failed
    error: str = ""
    router: dict[str, str] = field(default_factory=dict)
    workers: list[dict[str, str]] = field(default_factory=list)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(".tmp")
        scratch.write_text(json.dumps(asdict(self), indent=2) + "\n")
        scratch.replace(path)  # readers never see a half-written file

    @classmethod
    def load(cls, path: Path) -> ClusterState:
        if not path.exists():
            raise FileNotFoundError(f"no deployment recorded in {path}; run `specdec up` first")
        return cls(**json.loads(path.read_text()))


def verifier_argv(deployment: Deployment) -> list[str]:
    """A verifier's command line: metrics on a free port unless ``verifier_args`` say otherwise (later flags win)."""
    return ["--model", deployment.target, "--metrics-port", "0", *deployment.verifier_args]


def drafter_argv(deployment: Deployment, kind: str) -> list[str]:
    """A drafter's command line for ``kind``, metrics on a free port unless ``drafter_args`` say otherwise."""
    argv = ["--kind", kind, "--target", deployment.target, "--metrics-port", "0", *deployment.drafter_args]
    if kind == "model":
        argv += ["--draft-model", deployment.draft_model or deployment.target]
    if kind == "eagle" and deployment.eagle_head:
        argv += ["--draft-model", deployment.eagle_head]
    return argv


def router_argv(deployment: Deployment, workers: list[dict[str, str]]) -> list[str]:
    """The router's command line over ``workers`` (``{"role", "address"}``): free ports unless ``router_args``
    say otherwise."""
    argv = ["--model", deployment.target, "--grpc-port", "0", "--http-port", "0", *deployment.router_args]
    for worker in workers:
        argv += [f"--{worker['role']}", worker["address"]]
    return argv


def place(deployment: Deployment, state: ClusterState, *, in_cluster: bool, timeout_s: float = 600) -> list:
    """Start every service as a Ray actor, fill ``state`` with addresses, and return the actor handles."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote = ray.remote(ServiceActor)
    actors = []

    def spawn(role: str, argv: list[str], **options: object) -> object:
        actor = remote.options(num_cpus=0, **options).remote(role, argv, in_cluster)
        actors.append(actor)
        return actor

    verifiers = []
    for _ in range(deployment.num_verifiers):
        options: dict[str, object] = {}
        if deployment.verifier_gpus:
            bundles: list[dict[str, float]] = [{"GPU": 1} for _ in range(deployment.verifier_gpus)]
            if in_cluster:  # on a node of the verifier pool, not any node with enough GPUs
                bundles[0][VERIFIER_RESOURCE] = 1
            group = placement_group(bundles, strategy="STRICT_PACK")
            ray.get(group.ready(), timeout=timeout_s)
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
            options = {"num_gpus": 1, "scheduling_strategy": strategy}
            if in_cluster:
                options["resources"] = {VERIFIER_RESOURCE: 1}
        elif in_cluster:
            options = {"resources": {VERIFIER_RESOURCE: 1}}
        verifiers.append(spawn("verifier", verifier_argv(deployment), **options))
    drafters = []
    for kind in deployment.drafter_kinds:
        for _ in range(deployment.num_drafters):
            argv = drafter_argv(deployment, kind)
            drafters.append(spawn("drafter", argv, **({"resources": {DRAFTER_RESOURCE: 1}} if in_cluster else {})))
    addresses = ray.get([actor.addresses.remote() for actor in verifiers + drafters], timeout=timeout_s)
    roles = ["verifier"] * len(verifiers) + ["drafter"] * len(drafters)
    for role, address in zip(roles, addresses, strict=True):
        state.workers.append({"role": role, "address": address["grpc"], "metrics": address.get("metrics", "")})
    argv = router_argv(deployment, state.workers)
    router = spawn("router", argv, **({"resources": {ROUTER_RESOURCE: 1}} if in_cluster else {}))
    state.router = ray.get(router.addresses.remote(), timeout=timeout_s)
    return actors


def health(address: str, timeout_s: float = 2.0) -> str:
    """grpc.health.v1 status of ``address``: SERVING, NOT_SERVING, ... or UNREACHABLE."""
    import grpc  # here, so that `specdec generate` (which imports this package's CLI) stays gRPC-free
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def state_file() -> Path:
    return Path(os.environ.get("SPECDEC_STATE_FILE", DEFAULT_STATE_FILE))
