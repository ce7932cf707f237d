"""One Ray actor class that serves any of the three services in its own process.

Each actor starts its service's gRPC server on a free port and reports the address (and where its
Prometheus metrics are scraped); the service code is the same as ``python -m <service>``, configured
by the same argument list. On a cluster (``on_node_address``) it binds the address Ray knows its node by
(on KubeRay: the pod's IP, which Services, probes and the router dial) instead of loopback; a ``--host`` in
``argv`` still wins. There it also watches the drain file of :mod:`launcher.drain` (the pod's ``preStop``
hook creates it): the service then stops gracefully and reports that it did.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from launcher.drain import POLL_S, done_file, drain_file

ROLES = ("verifier", "drafter", "router")


class ServiceActor:
    """Serves ``role`` configured by ``argv`` (the service's own command-line arguments)."""

    def __init__(self, role: str, argv: list[str], on_node_address: bool = False, world_size: int = 1) -> None:
        if on_node_address:
            import ray

            argv = ["--host", ray.util.get_node_ip_address(), *argv]
        if role == "verifier" and world_size > 1:
            running: Any = TensorParallelVerifier(argv, world_size)
            self._addresses = _worker_addresses(running.address, running.metrics_address)
        elif role == "verifier":
            from verifier_service.config import VerifierConfig
            from verifier_service.server import start_verifier_process

            running = start_verifier_process(VerifierConfig.from_args(argv))
            self._addresses = _worker_addresses(running.address, running.metrics_address)
        elif role == "drafter":
            from drafter_service.config import DrafterConfig
            from drafter_service.server import start_drafter_process

            running = start_drafter_process(DrafterConfig.from_args(argv))
            self._addresses = _worker_addresses(running.address, running.metrics_address)
        elif role == "router":
            from router.config import RouterConfig
            from router.server import start_router_process

            running = start_router_process(RouterConfig.from_args(argv))
            http = running.http_address
            scheme = "https" if running.config.tls.enabled else "http"
            self._addresses = {"grpc": running.grpc_address, "http": http, "metrics": f"{scheme}://{http}/metrics"}
        else:
            raise ValueError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
        self._running = running
        self.role = role
        self._stopped = threading.Lock()
        if on_node_address:
            path = drain_file()
            for stale in (path, done_file(path)):  # left by an earlier container of this pod
                stale.unlink(missing_ok=True)
            threading.Thread(target=self._drain_when_asked, args=(path,), daemon=True).start()

    def addresses(self) -> dict[str, str]:
        """Where the service listens: ``{"grpc": host:port}``, ``"metrics"`` (a URL) when it serves metrics,
        and ``"http"`` for the router."""
        return self._addresses

    def set_workers(self, verifiers: list[str], drafters: list[str]) -> None:
        """The router's worker set, as the supervisor sees it (a router only)."""
        self._running.set_workers(verifiers, drafters)

    def stop(self) -> None:
        """Drain the service (once; later calls return at once)."""
        if self._stopped.acquire(blocking=False):
            self._running.stop()

    def _drain_when_asked(self, path: Path) -> None:
        while not path.exists():
            time.sleep(POLL_S)
        self.stop()
        done_file(path).touch()


class TensorParallelVerifier:
    """A verifier sharded over ``world_size`` ranks: ``python -m verifier_service`` child processes of the actor,
    which holds their GPUs (each rank takes ``cuda:rank`` of the devices Ray gave it). Rank 0 serves; its ready
    line carries the addresses; SIGTERM to rank 0 drains it (``--grace-s``) and stops the others."""

    def __init__(self, argv: list[str], world_size: int) -> None:
        import json
        import os
        import socket
        import subprocess
        import sys

        with socket.socket() as probe:  # a free rendezvous port on this node
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size)}
        command = [sys.executable, "-m", "verifier_service", *argv]
        self.ranks = [
            subprocess.Popen(
                command,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                text=True,
            )
            for rank in range(world_size)
        ]
        line = self.ranks[0].stdout.readline() if self.ranks[0].stdout is not None else ""
        if not line:
            self._kill()
            raise RuntimeError(f"tensor-parallel verifier rank 0 exited ({self.ranks[0].wait()}) before serving")
        ready = json.loads(line)
        self.address: str = ready["address"]
        self.metrics_address: str | None = ready.get("metrics")

    def stop(self, timeout_s: float = 120) -> None:
        import signal
        import subprocess

        self.ranks[0].send_signal(signal.SIGTERM)
        try:
            for rank in self.ranks:
                rank.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._kill()

    def _kill(self) -> None:
        for rank in self.ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()


def _worker_addresses(grpc_address: str, metrics_address: str | None) -> dict[str, str]:
    if metrics_address is None:
        return {"grpc": grpc_address}
    return {"grpc": grpc_address, "metrics": f"http://{metrics_address}/metrics"}
