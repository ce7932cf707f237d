"""The supervisor ``specdec up`` leaves running: owns the Ray driver and the service actors.

It records progress in the state file (``starting`` → ``ready`` with addresses, or ``failed``),
then reconciles every ``reconcile_interval_s`` (:meth:`launcher.supervise.Supervisor.reconcile`: re-place dead
workers, scale, keep the router told) until SIGTERM/SIGINT, when it stops the services (gracefully, then by killing the
actors), shuts Ray down (and with it a local instance it started) and removes the state file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import traceback
from pathlib import Path

from launcher.cluster import NAMESPACE, ClusterState, Deployment
from launcher.supervise import Supervisor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.daemon")
    parser.add_argument("--state-file", type=Path, required=True)
    parser.add_argument("--deployment", required=True, help="Deployment as JSON")
    parser.add_argument("--address", help="existing Ray cluster")
    parser.add_argument("--num-cpus", type=int)
    args = parser.parse_args(argv)
    values = json.loads(args.deployment)
    deployment = Deployment(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
    state = ClusterState(os.getpid())
    stop = threading.Event()

    import ray

    supervisor: Supervisor | None = None
    try:
        context = ray.init(
            address=args.address,
            num_cpus=None if args.address else args.num_cpus,
            namespace=NAMESPACE,
            include_dashboard=False,
            log_to_driver=False,
        )
        state.ray_address = context.address_info.get("gcs_address", args.address or "")
        for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
            signal.signal(signum, lambda *_: stop.set())
        supervisor = Supervisor(
            deployment,
            state,
            in_cluster=args.address is not None,
            save=lambda: state.save(args.state_file),
            timeout_s=deployment.start_timeout_s,
        )
        supervisor.place()
        state.status = "ready"
        state.save(args.state_file)
        while not stop.wait(deployment.reconcile_interval_s):
            try:
                supervisor.reconcile()
            except Exception:  # one bad pass (a Ray hiccup) must not end the supervision
                logging.exception("reconcile failed")
    except Exception:
        state.status, state.error = "failed", traceback.format_exc()
        state.save(args.state_file)
        return 1
    finally:
        if supervisor is not None:
            supervisor.stop()
        ray.shutdown()
        if state.status == "ready":
            args.state_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
