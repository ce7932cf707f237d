"""``python -m grpc_common.probe HOST:PORT [--tls-cert C --tls-key K --tls-ca CA [--tls-server-name N]]``: one
grpc.health.v1 check, exit status 0 when the service answers SERVING, 1 otherwise (the status on stdout). ``:PORT``
dials this host's own address (what its host name resolves to: in a pod, the pod IP its services bind).

Kubernetes' own gRPC probes cannot speak TLS, so a service with ``--tls-*`` is probed with this command (an exec
probe) instead; the TLS flags and their ``SPECDEC_PROBE_TLS_*`` env fallbacks are the services' own
(:mod:`grpc_common.tls`). ``specdec status`` uses :func:`check_health` too.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grpc_common.tls import PLAINTEXT, TlsConfig, add_tls_arguments, channel, tls_from_args
from specdec.errors import InvalidArgumentError

ENV_PREFIX = "SPECDEC_PROBE_"


def check_health(address: str, tls: TlsConfig = PLAINTEXT, timeout_s: float = 2.0, service: str = "") -> str:
    """grpc.health.v1 status of ``service`` at ``address`` (mutual TLS with ``tls`` when enabled): SERVING,
    NOT_SERVING, ... or UNREACHABLE (no answer, a refused handshake included)."""
    with channel(address, tls) as opened:
        try:
            reply = health_pb2_grpc.HealthStub(opened).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grpc_common.probe", description="One grpc.health.v1 check: exit 0 when SERVING."
    )
    parser.add_argument("address", help="HOST:PORT of the gRPC service")
    parser.add_argument("--timeout-s", type=float, default=2.0)
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    add_tls_arguments(parser, ENV_PREFIX, os.environ, dials=True)
    values = vars(parser.parse_args(argv))
    try:
        tls = tls_from_args(values)
    except InvalidArgumentError as error:
        print(f"probe: {error}", file=sys.stderr)
        return 2
    address = values["address"]
    if address.startswith(":"):
        address = socket.gethostbyname(socket.gethostname()) + address
    status = check_health(address, tls, values["timeout_s"], values["service"])
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
