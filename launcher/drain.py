"""Drain the service on this Kubernetes pod before it is stopped: the ``preStop`` hook of a Ray worker pod.

A service placed by ``specdec up`` runs as a Ray actor inside the pod's Ray container, so the SIGTERM Kubernetes
sends reaches Ray, not the service. On a cluster every :class:`~launcher.actors.ServiceActor` watches a drain
file (``SPECDEC_DRAIN_FILE``, default :data:`DEFAULT_DRAIN_FILE`); this command waits ``--delay-s`` (for the
endpoints to drop a router pod whose readiness is about to fail), creates the file, and returns once the service
says it has drained (health NOT_SERVING, in-flight calls given the service's ``--grace-s`` /
``--shutdown-grace-s``) or after ``--timeout-s``. The pod's ``terminationGracePeriodSeconds`` must cover
``delay_s + timeout_s`` and Ray's own stop after it (the Kubernetes tests check that).

    python -m launcher.drain --delay-s 5 --timeout-s 40
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

DEFAULT_DRAIN_FILE = Path("/tmp/specdec/drain")
POLL_S = 0.2


def drain_file() -> Path:
    return Path(os.environ.get("SPECDEC_DRAIN_FILE", DEFAULT_DRAIN_FILE))


def done_file(path: Path) -> Path:
    """Where a service reports that it drained."""
    return path.with_name(path.name + ".done")


def drain(path: Path, *, delay_s: float, timeout_s: float) -> bool:
    """Ask the service to drain; True once it reported so within ``timeout_s``."""
    time.sleep(delay_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done_file(path).exists():
            return True
        time.sleep(POLL_S)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.drain", description=__doc__.splitlines()[0])
    parser.add_argument("--delay-s", type=float, default=0.0, help="wait before draining (endpoint propagation)")
    parser.add_argument("--timeout-s", type=float, required=True, help="longest wait for the service to drain")
    args = parser.parse_args(argv)
    return 0 if drain(drain_file(), delay_s=args.delay_s, timeout_s=args.timeout_s) else 1


if __name__ == "__main__":
    raise SystemExit(main())
