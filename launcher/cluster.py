"""What to place, the services' command lines, and where they serve.

``specdec up`` starts a small supervisor process (:mod:`launcher.daemon`) that owns the Ray driver:
without ``--address`` it starts a local Ray instance, otherwise it joins the given cluster. There its
:class:`launcher.supervise.Supervisor` places the verifiers (each in a placement group of one bundle of
``verifier_gpus`` GPUs on one node, held by an actor whose child processes are its tensor-parallel ranks;
on a cluster also asking for the custom ``verifier`` resource), the drafters (asking for the custom
``drafter`` resource on a cluster) and ``num_routers`` routers (asking for the custom ``router`` resource on a
cluster: on Kubernetes the pods its Service selects, one router per pod), records their addresses (gRPC, and the
URL of each one's Prometheus metrics) in a state file, and keeps them placed and scaled until ``specdec down``
signals it; then it stops the services and Ray. Services bind loopback on a local instance and their node's address
on a cluster.

Router replicas share every worker: each router opens its own sequences (ids random per request, so two routers
never name the same one) and leases them on its own, so a verifier or drafter serves any number of routers. On one
machine each router binds its own free ports and clients spread themselves over the addresses the state file lists
(:func:`specdec.client.router_target` makes one round-robin gRPC target of them); fixed ports are for a cluster,
where every router has a pod, and its node's address, of its own.

With ``tls_dir`` (``specdec up --tls-dir DIR``, layout in :class:`TlsDir`) every service gets ``--tls-cert`` /
``--tls-key`` / ``--tls-ca``: all gRPC traffic is mutual TLS and the router's HTTP port serves HTTPS; metrics ports
of the workers stay plain HTTP.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpc_common.tls import TlsConfig

NAMESPACE = "specdec"
# Custom Ray resources each kind of service asks for on a cluster (a KubeRay worker group offers one of them).
VERIFIER_RESOURCE = "verifier"
DRAFTER_RESOURCE = "drafter"
ROUTER_RESOURCE = "router"
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
    num_routers: int = 1  # router processes sharing all the workers (see the module docstring)
    verifier_gpus: int = 0
    verifier_args: tuple[str, ...] = ()
    drafter_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    tls_dir: str | None = None  # absolute; see TlsDir
    # Autoscaling (launcher.autoscale): the counts above are the floor; a maximum above them lets the supervisor
    # add workers for the router's queue (verifiers) and the drafters' busy time (drafters, per kind).
    max_verifiers: int = 0  # 0: num_verifiers (no autoscaling)
    max_drafters: int = 0  # per kind; 0: num_drafters
    requests_per_verifier: float = 32.0  # running + waiting requests one verifier should carry
    drafter_utilisation: float = 0.7  # busy fraction a drafter should run at
    scale_down_delay_s: float = 300.0  # a smaller count must be wanted this long before a worker is retired
    reconcile_interval_s: float = 10.0  # how often the supervisor checks, re-places, scales and tells the router
    start_timeout_s: float = 600.0  # longest wait for the first placement (model loads, pods joining)


@dataclass
class ClusterState:
    """What ``up`` started, persisted for ``status`` and ``down``."""

    supervisor_pid: int
    ray_address: str = ""
    status: str = "starting"  # starting, ready or failed
    error: str = ""
    routers: list[dict[str, str]] = field(default_factory=list)  # each serving router's addresses
    workers: list[dict[str, str]] = field(default_factory=list)
    tls_dir: str = ""  # the deployment's TlsDir ("": plaintext), so that `status` can dial it

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(".tmp")
        scratch.write_text(json.dumps(asdict(self), indent=2) + "\n")
        scratch.replace(path)  # readers never see a half-written file

    def addresses(self) -> dict[str, list[dict[str, str]]]:
        """What ``specdec up`` prints once ready: ``{"routers": [...], "workers": [...]}``."""
        return {"routers": self.routers, "workers": self.workers}

    @classmethod
    def load(cls, path: Path) -> ClusterState:
        if not path.exists():
            raise FileNotFoundError(f"no deployment recorded in {path}; run `specdec up` first")
        return cls(**json.loads(path.read_text()))


def tls_argv(deployment: Deployment) -> list[str]:
    """Every service's TLS flags (none without ``tls_dir``), put before the per-role arguments so those still win."""
    return TlsDir(Path(deployment.tls_dir)).service_arguments() if deployment.tls_dir else []


def verifier_argv(deployment: Deployment) -> list[str]:
    """A verifier's command line: metrics on a free port unless ``verifier_args`` say otherwise (later flags win)."""
    return ["--model", deployment.target, "--metrics-port", "0", *tls_argv(deployment), *deployment.verifier_args]


def drafter_argv(deployment: Deployment, kind: str) -> list[str]:
    """A drafter's command line for ``kind``, metrics on a free port unless ``drafter_args`` say otherwise."""
    argv = ["--kind", kind, "--target", deployment.target, "--metrics-port", "0", *tls_argv(deployment)]
    argv += deployment.drafter_args
    if kind == "model":
        argv += ["--draft-model", deployment.draft_model or deployment.target]
    if kind == "eagle" and deployment.eagle_head:
        argv += ["--draft-model", deployment.eagle_head]
    return argv


def router_argv(deployment: Deployment, workers: list[dict[str, str]]) -> list[str]:
    """The router's command line over ``workers`` (``{"role", "address"}``): free ports unless ``router_args``
    say otherwise."""
    argv = ["--model", deployment.target, "--grpc-port", "0", "--http-port", "0", *tls_argv(deployment)]
    argv += deployment.router_args
    for worker in workers:
        argv += [f"--{worker['role']}", worker["address"]]
    return argv


def check_router_ports(deployment: Deployment, *, in_cluster: bool) -> None:
    """Raise ValueError for a deployment whose routers cannot all serve: fewer than one, or several on one machine
    with a port fixed by ``router_args`` (they would all bind it: aiohttp refuses the second HTTP bind, while gRPC,
    which sets SO_REUSEPORT, would share its port silently)."""
    if deployment.num_routers < 1:
        raise ValueError(f"num_routers must be >= 1, got {deployment.num_routers}")
    if in_cluster or deployment.num_routers == 1:
        return
    parser = argparse.ArgumentParser(add_help=False)
    for flag in ("--grpc-port", "--http-port"):
        parser.add_argument(flag, type=int, default=0)
    ports, _ = parser.parse_known_args(list(deployment.router_args))
    fixed = [f"--{name.replace('_', '-')}={port}" for name, port in vars(ports).items() if port]
    if fixed:
        raise ValueError(
            f"{deployment.num_routers} routers on one machine cannot share {', '.join(fixed)}: leave the router ports"
            " free (each router gets its own; `specdec status` lists them) or run one router"
        )


def health(address: str, tls_dir: str = "", timeout_s: float = 2.0) -> str:
    """grpc.health.v1 status of ``address`` (over mutual TLS with ``tls_dir``'s client certificate when given):
    SERVING, NOT_SERVING, ... or UNREACHABLE."""
    # here, so that `specdec generate` (which imports this package's CLI) stays gRPC-free
    from grpc_common.probe import check_health
    from grpc_common.tls import PLAINTEXT

    return check_health(address, TlsDir(Path(tls_dir)).client() if tls_dir else PLAINTEXT, timeout_s)


def state_file() -> Path:
    return Path(os.environ.get("SPECDEC_STATE_FILE", DEFAULT_STATE_FILE))
