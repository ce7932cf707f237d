"""``python -m router`` as an operator runs it: one JSON line with the addresses once serving, health over
gRPC and HTTP, a graceful exit on SIGTERM, and a one-line error for a bad configuration."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.test_router_grpc import FakeVerifier, serve_verifier
from tests.test_router_http import request

REPO = Path(__file__).resolve().parents[1]


def environment() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def test_serves_then_drains_on_sigterm() -> None:
    verifier = serve_verifier(FakeVerifier())
    command = [sys.executable, "-m", "router", "--model", "fake", "--no-tokenizer", "--verifier", verifier.address]
    command += ["--grpc-port", "0", "--http-port", "0", "--shutdown-grace-s", "1"]
    process = subprocess.Popen(
        command, cwd=REPO, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        ready = json.loads(process.stdout.readline())
        assert ready["model"] == "fake"
        with grpc.insecure_channel(ready["grpc"]) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        status, _, body = request(ready["http"], "GET", "/health")
        assert (status, json.loads(body)) == (200, {"status": "ok"})
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)
        verifier.stop(0)


def refused(arguments: list[str], env: dict[str, str]) -> list[str]:
    """Run ``python -m router ARGUMENTS``, which must exit 2 printing nothing on stdout; its stderr lines."""
    command = [sys.executable, "-m", "router", "--model", "fake", "--no-tokenizer", *arguments]
    completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 2 and completed.stdout == ""
    return completed.stderr.strip().splitlines()


def test_bad_configuration_is_one_line() -> None:
    lines = refused([], environment())
    assert lines == ["router: error: verifiers: at least one verifier address is required"]


def test_a_bad_garbage_collector_policy_is_one_line() -> None:
    lines = refused(["--verifier", "127.0.0.1:1"], {**environment(), "SPECDEC_GC": "off"})
    assert lines == ["router: error: SPECDEC_GC: must be one of server, default, got 'off'"]
