"""One Ray actor class that serves any of the three services in its own process.

Each actor starts its service's gRPC server on a free port and reports the address (and where its
Prometheus metrics are scraped); the service code is the same as ``python -m <service>``, configured
by the same argument list. On a cluster (``on_node_address``) it binds the address Ray knows its node by
(on KubeRay: the pod's IP, which Services, probes and the router dial) instead of loopback; a ``--host`` in
``argv`` still wins.
"""

from __future__ import annotations

from typing import Any

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

    def addresses(self) -> dict[str, str]:
        """Where the service listens: ``{"grpc": host:port}``, ``"metrics"`` (a URL) when it serves metrics,
        and ``"http"`` for the router."""
        return self._addresses

    def stop(self) -> None:
        self._running.stop()


def _worker_addresses(grpc_address: str, metrics_address: str | None) -> dict[str, str]:
    if metrics_address is None:
        return {"grpc": grpc_address}
    return {"grpc": grpc_address, "metrics": f"http://{metrics_address}/metrics"}
