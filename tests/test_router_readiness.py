"""The router's gRPC readiness (``specdec.v1.Router``) follows its verifiers; its liveness (``""``) does not.

A Kubernetes readiness probe on :data:`router.server.READINESS_SERVICE` must take a router without a healthy
verifier out of its Service, while the liveness probe on :data:`router.server.LIVENESS_SERVICE` must not restart
it for that. The verifier here is a bare ``grpc.health.v1`` server whose answer the test sets.
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.config import RouterConfig
from router.server import LIVENESS_SERVICE, READINESS_SERVICE, start_router

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _status(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status


def _wait_for(address: str, service: str, expected: int, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (status := _status(address, service)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return status


def test_router_readiness_follows_verifier_health() -> None:
    verifier_health = health.HealthServicer()
    verifier = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(verifier_health, verifier)
    port = verifier.add_insecure_port("127.0.0.1:0")
    verifier.start()
    verifier_health.set("", NOT_SERVING)  # still loading its model
    config = RouterConfig(model="m", verifiers=(f"127.0.0.1:{port}",), grpc_port=0, http_port=0, health_interval_s=0.05)
    router = start_router(config)
    try:
        address = router.grpc_address
        assert _status(address, READINESS_SERVICE) == NOT_SERVING  # no healthy verifier: not ready
        assert _status(address, LIVENESS_SERVICE) == SERVING  # but alive
        verifier_health.set("", SERVING)
        assert _wait_for(address, READINESS_SERVICE, SERVING) == SERVING
        verifier_health.set("", NOT_SERVING)  # the only verifier drains
        assert _wait_for(address, READINESS_SERVICE, NOT_SERVING) == NOT_SERVING
        assert _status(address, LIVENESS_SERVICE) == SERVING
    finally:
        router.stop(0)
        verifier.stop(0)


def test_router_worker_set_follows_the_supervisor() -> None:
    """A re-placed verifier comes back at a new address: the supervisor swaps it in; none left: not ready."""
    servers, addresses = [], []
    for _ in range(2):
        servicer = health.HealthServicer()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    old, new = addresses
    config = RouterConfig(model="m", verifiers=(old,), grpc_port=0, http_port=0, health_interval_s=3600)
    router = start_router(config)
    try:
        assert [(w.address, w.healthy) for w in router.frontend.workers()] == [(old, True)]
        router.set_workers([new], [])
        assert [(w.address, w.healthy) for w in router.frontend.workers()] == [(new, True)]  # checked on arrival
        assert _wait_for(router.grpc_address, READINESS_SERVICE, SERVING) == SERVING
        router.set_workers([], [])
        assert router.frontend.workers() == []
        assert _wait_for(router.grpc_address, READINESS_SERVICE, NOT_SERVING) == NOT_SERVING
    finally:
        router.stop(0)
        for server in servers:
            server.stop(0)
