"""``make demo`` reads what ``specdec up`` prints: a regression test for the demo breaking when ``up`` began reporting
a list of routers (router replicas) instead of one router."""

from __future__ import annotations

import json

from bench.demo import first_router
from launcher.cluster import ClusterState


def test_the_demo_reads_the_router_that_up_reports() -> None:
    router = {"grpc": "127.0.0.1:5001", "http": "127.0.0.1:5002"}
    state = ClusterState(supervisor_pid=1, status="ready", routers=[router], workers=[])
    assert first_router(json.loads(json.dumps(state.addresses()))) == router
