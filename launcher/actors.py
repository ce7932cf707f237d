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

    def __init__(self, role: str, argv: list[str], on_node_address: bool = False) -> None:
        if on_node_address:
            import ray

            argv = ["--host", ray.util.get_node_ip_address(), *argv]
        if role == "verifier":
            from verifier_service.config import VerifierConfig
            from verifier_service.server import start_verifier

            running = start_verifier(VerifierConfig.from_args(argv))
            self._addresses = _worker_addresses(running.address, running.metrics_address)
        elif role == "drafter":
            from drafter_service.config import DrafterConfig
            from drafter_service.server import start_drafter

            running = start_drafter(DrafterConfig.from_args(argv))
            self._addresses = _worker_addresses(running.address, running.metrics_address)
        elif role == "router":
            from router.config import RouterConfig
            from router.server import start_router

            running = start_router(RouterConfig.from_args(argv))
            http = running.http_address
            self._addresses = {"grpc": running.grpc_address, "http": http, "metrics": f"http://{http}/metrics"}
        else:
            raise ValueError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
        self._running: Any = running
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


def _worker_addresses(grpc_address: str, metrics_address: str | None) -> dict[str, str]:
    if metrics_address is None:
        return {"grpc": grpc_address}
    return {"grpc": grpc_address, "metrics": f"http://{metrics_address}/metrics"}
