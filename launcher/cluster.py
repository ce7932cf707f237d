"""Place the services on Ray and remember where they serve.

``specdec up`` starts a small supervisor process (:mod:`launcher.daemon`) that owns the Ray driver:
without ``--address`` it starts a local Ray instance, otherwise it joins the given cluster. There it
places the verifiers (each in a placement group of ``verifier_gpus`` GPU bundles packed on one node:
its tensor-parallel ranks), the drafters (asking for the custom ``drafter`` resource on a cluster)
and the router, then records their addresses (gRPC, and the URL of each one's Prometheus metrics) in
a state file and waits. ``specdec down`` signals the supervisor, which stops the services and Ray.
Services bind loopback unless told otherwise. With ``tls_dir`` (``specdec up --tls-dir DIR``, layout in
:class:`TlsDir`) every service gets ``--tls-cert`` / ``--tls-key`` / ``--tls-ca``: all gRPC traffic is mutual TLS and
the router's HTTP port serves HTTPS; metrics ports of the workers stay plain HTTP.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.actors import ServiceActor

if TYPE_CHECKING:
    from grpc_common.tls import TlsConfig

NAMESPACE = "specdec"
DEFAULT_STATE_FILE = Path.home() / ".specdec" / "cluster.json"


@dataclass(frozen=True)
class TlsDir:
    """The PEM files ``specdec up --tls-dir DIR`` reads, all in ``DIR``:

    - ``ca.pem``: the CA bundle every certificate below chains to; each service admits only peers with one of its
      certificates;
    - ``server.pem`` / ``server-key.pem``: the certificate (chain) and key every service presents, as a server and
      as the router dialling workers, so it needs no extended key usage or both server and client auth; its names
      must cover the addresses services bind (127.0.0.1 on one machine, node IPs on a cluster) unless the router is
      told the one name to check (``--router-arg=--tls-server-name=NAME``);
    - ``client.pem`` / ``client-key.pem``: a client certificate for ``specdec status`` (and for SDK users to copy):
      the router's public ports ask for one too, unless ``--router-arg=--no-tls-public-client-auth``.

    On a cluster ``DIR`` must hold the same files at the same path on every node.
    """

    path: Path

    CA = "ca.pem"
    CERT = "server.pem"
    KEY = "server-key.pem"
    CLIENT_CERT = "client.pem"
    CLIENT_KEY = "client-key.pem"

    def check(self) -> None:
        """Raise FileNotFoundError naming every file of the layout that is missing."""
        names = (self.CA, self.CERT, self.KEY, self.CLIENT_CERT, self.CLIENT_KEY)
        missing = [name for name in names if not (self.path / name).is_file()]
        if missing:
            raise FileNotFoundError(f"--tls-dir {self.path}: missing {', '.join(missing)}")

    def service_arguments(self) -> list[str]:
        """The TLS flags of every service."""
        flags = {"--tls-cert": self.CERT, "--tls-key": self.KEY, "--tls-ca": self.CA}
        return [item for flag, name in flags.items() for item in (flag, str(self.path / name))]

    def client(self) -> TlsConfig:
        """What ``specdec status`` dials the services with."""
        from grpc_common.tls import TlsConfig  # lazily: `specdec generate` imports this package without gRPC

        return TlsConfig(
            cert=str(self.path / self.CLIENT_CERT), key=str(self.path / self.CLIENT_KEY), ca=str(self.path / self.CA)
        )


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
    tls_dir: str | None = None  # absolute; see TlsDir


@dataclass
class ClusterState:
    """What ``up`` started, persisted for ``status`` and ``down``."""

    supervisor_pid: int
    ray_address: str = ""
    status: str = "starting"  # starting, ready or failed
    error: str = ""
    router: dict[str, str] = field(default_factory=dict)
    workers: list[dict[str, str]] = field(default_factory=list)
    tls_dir: str = ""  # the deployment's TlsDir ("": plaintext), so that `status` can dial it

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


def place(deployment: Deployment, state: ClusterState, *, in_cluster: bool, timeout_s: float = 600) -> list:
    """Start every service as a Ray actor, fill ``state`` with addresses, and return the actor handles."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote = ray.remote(ServiceActor)
    actors = []
    # before the per-role extra arguments, so that those still win
    tls = TlsDir(Path(deployment.tls_dir)).service_arguments() if deployment.tls_dir else []
    state.tls_dir = deployment.tls_dir or ""

    def spawn(role: str, argv: list[str], **options: object) -> object:
        actor = remote.options(num_cpus=0, **options).remote(role, argv)
        actors.append(actor)
        return actor

    verifiers = []
    for _ in range(deployment.num_verifiers):
        options: dict[str, object] = {}
        if deployment.verifier_gpus:
            group = placement_group([{"GPU": 1}] * deployment.verifier_gpus, strategy="STRICT_PACK")
            ray.get(group.ready(), timeout=timeout_s)
            options = {"num_gpus": 1, "scheduling_strategy": PlacementGroupSchedulingStrategy(group)}
        argv = ["--model", deployment.target, "--metrics-port", "0", *tls, *deployment.verifier_args]
        verifiers.append(spawn("verifier", argv, **options))
    drafters = []
    for kind in deployment.drafter_kinds:
        for _ in range(deployment.num_drafters):
            argv = ["--kind", kind, "--target", deployment.target, "--metrics-port", "0", *tls]
            argv += deployment.drafter_args
            if kind == "model":
                argv += ["--draft-model", deployment.draft_model or deployment.target]
            if kind == "eagle" and deployment.eagle_head:
                argv += ["--draft-model", deployment.eagle_head]
            drafters.append(spawn("drafter", argv, **({"resources": {"drafter": 1}} if in_cluster else {})))
    addresses = ray.get([actor.addresses.remote() for actor in verifiers + drafters], timeout=timeout_s)
    roles = ["verifier"] * len(verifiers) + ["drafter"] * len(drafters)
    # Free ports unless the deployment's router arguments say otherwise (later flags win).
    router_argv = ["--model", deployment.target, "--grpc-port", "0", "--http-port", "0", *tls, *deployment.router_args]
    for role, address in zip(roles, addresses, strict=True):
        router_argv += [f"--{role}", address["grpc"]]
        state.workers.append({"role": role, "address": address["grpc"], "metrics": address.get("metrics", "")})
    router = spawn("router", router_argv)
    state.router = ray.get(router.addresses.remote(), timeout=timeout_s)
    return actors


def health(address: str, tls_dir: str = "", timeout_s: float = 2.0) -> str:
    """grpc.health.v1 status of ``address`` (over mutual TLS with ``tls_dir``'s client certificate when given):
    SERVING, NOT_SERVING, ... or UNREACHABLE."""
    # here, so that `specdec generate` (which imports this package's CLI) stays gRPC-free
    from grpc_common.probe import check_health
    from grpc_common.tls import PLAINTEXT

    return check_health(address, TlsDir(Path(tls_dir)).client() if tls_dir else PLAINTEXT, timeout_s)


def state_file() -> Path:
    return Path(os.environ.get("SPECDEC_STATE_FILE", DEFAULT_STATE_FILE))
