"""A ``grpc.health.v1`` check from inside a pod, for probes the kubelet's own ``grpc:`` probe cannot make.

The kubelet's gRPC probe speaks plaintext only, so with mutual TLS between the services (the ``tls`` overlay)
the probes become ``exec`` probes running this command with the pod's own certificate. It exits 0 when
``--service`` answers SERVING and 1 otherwise (NOT_SERVING, refused, timed out, TLS refused).

    python -m launcher.probe --port 50061 --service specdec.v1.Verifier --tls-dir /etc/specdec/tls

Services on a cluster bind the pod's address (:mod:`launcher.actors`), which is what the pod's host name
resolves to; ``--tls-dir`` holds ``tls.crt``, ``tls.key`` and ``ca.crt`` (the layout of a cert-manager Secret),
and ``--server-name`` is the name the servers' certificate carries (pods are dialled by IP).
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path


def check(host: str, port: int, service: str, *, timeout_s: float, tls_dir: Path | None, server_name: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if tls_dir is None:
        channel = grpc.insecure_channel(target)
    else:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=(tls_dir / "ca.crt").read_bytes(),
            private_key=(tls_dir / "tls.key").read_bytes(),
            certificate_chain=(tls_dir / "tls.crt").read_bytes(),
        )
        channel = grpc.secure_channel(target, credentials, options=[("grpc.ssl_target_name_override", server_name)])
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.probe", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=None, help="default: the address the pod's host name resolves to")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--service", default="", help='grpc.health.v1 service name ("": the whole server)')
    parser.add_argument("--timeout-s", type=float, default=3.0)
    parser.add_argument("--tls-dir", type=Path, help="tls.crt, tls.key and ca.crt: dial with mutual TLS")
    parser.add_argument("--server-name", default="specdec.internal", help="name the servers' certificate carries")
    args = parser.parse_args(argv)
    host = args.host or socket.gethostbyname(socket.gethostname())
    ok = check(
        host, args.port, args.service, timeout_s=args.timeout_s, tls_dir=args.tls_dir, server_name=args.server_name
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
