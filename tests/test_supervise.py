"""The supervisor's loop without a cluster: re-placement of dead actors, scaling, and what the router is told.

Ray is replaced by a small fake with the calls :class:`launcher.supervise.Supervisor` makes (``remote``,
``options``, ``wait``, ``get``, ``kill``, actor exceptions); each fake actor serves at a fresh address, as a
re-placed actor on a new pod would. The scaling rule itself is :mod:`launcher.autoscale`, tested as plain code.
"""

from __future__ import annotations

import itertools
import os
import types
from dataclasses import replace

import pytest

from launcher import supervise
from launcher.autoscale import Bounds, Hysteresis, Load, wanted
from launcher.cluster import DRAFTER_RESOURCE, ROUTER_RESOURCE, VERIFIER_RESOURCE, ClusterState, Deployment


class ActorDied(Exception):
    pass


class Ref:
    def __init__(self, value: object = None, error: Exception | None = None) -> None:
        self.value, self.error = value, error


class FakeActor:
    ports = itertools.count(1000)

    def __init__(self, role: str, argv: list[str], options: dict) -> None:
        self.role, self.argv, self.options = role, argv, options
        self.dead = False
        self.stopped = False
        self.told: list[tuple[list[str], list[str]]] = []
        port = next(self.ports)
        self.address = {"grpc": f"10.0.0.{port % 250}:{port}", "metrics": ""}
        if role == "router":
            self.address["metrics"] = "http://router/metrics"
        self.addresses = types.SimpleNamespace(remote=self._addresses)
        self.stop = types.SimpleNamespace(remote=self._stop)
        self.set_workers = types.SimpleNamespace(remote=self._set_workers)

    def _addresses(self) -> Ref:
        return Ref(error=ActorDied()) if self.dead else Ref(self.address)

    def _stop(self) -> Ref:
        self.stopped = True
        return Ref(None)

    def _set_workers(self, verifiers: list[str], drafters: list[str]) -> Ref:
        self.told.append((verifiers, drafters))
        return Ref(None)


class FakeRay:
    def __init__(self) -> None:
        self.actors: list[FakeActor] = []
        self.killed: list[FakeActor] = []
        self.exceptions = types.SimpleNamespace(RayActorError=ActorDied, RayError=Exception)

    def remote(self, cls: type) -> object:
        fake = self

        class Options:
            def options(self, **options: object) -> object:
                return types.SimpleNamespace(
                    remote=lambda role, argv, in_cluster, world_size=1: fake._new(role, argv, options)
                )

        return Options()

    def _new(self, role: str, argv: list[str], options: dict) -> FakeActor:
        actor = FakeActor(role, argv, options)
        self.actors.append(actor)
        return actor

    def wait(self, refs: list[Ref], timeout: float) -> tuple[list[Ref], list[Ref]]:
        return refs, []

    def get(self, refs: Ref | list[Ref], timeout: float | None = None) -> object:
        if isinstance(refs, list):
            return [self.get(ref) for ref in refs]
        if refs.error is not None:
            raise refs.error
        return refs.value

    def kill(self, actor: FakeActor) -> None:
        self.killed.append(actor)


def _supervisor(monkeypatch: pytest.MonkeyPatch, deployment: Deployment, metrics: dict[str, dict]) -> tuple:
    fake = FakeRay()
    monkeypatch.setitem(__import__("sys").modules, "ray", fake)
    monkeypatch.setattr(supervise, "scrape", lambda url, timeout_s=2.0: metrics.get(url))
    sup = supervise.Supervisor(deployment, ClusterState(1), in_cluster=True)
    sup.place()
    return sup, fake


def test_a_dead_worker_is_replaced_and_the_router_told_its_new_address(monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = Deployment(drafter_kinds=("ngram",), num_drafters=2, num_verifiers=1)
    sup, fake = _supervisor(monkeypatch, deployment, {})
    router = sup.routers[0].actor
    assert [a.role for a in fake.actors] == ["verifier", "drafter", "drafter", "router"]
    assert fake.actors[0].options == {"num_cpus": 0, "resources": {VERIFIER_RESOURCE: 1}}
    assert fake.actors[1].options == {"num_cpus": 0, "resources": {DRAFTER_RESOURCE: 1}}
    assert router.options == {"num_cpus": 0, "resources": {ROUTER_RESOURCE: 1}}
    assert router.argv.count("--drafter") == 2 and router.argv.count("--verifier") == 1
    sup.reconcile(now=0)
    assert router.told == []  # nothing changed: the router is not bothered
    dead = fake.actors[1]
    dead.dead = True
    sup.reconcile(now=10)
    replacement = fake.actors[-1]
    assert replacement.role == "drafter" and replacement.argv == dead.argv and dead in fake.killed
    verifier, survivor = fake.actors[0].address["grpc"], fake.actors[2].address["grpc"]
    assert router.told == [([verifier], [survivor])]  # the dead one out at once
    sup.reconcile(now=20)  # the replacement serves (at its new address): in
    told_verifiers, told_drafters = router.told[-1]
    assert told_verifiers == [verifier] and sorted(told_drafters) == sorted([survivor, replacement.address["grpc"]])
    assert sorted(w["address"] for w in sup.state.workers) == sorted(
        a.address["grpc"] for a in (fake.actors[0], fake.actors[2], replacement)
    )


def _worker_flags(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, x in enumerate(argv) if x in ("--verifier", "--drafter")]


def test_a_dead_router_is_replaced_over_the_current_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    sup, fake = _supervisor(monkeypatch, Deployment(), {})
    old = sup.routers[0].actor
    old.dead = True
    sup.reconcile(now=0)
    [router] = sup.routers
    assert router.actor is not old and router.actor.role == "router" and old in fake.killed
    sup.reconcile(now=10)  # it serves: its address is the one recorded (on KubeRay the Service follows the pod)
    assert sup.state.routers == [router.actor.address]
    workers = [a.address["grpc"] for a in fake.actors if a.role != "router"]
    assert _worker_flags(router.actor.argv) == workers


def test_several_routers_share_every_worker_and_each_is_kept_placed_and_told(monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = Deployment(drafter_kinds=("ngram",), num_drafters=2, num_routers=3)
    sup, fake = _supervisor(monkeypatch, deployment, {})
    routers = [a for a in fake.actors if a.role == "router"]
    workers = [a.address["grpc"] for a in fake.actors if a.role != "router"]
    assert len(routers) == 3 and len({r.address["grpc"] for r in routers}) == 3
    for router in routers:  # each on a router pod of its own, each over all the workers
        assert router.options == {"num_cpus": 0, "resources": {ROUTER_RESOURCE: 1}}
        assert _worker_flags(router.argv) == workers
    assert sup.state.routers == [r.address for r in routers]  # `specdec status` lists every one
    fake.actors[1].dead = True  # a drafter: every router hears of it
    sup.reconcile(now=0)
    assert all(len(r.told) == 1 and r.told[0][1] == [fake.actors[2].address["grpc"]] for r in routers)
    routers[1].dead = True  # one router: replaced alone, the others keep serving untouched
    sup.reconcile(now=10)
    replacement = sup.routers[1].actor
    assert replacement not in routers and routers[1] in fake.killed
    assert [r.actor for r in sup.routers] == [routers[0], replacement, routers[2]]
    assert routers[0] not in fake.killed and routers[2] not in fake.killed
    current = sorted(w.address["grpc"] for w in sup.workers if w.serving)
    assert sorted(_worker_flags(replacement.argv)) == current
    sup.reconcile(now=20)
    assert sup.state.routers == [r.actor.address for r in sup.routers]
    sup.stop()
    assert all(r.stopped for r in (routers[0], replacement, routers[2]))


def test_several_routers_on_one_machine_need_free_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    fixed = Deployment(num_routers=2, router_args=("--grpc-port=50051", "--http-port", "8000"))
    monkeypatch.setitem(__import__("sys").modules, "ray", FakeRay())
    with pytest.raises(ValueError, match="--grpc-port=50051, --http-port=8000"):
        supervise.Supervisor(fixed, ClusterState(1), in_cluster=False)
    with pytest.raises(ValueError, match="num_routers"):
        supervise.Supervisor(Deployment(num_routers=0), ClusterState(1), in_cluster=True)
    supervise.Supervisor(fixed, ClusterState(1), in_cluster=True)  # one pod, one node address each
    supervise.Supervisor(replace(fixed, router_args=("--shutdown-grace-s=5",)), ClusterState(1), in_cluster=False)


def test_up_and_status_carry_every_router(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    import argparse

    from launcher import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    assert cli.deployment_from(parser.parse_args(["up", "--num-routers", "2"])).num_routers == 2
    routers = [{"grpc": f"127.0.0.1:{port}", "http": f"127.0.0.1:{port + 1}"} for port in (5000, 6000)]
    ClusterState(1, status="ready", routers=routers).save(tmp_path / "cluster.json")
    monkeypatch.setattr(cli, "health", lambda address, tls_dir="": f"SERVING({address})")
    report = cli.status(tmp_path / "cluster.json")
    assert [r["health"] for r in report["routers"]] == ["SERVING(127.0.0.1:5000)", "SERVING(127.0.0.1:6000)"]
    assert report["router_target"] == "ipv4:127.0.0.1:5000,127.0.0.1:6000"
    monkeypatch.setattr(cli, "state_file", lambda: tmp_path / "cluster.json")
    cli._run_status(argparse.Namespace(json=False))
    out = capsys.readouterr().out
    assert out.count("router ") == 2 and "ipv4:127.0.0.1:5000,127.0.0.1:6000" in out


def test_queue_length_adds_verifiers_at_once_and_retires_them_only_after_the_delay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    deployment = replace(Deployment(), max_verifiers=3, requests_per_verifier=10, scale_down_delay_s=60)
    metrics = {"http://router/metrics": {"vllm:num_requests_running": 10.0, "vllm:num_requests_waiting": 15.0}}
    sup, fake = _supervisor(monkeypatch, deployment, metrics)
    sup.reconcile(now=0)
    verifiers = [w for w in sup.workers if w.role == "verifier"]
    assert len(verifiers) == 3  # ceil(25 / 10), within the maximum; on KubeRay: pending actors, new pods
    sup.reconcile(now=1)  # once they serve, the router routes to them
    assert len(sup.routers[0].actor.told[-1][0]) == 3
    metrics["http://router/metrics"] = {"vllm:num_requests_running": 1.0, "vllm:num_requests_waiting": 0.0}
    sup.reconcile(now=10)
    assert len([w for w in sup.workers if w.role == "verifier"]) == 3  # not yet: a lull is not a trend
    sup.reconcile(now=75)
    remaining = [w for w in sup.workers if w.role == "verifier"]
    assert len(remaining) == 1  # back to the floor, the newest retired first, drained, then killed
    retired = [v.actor for v in verifiers[1:]]
    assert all(a.stopped and a in fake.killed for a in retired)
    assert sup.routers[0].actor.told[-1][0] == [remaining[0].address["grpc"]]


def test_the_queue_is_summed_over_the_routers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two routers with 12 requests each want ceil(24 / 10) = 3 verifiers; each alone would want 2. A router whose
    metrics do not answer is left out (here: back to 12 requests, 2 verifiers, kept by the scale-down delay)."""
    deployment = replace(Deployment(), num_routers=2, max_verifiers=4, requests_per_verifier=10, scale_down_delay_s=60)
    metrics: dict[str, dict] = {}
    fake = FakeRay()
    monkeypatch.setitem(__import__("sys").modules, "ray", fake)
    monkeypatch.setattr(supervise, "scrape", lambda url, timeout_s=2.0: metrics.get(url))
    original = FakeActor.__init__

    def distinct_metrics(self: FakeActor, role: str, argv: list[str], options: dict) -> None:
        original(self, role, argv, options)
        if role == "router":
            self.address["metrics"] = f"http://{self.address['grpc']}/metrics"

    monkeypatch.setattr(FakeActor, "__init__", distinct_metrics)
    sup = supervise.Supervisor(deployment, ClusterState(1), in_cluster=True)
    sup.place()
    urls = [r.address["metrics"] for r in sup.routers]
    for url in urls:
        metrics[url] = {"vllm:num_requests_running": 8.0, "vllm:num_requests_waiting": 4.0}
    sup.reconcile(now=0)
    assert len([w for w in sup.workers if w.role == "verifier"]) == 3
    del metrics[urls[1]]
    sup.reconcile(now=100)
    assert len([w for w in sup.workers if w.role == "verifier"]) == 3  # wanted 2 only since t=100
    assert all(len(r.actor.told[-1][0]) == 3 for r in sup.routers)


def test_scaling_rule() -> None:
    verifiers, drafters = Bounds(1, 4), Bounds(2, 8)
    assert wanted(Load(0, 0, 0), verifiers, drafters, per_verifier=32, utilisation=0.7) == (1, 2)  # the floor
    assert wanted(Load(40, 30, 1.5), verifiers, drafters, per_verifier=32, utilisation=0.7) == (3, 3)
    assert wanted(Load(500, 500, 50), verifiers, drafters, per_verifier=32, utilisation=0.7) == (4, 8)  # the cap
    hysteresis = Hysteresis(delay_s=60)
    assert hysteresis.decide(current=2, target=3, now=0) == 3  # up at once
    assert hysteresis.decide(current=3, target=1, now=10) == 3
    assert hysteresis.decide(current=3, target=2, now=50) == 3  # still wanting less, since t=10
    assert hysteresis.decide(current=3, target=3, now=60) == 3  # a break resets the clock
    assert hysteresis.decide(current=3, target=1, now=61) == 3
    assert hysteresis.decide(current=3, target=1, now=121) == 1


@pytest.mark.slow
def test_a_tensor_parallel_verifier_actor_serves_through_its_ranks(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a verifier actor with ``verifier_gpus`` > 1 runs: that many ranks (gloo on CPU here), rank 0 serving."""
    from launcher.actors import ServiceActor
    from launcher.cluster import health
    from tests.tiny_models import tiny_llama

    tiny_llama(seed=21, vocab_size=8, num_layers=2).model.save_pretrained(tmp_path)  # 2 KV heads: splits in two
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    actor = ServiceActor("verifier", ["--model", str(tmp_path), "--port", "0", "--torch-threads", "1"], world_size=2)
    ranks = actor._running.ranks
    try:
        assert len(ranks) == 2 and all(rank.poll() is None for rank in ranks)
        assert health(actor.addresses()["grpc"]) == "SERVING"
        actor.stop()
        assert [rank.wait(timeout=60) for rank in ranks] == [0, 0]  # rank 0 drained, the follower followed
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()


def test_an_actor_applies_the_process_settings_of_python_m(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Ray actor (``specdec up``, KubeRay) applies what ``python -m verifier_service`` does before and after the
    service starts: here its ``--torch-threads`` and the frozen collector (it once applied neither)."""
    import gc

    import torch

    from grpc_common.process import ONEDNN_SHAPE_CACHE_ENTRIES, ONEDNN_SHAPE_CACHES
    from launcher.actors import ServiceActor
    from specdec import gc_policy
    from tests.tiny_models import tiny_llama

    tiny_llama(seed=21, vocab_size=8, num_layers=1).model.save_pretrained(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(gc_policy.ENV, raising=False)
    for variable in ONEDNN_SHAPE_CACHES:  # what the actor's prepare() sets, undone after the test
        monkeypatch.setenv(variable, os.environ.get(variable, str(ONEDNN_SHAPE_CACHE_ENTRIES)))
    threads, thresholds = torch.get_num_threads(), gc.get_threshold()
    wanted_threads = 1 if threads > 1 else 2
    gc.unfreeze()
    argv = ["--model", str(tmp_path), "--port", "0", "--torch-threads", str(wanted_threads)]
    try:
        actor = ServiceActor("verifier", [*argv, "--malloc-mmap-threshold-mb", "0"])  # 0: this process's malloc kept
        try:
            assert torch.get_num_threads() == wanted_threads
            assert gc.get_freeze_count() > 0
            assert gc.get_threshold() == thresholds  # a model service keeps CPython's
        finally:
            actor.stop()
    finally:
        torch.set_num_threads(threads)
        gc.unfreeze()
        gc.set_threshold(*thresholds)
