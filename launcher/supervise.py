"""The supervisor's placement loop: place every service, keep it placed, scale it, keep the routers told.

:class:`Supervisor` places the verifiers and drafters, then ``num_routers`` routers over their addresses (as
:mod:`launcher.cluster` describes); every router is given every worker. Every ``reconcile_interval_s``
:meth:`Supervisor.reconcile`:

1. finds workers whose actor died (its pod or node went away: Ray reports the actor dead) and places a
   replacement with the same command line, which comes back at a new address (on a cluster: a new pod's IP);
2. when a group may grow (``max_verifiers`` / ``max_drafters`` above the deployment's counts), reads the
   routers' queues (summed over the routers whose metrics answer) and the drafters' busy time and adds or retires
   workers (:mod:`launcher.autoscale`); a retired worker leaves every router's set first, then drains;
3. re-places a router that died (over the current workers), and tells each router its worker set whenever it
   changed (:meth:`router.server.RunningRouter.set_workers`);
4. records the addresses in the state file.

Only the Ray calls touch a cluster; the decisions are plain code over what they return.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from launcher.actors import ServiceActor
from launcher.autoscale import Bounds, Hysteresis, Load, wanted
from launcher.cluster import (
    DRAFTER_RESOURCE,
    ROUTER_RESOURCE,
    VERIFIER_RESOURCE,
    ClusterState,
    Deployment,
    check_router_ports,
    drafter_argv,
    router_argv,
    verifier_argv,
)

LOG = logging.getLogger(__name__)
PROBE_S = 5.0  # how long a liveness call on an actor may take before it counts as "busy", not dead
STOP_S = 30.0  # the longest wait for one actor's graceful stop


@dataclass
class Placed:
    """One service actor: its role (and drafter kind), its address once it serves."""

    role: str
    kind: str | None
    actor: Any
    pending: Any = None  # ObjectRef of addresses() until it serves
    address: dict[str, str] = field(default_factory=dict)
    group: Any = None  # a verifier's placement group
    told: tuple[tuple[str, ...], tuple[str, ...]] | None = None  # a router's worker set as last told to it

    @property
    def serving(self) -> bool:
        return bool(self.address)


class Supervisor:
    """Owns the service actors of one deployment (see the module docstring)."""

    def __init__(
        self,
        deployment: Deployment,
        state: ClusterState,
        *,
        in_cluster: bool,
        save: Callable[[], None] = lambda: None,
        timeout_s: float = 600,
    ) -> None:
        import ray

        check_router_ports(deployment, in_cluster=in_cluster)
        self.ray = ray
        self.deployment = deployment
        self.state = state
        self.in_cluster = in_cluster
        self.save = save
        self.timeout_s = timeout_s
        self.remote = ray.remote(ServiceActor)
        self.workers: list[Placed] = []
        self.routers: list[Placed] = []
        d = deployment
        self.verifier_bounds = Bounds(d.num_verifiers, max(d.max_verifiers, d.num_verifiers))
        self.drafter_bounds = Bounds(d.num_drafters, max(d.max_drafters, d.num_drafters))
        self._verifier_hysteresis = Hysteresis(d.scale_down_delay_s)
        self._drafter_hysteresis = {kind: Hysteresis(d.scale_down_delay_s) for kind in d.drafter_kinds}
        self._busy_seen: dict[str, tuple[float, float]] = {}  # drafter metrics URL -> (seconds busy, when)

    # --- placing ------------------------------------------------------------------------------------------

    def _spawn(self, role: str, kind: str | None, argv: list[str], world_size: int = 1, **options: object) -> Placed:
        actor = self.remote.options(num_cpus=0, **options).remote(role, argv, self.in_cluster, world_size)
        return Placed(role, kind, actor, pending=actor.addresses.remote())

    def spawn_verifier(self) -> Placed:
        d, options, group = self.deployment, {}, None
        if d.verifier_gpus:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            # one bundle of all the verifier's GPUs: one node, and one actor that holds them for its ranks
            bundle: dict[str, float] = {"GPU": d.verifier_gpus}
            if self.in_cluster:  # on a node of the verifier pool, not any node with enough GPUs
                bundle[VERIFIER_RESOURCE] = 1
            group = placement_group([bundle], strategy="STRICT_PACK")
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
            options = {"num_gpus": d.verifier_gpus, "scheduling_strategy": strategy}
            if self.in_cluster:
                options["resources"] = {VERIFIER_RESOURCE: 1}
        elif self.in_cluster:
            options = {"resources": {VERIFIER_RESOURCE: 1}}
        placed = self._spawn("verifier", None, verifier_argv(d), max(1, d.verifier_gpus), **options)
        placed.group = group
        return placed

    def spawn_drafter(self, kind: str) -> Placed:
        options = {"resources": {DRAFTER_RESOURCE: 1}} if self.in_cluster else {}
        return self._spawn("drafter", kind, drafter_argv(self.deployment, kind), **options)

    def spawn_router(self) -> Placed:
        options = {"resources": {ROUTER_RESOURCE: 1}} if self.in_cluster else {}
        workers = [{"role": w.role, "address": w.address["grpc"]} for w in self.workers if w.serving]
        return self._spawn("router", None, router_argv(self.deployment, workers), **options)

    def place(self) -> None:
        """Place every worker, wait until all serve, then the routers; raise if any fails to start in time."""
        self.workers = [self.spawn_verifier() for _ in range(self.deployment.num_verifiers)]
        for kind in self.deployment.drafter_kinds:
            self.workers += [self.spawn_drafter(kind) for _ in range(self.deployment.num_drafters)]
        addresses = self.ray.get([w.pending for w in self.workers], timeout=self.timeout_s)
        for placed, address in zip(self.workers, addresses, strict=True):
            placed.address, placed.pending = address, None
        self.routers = [self.spawn_router() for _ in range(self.deployment.num_routers)]
        addresses = self.ray.get([r.pending for r in self.routers], timeout=self.timeout_s)
        for router, address in zip(self.routers, addresses, strict=True):
            router.address, router.pending, router.told = address, None, self._worker_set()
        self._record()

    # --- keeping placed -------------------------------------------------------------------------------------

    def _alive(self, placed: Placed) -> bool:
        """False when Ray says the actor died; a call that is only slow counts as alive."""
        ref = placed.actor.addresses.remote() if placed.pending is None else placed.pending
        ready, _ = self.ray.wait([ref], timeout=PROBE_S if placed.pending is None else 0)
        if not ready:
            return True
        try:
            address = self.ray.get(ready[0])
        except self.ray.exceptions.RayActorError:
            return False
        except self.ray.exceptions.RayError:  # it failed to start: try again as a new actor
            return False
        placed.address, placed.pending = address, None
        return True

    def _retire(self, placed: Placed, *, drain: bool) -> None:
        if drain:
            with contextlib.suppress(Exception):
                self.ray.get(placed.actor.stop.remote(), timeout=STOP_S)
        with contextlib.suppress(Exception):
            self.ray.kill(placed.actor)
        if placed.group is not None:
            with contextlib.suppress(Exception):
                self.ray.util.remove_placement_group(placed.group)

    def _replace(self, placed: Placed) -> Placed:
        LOG.warning("%s %s died; placing a replacement", placed.role, placed.address.get("grpc", "(starting)"))
        self._retire(placed, drain=False)
        if placed.role == "verifier":
            return self.spawn_verifier()
        assert placed.kind is not None
        return self.spawn_drafter(placed.kind)

    def _worker_set(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        serving = [w for w in self.workers if w.serving]
        return (
            tuple(w.address["grpc"] for w in serving if w.role == "verifier"),
            tuple(w.address["grpc"] for w in serving if w.role == "drafter"),
        )

    def reconcile(self, now: float | None = None) -> None:
        """One pass of the loop (module docstring)."""
        now = time.monotonic() if now is None else now
        self.workers = [w if self._alive(w) else self._replace(w) for w in self.workers]
        self._autoscale(now)
        self.routers = [r if self._alive(r) else self._replace_router(r) for r in self.routers]
        self._tell_routers()
        self._record()

    def _replace_router(self, placed: Placed) -> Placed:
        LOG.warning("router %s died; placing a replacement", placed.address.get("grpc", "(starting)"))
        self._retire(placed, drain=False)
        return self.spawn_router()  # over the current workers; told nothing yet

    def _tell_routers(self) -> None:
        """Give every serving router whose worker set is out of date the current one."""
        told = self._worker_set()
        for router in self.routers:
            if not router.serving or router.told == told:
                continue
            try:
                self.ray.get(router.actor.set_workers.remote(*map(list, told)), timeout=STOP_S)
                router.told = told
            except self.ray.exceptions.RayError as error:
                LOG.warning("could not update router %s's worker set: %s", router.address["grpc"], error)

    # --- scaling --------------------------------------------------------------------------------------------

    def _scales(self) -> bool:
        return self.verifier_bounds.maximum > self.verifier_bounds.minimum or (
            self.drafter_bounds.maximum > self.drafter_bounds.minimum
        )

    def _autoscale(self, now: float) -> None:
        if not self._scales():
            return
        # a router that does not answer is left out: scaling down needs the lower count wanted for a while, and
        # a dead router's requests come back on the others
        scraped = [scrape(r.address.get("metrics", "")) for r in self.routers if r.serving]
        routers = [samples for samples in scraped if samples is not None]
        if not routers:
            return
        d = self.deployment
        running = sum(samples.get("vllm:num_requests_running", 0.0) for samples in routers)
        waiting = sum(samples.get("vllm:num_requests_waiting", 0.0) for samples in routers)

        def targets(busy: float) -> tuple[int, int]:
            load = Load(running, waiting, busy)
            bounds = self.verifier_bounds, self.drafter_bounds
            return wanted(load, *bounds, per_verifier=d.requests_per_verifier, utilisation=d.drafter_utilisation)

        verifiers = [w for w in self.workers if w.role == "verifier"]
        count = self._verifier_hysteresis.decide(len(verifiers), targets(0.0)[0], now)
        self._resize(verifiers, count, self.spawn_verifier)
        for kind in d.drafter_kinds:
            drafters = [w for w in self.workers if w.role == "drafter" and w.kind == kind]
            busy = sum(self._busy(w, now) for w in drafters if w.serving)
            count = self._drafter_hysteresis[kind].decide(len(drafters), targets(busy)[1], now)
            self._resize(drafters, count, lambda kind=kind: self.spawn_drafter(kind))

    def _resize(self, group: list[Placed], count: int, spawn: Callable[[], Placed]) -> None:
        if count > len(group):
            LOG.info("scaling %s up: %d -> %d", group[0].role if group else "workers", len(group), count)
            self.workers += [spawn() for _ in range(count - len(group))]
        for placed in group[count:][::-1]:  # the newest first
            LOG.info("scaling %s down: retiring %s", placed.role, placed.address.get("grpc", "(starting)"))
            self.workers.remove(placed)
            self._tell_routers()  # out of every router's set before it drains
            self._retire(placed, drain=True)

    def _busy(self, placed: Placed, now: float) -> float:
        url = placed.address.get("metrics", "")
        seconds = (scrape(url) or {}).get("specdec:drafter_propose_seconds_sum")
        if seconds is None:
            return 0.0
        before = self._busy_seen.get(url)
        self._busy_seen[url] = (seconds, now)
        if before is None or now <= before[1]:
            return 0.0
        return max(0.0, seconds - before[0]) / (now - before[1])

    # --- records and stop -----------------------------------------------------------------------------------

    def _record(self) -> None:
        self.state.tls_dir = self.deployment.tls_dir or ""  # so that `specdec status` dials the services with it
        self.state.workers = [
            {"role": w.role, "address": w.address["grpc"], "metrics": w.address.get("metrics", "")}
            for w in self.workers
            if w.serving
        ]
        self.state.routers = [r.address for r in self.routers if r.serving]
        self.save()

    def stop(self) -> None:
        """Routers first (they drain their streams), then the workers, each gracefully, then killed."""
        placed = self.routers + self.workers[::-1]
        for service in placed:
            self._retire(service, drain=True)


def scrape(url: str, timeout_s: float = 2.0) -> dict[str, float] | None:
    """Prometheus samples at ``url`` summed over labels (name -> value); None when it cannot be read."""
    if not url:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode()
    except OSError:
        return None
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isfinite(sample.value):
                samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples
